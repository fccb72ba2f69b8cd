"""``+partial=tail`` through ``python -m verl.trainer.main_ppo`` on our CPU engine: length-aware windows in the trainer.

A 16-prompt training set (``data.train_max_samples``) at 8 groups per step is an epoch every 2 steps, so from the
second window on every prompt has a history. One straight run of 7 steps with windows of 2 steps (16 prompts) is
checked for: each window admitted in exactly the order the product's estimator gives from what the run trained before
the window was drawn (recomputed here from the trained samples' dump and the ledger); whole groups trained once; the
window delay within its bound; and, cut at a checkpoint that holds the undrawn rest of a window and resumed, nothing
lost or trained twice.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
from harness import Run, checkpointed_partial_overrides, cut_at_checkpoint, ledger, ledger_accounting, run_trainer

from verl_partial.config.partial import STATE_FILE
from verl_partial.core.partial.length_batching import longest_expected_first

pytestmark = pytest.mark.e2e

STEPS, GROUPS, PROMPTS, WINDOW_STEPS = 7, 8, 16, 2
WINDOW = WINDOW_STEPS * GROUPS


def overrides(output_dir: Path) -> list[str]:
    return [
        *checkpointed_partial_overrides(output_dir),
        f"partial.length_window_steps={WINDOW_STEPS}",
        f"data.train_max_samples={PROMPTS}",
        "trainer.total_epochs=100",
    ]


@pytest.fixture(scope="module")
def straight(demo_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp("tail_straight")
    run = run_trainer(demo_assets, output_dir, steps=STEPS, partial="tail", extra=overrides(output_dir))
    run.assert_ok()
    return run


def _drawn_index(key: str) -> int:
    """PromptStream's keys are ``e<epoch>-<drawn>``: the batcher draws windows of consecutive drawn indices."""
    return int(key.rsplit("-", 1)[1])


def test_each_window_is_admitted_longest_expected_first(straight: Run) -> None:
    events = ledger(straight.output_dir / "ledger.jsonl")
    samples = {}
    for step in range(1, STEPS + 1):
        for sample in torch.load(straight.output_dir / "dump" / f"step_{step}.pt")["samples"]:
            samples.setdefault(sample["key"], []).append(sample)
    prompt_of = {key: group[0]["prompt_id"] for key, group in samples.items()}
    admitted: dict[int, list[tuple[int, str]]] = defaultdict(list)  # window -> (step, key) in admission order
    for event in events:
        if event["event"] == "admitted":
            admitted[_drawn_index(event["key"]) // WINDOW].append((event["step"], event["key"]))

    checked = reordered = 0
    for window, admissions in sorted(admitted.items()):
        drawn_at = admissions[0][0]  # a window is drawn at its first admission
        if len(admissions) < WINDOW or any(key not in prompt_of for _, key in admissions):
            continue  # the run's last window: part of it was never admitted or never trained
        # The estimator's history when the window was drawn: every step trained before, in the trainer's order,
        # running mean with smoothing 0.5 (LengthEstimator's default).
        history: dict[object, float] = {}
        for event in events:
            if event["event"] == "trained" and event["step"] < drawn_at:
                group = samples[event["key"]]
                mean = sum(len(sample["token_ids"]) for sample in group) / len(group)
                prompt = prompt_of[event["key"]]
                history[prompt] = mean if prompt not in history else 0.5 * history[prompt] + 0.5 * mean
        drawn = sorted((key for _, key in admissions), key=_drawn_index)
        expected = [drawn[i] for i in longest_expected_first([history.get(prompt_of[key]) for key in drawn])]
        assert [key for _, key in admissions] == expected, f"window {window} (drawn at step {drawn_at})"
        checked += bool(history)
        reordered += expected != drawn
    assert checked >= 2, "at least two windows with a history were checked"
    assert reordered, "some window's order differs from the dataloader's (else this test shows nothing)"


def test_whole_groups_trained_once_within_the_delay_bound(straight: Run) -> None:
    trained, _, _ = ledger_accounting(ledger(straight.output_dir / "ledger.jsonl"))
    assert len(trained) == len(set(trained)) == STEPS * GROUPS
    for step in range(1, STEPS + 1):
        assert straight.metric(step, "partial/staleness/max") <= 1
        assert straight.metric(step, "partial/tokens_discarded") == 0
        assert straight.metric(step, "partial/window_delay_steps/max") <= WINDOW_STEPS


def test_resume_mid_window_loses_and_duplicates_nothing(straight: Run, demo_assets, tmp_path) -> None:
    def window_left(step: int) -> int:
        state = torch.load(straight.output_dir / "checkpoints" / f"global_step_{step}" / STATE_FILE, weights_only=False)
        return len(state["window"]["pending"])

    cut = next((step for step in range(2, STEPS) if window_left(step)), None)
    assert cut is not None, "some checkpoint must hold drawn prompts not yet admitted"
    resumed_dir = cut_at_checkpoint(straight, cut, tmp_path / "resumed")
    resumed = run_trainer(demo_assets, resumed_dir, steps=STEPS, partial="tail", extra=overrides(resumed_dir))
    resumed.assert_ok()
    trained, admitted, gone = ledger_accounting(ledger(resumed_dir / "ledger.jsonl"))
    final = torch.load(resumed_dir / "checkpoints" / f"global_step_{STEPS}" / STATE_FILE, weights_only=False)
    in_flight = {group["key"] for group in final["pool"]["groups"]}
    pending = {key for _, key, _ in final["window"]["pending"]}
    assert len(trained) == len(set(trained)) == STEPS * GROUPS, "each group trained once, every step full"
    assert admitted == set(trained) | in_flight | gone
    drawn = admitted | pending
    assert sorted(_drawn_index(key) for key in drawn) == list(range(len(drawn))), "no drawn prompt skipped"
