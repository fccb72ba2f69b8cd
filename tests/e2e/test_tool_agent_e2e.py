"""verl's own ``ToolAgentLoop`` on the CPU backend with the demo calculator, without partial rollout.

The baseline of the multi-turn work: ``agent.default_agent_loop=tool_agent`` with the shipped tool config, a GRPO
run of three steps. Turns come from verl's own ``num_turns/*`` metrics (a trajectory with one tool call has 4:
assistant, tool, assistant, plus the prompt), tool calls from the calculator's execution log.

Runs on our CPU engine by default; ``VERL_PARTIAL_E2E_BACKEND=cpu_vllm`` runs it on verl's own vLLM rollout (from the
vLLM test environment).
"""

from __future__ import annotations

import json
import os

import pytest
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
