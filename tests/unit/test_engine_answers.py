"""What the worker keeps of a server's answer (issue 26, finding 6): a speculative run is cut at its first EOS --
tokens AND log-probs -- before it is parked or trained, on every engine's mapping.

The worker under test is verl-partial's real ``PartialAgentLoopWorker._generate``; only its server is a stand-in,
answering with the TokenOutput shapes verl 0.9.1's servers build.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from verl.workers.rollout.replica import TokenOutput

from verl_partial.core.finish import Finish, eos_id_set
from verl_partial.glue.engines import engine_adapter
from verl_partial.glue.partial_agent_loop import PartialAgentLoopWorker, SegmentCall

EOS = 151645


class _Generate:
    def __init__(self, output: TokenOutput) -> None:
        self.output = output

    def remote(self, **_: object):
        async def answer() -> TokenOutput:
            return self.output

        return answer()


class SpeculativeServer:
    """Answers every call with one fixed run, as a speculative engine returns it after an abort."""

    def __init__(self, output: TokenOutput) -> None:
        self.generate = _Generate(output)


def worker_for(engine: str, server: SpeculativeServer) -> PartialAgentLoopWorker:
    """The real worker class with only the state ``_generate`` reads (verl's AgentLoopWorker needs a cluster)."""
    worker = PartialAgentLoopWorker.__new__(PartialAgentLoopWorker)
    worker.engine = engine_adapter(engine)
    worker.eos_from_model = eos_id_set(EOS)
    worker.servers = {"s0": server}
    worker.sent = {}
    worker.transit_delay_s = 0.0
    return worker


@pytest.mark.parametrize(("engine", "reason"), [("sglang", "abort"), ("sglang", "length"), ("vllm", "aborted")])
def test_a_run_with_an_eos_inside_is_parked_cut_at_the_eos_and_finished(engine, reason):
    """Before the fix the worker kept [5, EOS, 6, 7] with 4 log-probs and reported ABORTED/LENGTH: the sample was
    resumed after its EOS and trained on tokens past the answer's end."""
    output = TokenOutput(token_ids=[5, EOS, 6, 7], log_probs=[-0.1, -0.2, -0.3, -0.4], stop_reason=reason)
    worker = worker_for(engine, SpeculativeServer(output))
    call = SegmentCall("g/0/0#", "s0", "g", np.zeros(0, np.int32), 4, prompt_ids=np.array([1, 2], np.int32))
    answer = asyncio.run(worker._generate(call, {"temperature": 1.0}))
    assert answer.finish is Finish.EOS
    assert answer.new_ids.tolist() == [5, EOS]
    assert answer.new_log_probs.tolist() == pytest.approx([-0.1, -0.2])
