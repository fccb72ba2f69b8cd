"""The GPU simulator's aborts follow verl's vLLM server (issue 19): the step-end abort waits for queued requests,
a per-request abort brings the tokens back, a cancelled call gets nothing. Virtual time; milliseconds each."""

from __future__ import annotations

import asyncio

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import RolloutPool
from verl_partial.sim.backend import SimBackend
from verl_partial.sim.clock import run_virtual
from verl_partial.sim.engine import GATE_BARRIER_TIMEOUT_S, ServerSpec, SimServer
from verl_partial.sim.hardware import H100_SXM, QWEN25_7B
from verl_partial.sim.workload import Workload

ONE_SEQ = ServerSpec(H100_SXM, QWEN25_7B, max_num_seqs=1)


def test_abort_all_requests_waits_for_a_queued_request_until_it_is_taken_back():
    """With max_num_seqs=1 the second request queues; the abort barrier holds while the first keeps decoding, and
    taking the queued request back (no tokens) lets the pause through at once."""

    async def main():
        server = SimServer(ONE_SEQ, "s")
        running = server.submit("p", "p/0", 100, 100, 50_000, 50_000)
        queued = server.submit("p", "p/1", 100, 100, 50_000, 50_000)
        await asyncio.sleep(1.0)
        abort = asyncio.ensure_future(server.abort_all_requests())
        await asyncio.sleep(10.0)
        held = not abort.done()
        server.abort_request(queued)
        await abort
        return held, await running, await queued

    held, running, queued = run_virtual(main())
    # ~6.5 ms a token at one request: an abort that did not wait would have stopped it near 150 tokens (1 s).
    assert held and running.finish is Finish.ABORTED and running.tokens > 1_000
    assert queued.finish is Finish.ABORTED and queued.tokens == 0


def test_abort_barrier_gives_up_after_verls_60_s():
    async def main():
        loop = asyncio.get_running_loop()
        server = SimServer(ONE_SEQ, "s")
        running = server.submit("p", "p/0", 100, 100, 1_000_000, 1_000_000)
        server.submit("p", "p/1", 100, 100, 10, 10)
        await asyncio.sleep(0.1)
        started = loop.time()
        await server.abort_all_requests()
        return loop.time() - started, await running

    waited, running = run_virtual(main())
    assert GATE_BARRIER_TIMEOUT_S <= waited < GATE_BARRIER_TIMEOUT_S + 1.0
    assert running.finish is Finish.ABORTED


def test_backend_take_back_returns_tokens_and_cancel_returns_nothing():
    workload = Workload(batch=1, n=2, p50=20_000, p99_over_p50=1.5, response_length=30_000, prompt_len=100)

    async def main():
        backend = SimBackend(ServerSpec(H100_SXM, QWEN25_7B), 1, workload)
        pool: RolloutPool[int] = RolloutPool(PartialConfig(), group_size=2, batch_groups=1, response_length=30_000)
        pool.begin_step(1, 0)
        pool.admit(0, "p0")
        requests = [pool.start(ref, "sim0") for ref in pool.runnable()]
        taken, cancelled = backend.launch([(pool.groups[0], request) for request in requests])
        await asyncio.sleep(2.0)
        await backend.take_back([requests[0]])
        await backend.cancel([requests[1]])
        return await taken, await cancelled

    taken, cancelled = run_virtual(main())
    assert taken.finish is Finish.ABORTED and len(taken.new_ids) > 0
    assert cancelled.finish is Finish.ABORTED and len(cancelled.new_ids) == 0


def test_backend_resume_lands_only_once_its_servers_abort_returned():
    """The GPU simulator's backend chains each server's resume on that server's abort (issue 19, residual 2): while
    the abort waits at vLLM's barrier the server stays closed (``reopening``), and it reopens right after."""
    workload = Workload(batch=1, n=2, p50=20_000, p99_over_p50=1.5, response_length=30_000, prompt_len=100)

    async def main():
        backend = SimBackend(ONE_SEQ, 1, workload)
        pool: RolloutPool[int] = RolloutPool(PartialConfig(), group_size=2, batch_groups=1, response_length=30_000)
        pool.begin_step(1, 0)
        pool.admit(0, "p0")
        requests = [pool.start(ref, "sim0") for ref in pool.runnable()]
        futures = backend.launch([(pool.groups[0], request) for request in requests])
        await asyncio.sleep(1.0)
        abort = asyncio.ensure_future(backend.abort("sim0"))
        resume = asyncio.ensure_future(backend.resume("sim0"))
        await asyncio.sleep(5.0)  # the queued request holds the barrier
        closed = set(backend.reopening()) == {"sim0"} and not backend.engines["sim0"].gate_open
        await backend.take_back([requests[1]])
        await asyncio.gather(abort, resume, *futures)
        return closed, backend.reopening(), backend.engines["sim0"].gate_open

    closed, reopening, gate_open = run_virtual(main())
    assert closed and reopening == {} and gate_open
