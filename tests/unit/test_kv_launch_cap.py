"""``partial.kv_tokens_per_server``: calls per server capped at the KV cache over a sample's expected context.

A vLLM server admits a request by its length at admission and, when the running ones outgrow its cache, preempts the
newest and later recomputes it (SGLang retracts alike). ``fill_engine`` keeps every slot busy with long carried-over
answers, so on a server whose cache cannot hold ``max_num_seqs`` of them the driver must not send more than it holds.
Through the real scheduler over the simulated engine (``sim_engine.py``); ``auto`` (the default) takes the size the
servers report, as the glue hands it over (``RolloutPool.server_kv_tokens``). What the cap buys on a KV-bound server
is measured in benchmarks (``bench_peer``'s ``default`` against ``default_kv_off``), not here.
"""

from __future__ import annotations

import dataclasses

from sim_engine import PROMPT_LEN, SimEngine, SimServer
from test_partial_scheduler import check_groups, check_ledger, simulate

from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PRESETS, PartialConfig

N, BATCH, LENGTH, SEED, STEPS = 4, 4, 200, 3, 5


def run(kv_tokens_per_server: int | str, max_num_seqs: int = 64, server_kv_tokens: int | None = None):
    config = dataclasses.replace(PRESETS["default"], kv_tokens_per_server=kv_tokens_per_server)
    engine = SimEngine(SEED, LENGTH, [SimServer("s0", max_num_seqs=max_num_seqs), SimServer("s1", max_num_seqs=8)])
    return simulate(
        config, n=N, batch=BATCH, steps=STEPS, response_length=LENGTH, seed=SEED, engine=engine,
        server_kv_tokens=server_kv_tokens,
    )  # fmt: skip


def finished_contexts(result) -> list[int]:
    """Prompt + response tokens of every sample finished by the end of the run: trained or in a held group."""
    trained = [sample for step in result.trained for group in step for sample in group.samples]
    held = [sample for group in result.pool.groups.values() for sample in group.samples if sample.finished]
    return [PROMPT_LEN + len(sample.token_ids) for sample in trained + held]


def test_the_default_reads_the_cache_size_from_the_engines():
    assert PartialConfig().kv_tokens_per_server == "auto"


def test_without_a_cache_size_the_calls_are_capped_by_max_calls_per_server_only():
    """``off``, whatever the servers report, and ``auto`` where no server reports one (our CPU engine without an
    emulated GPU): the cap is ``max_calls_per_server`` and a server gets every call the step has (16+ here)."""
    for result in (run("off", server_kv_tokens=60), run("auto", server_kv_tokens=None)):
        cap = CALLS_PER_SERVER_CEILING  # ``auto`` with no GPU knee (the servers here name none)
        assert all(m["partial/server_load/calls_cap"] == cap for m in result.metrics)
        assert all(m["partial/server_load/kv_tokens"] == 0 for m in result.metrics)
        assert max(m["partial/server_load/calls_max"] for m in result.metrics) > 8


def test_the_cap_is_the_cache_over_the_mean_context_of_the_finished_samples():
    """The pool's cap after the run, from the samples' own lengths (independent of the pool's counters): 60 tokens of
    cache, given or read from the servers, over the mean finished context (about 14 here); from step 2 on, no server
    had more calls out than the cap in force at the step's last launch. A given size wins over the servers'."""
    kv = 60
    for result in (run(kv), run("auto", server_kv_tokens=kv), run(kv, server_kv_tokens=10_000)):
        contexts = finished_contexts(result)
        cap = int(kv // (sum(contexts) / len(contexts)))
        assert 1 < cap < 8 and result.pool.launch_cap() == cap
        # Step 1 sends its first calls before any sample has finished; from step 2 the cap binds (without it a server
        # here gets 9-16 calls a step).
        for metrics in result.metrics[1:]:
            assert metrics["partial/server_load/calls_max"] <= metrics["partial/server_load/calls_cap"] < 8
            assert metrics["partial/server_load/kv_tokens"] == kv
        check_groups(result.trained, result.pool.config, N, BATCH, LENGTH, SEED)
        check_ledger(result, BATCH, 0)


def test_a_cache_for_one_sample_runs_one_call_per_server_and_still_trains_every_group():
    """The extreme: a cache smaller than any sample. Once a sample has finished, each server gets one call at a time;
    every step still trains its whole groups with exact tokens, nothing lost or thrown away."""
    result = run(1)
    for metrics in result.metrics[1:]:
        assert metrics["partial/server_load/calls_cap"] == metrics["partial/server_load/calls_max"] == 1
    check_groups(result.trained, result.pool.config, N, BATCH, LENGTH, SEED)
    check_ledger(result, BATCH, 0)
    assert sum(m["partial/tokens_discarded"] for m in result.metrics) == 0


def test_the_expected_context_survives_a_checkpoint():
    """The counters behind the cap are run totals: a resumed run caps as the uninterrupted one does."""
    result = run(60)
    state = result.pool.state_dict()
    assert state["totals"]["finished_samples"] == len(finished_contexts(result))
    assert state["totals"]["finished_context_tokens"] == sum(finished_contexts(result))
