"""``+partial=default`` end to end on the SGLang mode (``+backend=cpu_sglang``): ``rollout.name=sglang`` served by the
CPU SGLang double (SGLang 0.5.12 semantics behind verl's SGLangHttpServer, with verl-partial's server fix).

What SGLang does that the scheduler must survive, and these runs meet at every step end: one more token after an
abort (possibly EOS or the last allowed token, reported "abort"), an EOS at the last allowed token reported
"length", late arrivals parking at the pause gate unless the fix's rejecting gate is closed, cancel that does not
stop decoding unless the fix aborts, prefix-matched per-request aborts, and ``sleep`` asserting an idle scheduler (an
orphan still decoding at the weight sync crashes the run). Checked: whole groups, exact tokens, nothing after EOS in
a trained answer (single-turn and per assistant turn), staleness <= 1, kill/resume, and the run itself finishing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import (
    Run,
    checkpointed_partial_overrides,
    cut_at_checkpoint,
    ledger,
    ledger_accounting,
    model_turns,
    run_trainer,
)
from transformers import AutoTokenizer, GenerationConfig

from verl_partial.demo.assets import tool_overrides
from verl_partial.demo.tools import TOOL_DELAY_ENV, TOOL_LOG_ENV

pytestmark = pytest.mark.e2e

BACKEND = "cpu_sglang"
STEPS, GROUPS, N = 4, 8, 4
# As test_partial_e2e: groups admitted at the step start plus 4 extra, so every step end parks samples with tokens.
PINNED_ADMISSION = ("partial.refill=false", "partial.extra_groups=4", "partial.fill_engine=false")


def stop_ids(model_dir: Path) -> set[int]:
    """The ids the server stops at: the generation config's EOS ids and the tokenizer's (the double's set)."""
    ids: set[int] = set()
    for source in (GenerationConfig.from_pretrained(model_dir).eos_token_id, AutoTokenizer.from_pretrained(model_dir)):
        value = source.eos_token_id if hasattr(source, "eos_token_id") else source
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    assert ids
    return ids


def assert_nothing_after_stop(tokens: list[int], stops: set[int], where: str) -> None:
    positions = [i for i, token in enumerate(tokens) if token in stops]
    assert positions in ([], [len(tokens) - 1]), f"{where}: a stop id at {positions} of {len(tokens)} tokens"


def dumps(run: Run, steps) -> dict[int, dict]:
    return {step: torch.load(run.output_dir / "dump" / f"step_{step}.pt", weights_only=False) for step in steps}


@pytest.fixture(scope="module")
def straight_run(demo_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp("sglang_straight")
    run = run_trainer(
        demo_assets,
        output_dir,
        steps=STEPS,
        partial="default",
        extra=[*checkpointed_partial_overrides(output_dir), *PINNED_ADMISSION],
        backend=BACKEND,
    )
    run.assert_ok()  # includes: no orphan decoding at any sleep (the double's idle assert would crash the run)
    return run


def test_single_turn_whole_groups_exact_tokens_nothing_after_eos(straight_run, demo_assets):
    stops = stop_ids(demo_assets.model_dir)
    response_length = demo_assets.max_response_length
    resumed = 0
    for dump in dumps(straight_run, range(1, STEPS + 1)).values():
        by_group: dict[str, list[int]] = {}
        for sample in dump["samples"]:
            by_group.setdefault(sample["key"], []).append(sample["index"])
            tokens = sample["token_ids"]
            assert 0 < len(tokens) <= response_length
            assert sample["trained_responses"][: len(tokens)] == tokens  # trained == generated
            assert_nothing_after_stop(tokens, stops, f"step {dump['version']} {sample['key']}/{sample['index']}")
            assert all(0 <= dump["version"] - v <= 1 for v in sample["versions"])
            resumed += len(set(sample["versions"])) > 1
        assert len(by_group) == GROUPS
        assert all(sorted(indices) == list(range(N)) for indices in by_group.values())
    assert resumed, "step ends must park samples that resume under the next version"
    for step in range(1, STEPS + 1):
        assert straight_run.metric(step, "partial/staleness/max") <= 1


def test_single_turn_kill_and_resume_loses_and_duplicates_nothing(straight_run, demo_assets, tmp_path):
    resumed_dir = cut_at_checkpoint(straight_run, 2, tmp_path / "resumed")
    resumed = run_trainer(
        demo_assets,
        resumed_dir,
        steps=STEPS,
        partial="default",
        extra=[*checkpointed_partial_overrides(resumed_dir), *PINNED_ADMISSION],
        backend=BACKEND,
    )
    resumed.assert_ok()
    assert sorted(resumed.steps) == [3, 4]
    trained, admitted, _ = ledger_accounting(ledger(resumed_dir / "ledger.jsonl"))
    assert len(trained) == len(set(trained)) == STEPS * GROUPS
    _, straight_admitted, _ = ledger_accounting(ledger(straight_run.output_dir / "ledger.jsonl"))
    assert admitted == straight_admitted


@pytest.fixture(scope="module")
def tool_run(demo_tool_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp("sglang_tool")
    run = run_trainer(
        demo_tool_assets,
        output_dir,
        steps=STEPS,
        partial="default",
        extra=[*tool_overrides(), *checkpointed_partial_overrides(output_dir), f"partial.max_staleness={STEPS}"],
        env={TOOL_LOG_ENV: str(output_dir / "tool_calls.jsonl"), TOOL_DELAY_ENV: "2"},
        backend=BACKEND,
    )
    run.assert_ok()
    return run


def test_tool_loop_exact_streams_and_no_turn_runs_past_its_stop(tool_run, demo_tool_assets):
    stops = stop_ids(demo_tool_assets.model_dir)
    for dump in dumps(tool_run, range(1, STEPS + 1)).values():
        keys = [sample["key"] for sample in dump["samples"]]
        assert len(set(keys)) == GROUPS and all(keys.count(key) == N for key in set(keys))
        for sample in dump["samples"]:
            traj = sample["trajectory"]
            ids, mask = traj["response_ids"], traj["response_mask"]
            assert sample["trained_responses"] == ids.tolist()
            assert sample["token_ids"] == ids[mask == 1].tolist()
            assert traj["phase"] == "done" and traj["pending_calls"] == []
            for turn, positions in enumerate(model_turns(mask)):
                assert_nothing_after_stop(ids[positions].tolist(), stops, f"{sample['key']}/{sample['index']} #{turn}")
    assert max(tool_run.metric(step, "partial/resumed_fraction") for step in range(1, STEPS + 1)) > 0
    assert sum(tool_run.metric(step, "partial/tool_calls") for step in range(1, STEPS + 1)) > 0
