"""verl's ``ToolAgentLoop`` on the CPU backend with the demo calculator: as verl runs it, and with ``+partial``.

The baseline: ``agent.default_agent_loop=tool_agent`` with the shipped tool config, a GRPO run of three steps. The
same selection plus ``+partial=default`` runs the tool loop segment by segment, trajectories parked across steps.
Turns come from verl's own ``num_turns/*`` metrics (a trajectory with one tool call has 4: assistant, tool,
assistant, plus the prompt), tool calls from the calculator's execution log.

Runs on our CPU engine by default; ``VERL_PARTIAL_E2E_BACKEND=cpu_vllm`` runs it on verl's own vLLM rollout (from the
vLLM test environment).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from harness import Run, run_trainer

from verl_partial.demo.assets import tool_overrides
from verl_partial.demo.tools import TOOL_LOG_ENV

pytestmark = pytest.mark.e2e

BACKEND = os.environ.get("VERL_PARTIAL_E2E_BACKEND", "cpu")
STEPS = 3


@pytest.fixture(scope="module")
def tool_run(demo_tool_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp("tool_agent")
    run = run_trainer(
        demo_tool_assets,
        output_dir,
        steps=STEPS,
        extra=tool_overrides(),
        env={TOOL_LOG_ENV: str(output_dir / "tool_calls.jsonl")},
        backend=BACKEND,
    )
    run.assert_ok()
    return run


def test_tool_agent_loop_trains_multi_turn(tool_run):
    for step in range(1, STEPS + 1):
        # Some trajectories call the calculator (4 turns), some answer directly (2 turns): both paths run.
        assert tool_run.metric(step, "num_turns/max") >= 4
        assert tool_run.metric(step, "num_turns/min") >= 2
        assert tool_run.metric(step, "num_turns/mean") > 2
        assert tool_run.metric(step, "timing_s/agent_loop/tool_calls/max") > 0
        tool_run.metric(step, "actor/pg_loss")
        tool_run.metric(step, "actor/grad_norm")
        assert 0 < tool_run.metric(step, "critic/score/mean") <= 1


def test_every_tool_call_ran_once(tool_run):
    calls = [json.loads(line) for line in (tool_run.output_dir / "tool_calls.jsonl").read_text().splitlines()]
    assert calls, "the pretrained demo model must call the calculator"
    keys = [(call["request_id"], call["assistant_turn"]) for call in calls]
    assert len(keys) == len(set(keys))
    assert any(call["output"].lstrip("-").isdigit() for call in calls)


# ---------------------------------------------------------------------------------------------- with +partial
PARTIAL_STEPS = 4


@pytest.fixture(scope="module")
def partial_tool_run(demo_tool_assets, tmp_path_factory) -> Run:
    output_dir = tmp_path_factory.mktemp("partial_tool_agent")
    run = run_trainer(
        demo_tool_assets,
        output_dir,
        steps=PARTIAL_STEPS,
        partial="default",
        extra=[
            *tool_overrides(),
            f"partial.dump_dir={output_dir / 'dump'}",
            # No staleness restart within the run: a restarted trajectory legitimately calls its tools again,
            # which would blur the "never re-run on resume" check below.
            f"partial.max_staleness={PARTIAL_STEPS}",
        ],
        env={TOOL_LOG_ENV: str(output_dir / "tool_calls.jsonl")},
        backend=BACKEND,
    )
    run.assert_ok()
    return run


def trained_trajectories(run: Run) -> list[tuple[int, dict]]:
    """(training step, dumped sample) of every trained sample."""
    dumps = [
        torch.load(run.output_dir / "dump" / f"step_{step}.pt", weights_only=False)
        for step in range(1, PARTIAL_STEPS + 1)
    ]
    return [(dump["step"], sample) for dump in dumps for sample in dump["samples"]]


def test_partial_tool_loop_trains_multi_turn_with_exact_masks(partial_tool_run):
    run = partial_tool_run
    for step in range(1, PARTIAL_STEPS + 1):
        assert run.metric(step, "num_turns/mean") > 2  # verl's own count, from the rows it trains
        assert run.metric(step, "partial/turns_per_sample/mean") == pytest.approx(run.metric(step, "num_turns/mean"))
        assert run.metric(step, "partial/restarted_samples") == 0
    assert sum(run.metric(step, "partial/tool_calls") for step in range(1, PARTIAL_STEPS + 1)) > 0
    assert max(run.metric(step, "partial/resumed_fraction") for step in range(1, PARTIAL_STEPS + 1)) > 0
    for step, sample in trained_trajectories(run):
        traj = sample["trajectory"]
        ids, mask = traj["response_ids"], traj["response_mask"]
        # What verl trains is exactly the parked-and-resumed token stream, tool output included.
        assert sample["trained_responses"] == ids.tolist()
        # Tool output: mask 0, no log-prob, no policy version; model tokens: a version within max_staleness.
        assert np.all(traj["log_probs"][mask == 0] == 0) and np.all(traj["versions"][mask == 0] == -1)
        assert np.all((traj["versions"][mask == 1] >= 0) & (traj["versions"][mask == 1] <= step - 1))
        # The pool's budget view holds the model's tokens, in order.
        assert sample["token_ids"] == ids[mask == 1].tolist()
        assert traj["phase"] == "done" and traj["pending_calls"] == []


def test_tool_calls_are_never_rerun_on_resume(partial_tool_run):
    run = partial_tool_run
    calls = [json.loads(line) for line in (run.output_dir / "tool_calls.jsonl").read_text().splitlines()]
    # Request ids are "<group>/<sample>/<call>": the trajectory is everything before the last part.
    executions: dict[tuple[str, int], int] = {}
    for call in calls:
        key = (call["request_id"].rsplit("/", 1)[0], call["assistant_turn"])
        executions[key] = executions.get(key, 0) + 1
    assert executions and max(executions.values()) == 1, "a tool call ran twice"
    for _, sample in trained_trajectories(run):
        trajectory_id = f"{sample['key']}/{sample['index']}"
        ran = sum(count for (tid, _), count in executions.items() if tid == trajectory_id)
        assert ran == sample["trajectory"]["tool_calls_made"]
