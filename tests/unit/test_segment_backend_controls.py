"""The glue's step-end controls (issue 19, residual 2): each server's resume is chained on that server's own abort,
through the abort's Ray refs, so it goes out only once the abort returned -- even when that is after the step's
event loop (``asyncio.run`` per step) has ended. Ray refs are stood in for by their ``future()``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from verl_partial.config.partial import PartialConfig
from verl_partial.core.engines.adapter import engine_adapter
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import RolloutPool, SegmentRequest, SegmentResult
from verl_partial.glue.partial.segment_backend import WorkerSegmentBackend


class Ref:
    """A Ray ObjectRef as the backend uses it: ``future()`` completes when the remote call returns."""

    def __init__(self) -> None:
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future[None]:
        return self.done


class ControlServer:
    """A server actor handle recording the control calls sent to it, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Ref]] = []

    def __getattr__(self, method: str):
        sent = self.__dict__["sent"]

        class Method:
            @staticmethod
            def remote(**_: object) -> Ref:
                sent.append((method, Ref()))
                return sent[-1][1]

        return Method


class Replica:
    def __init__(self, server: ControlServer) -> None:
        self.servers = [server]


def backend(*servers: ControlServer) -> WorkerSegmentBackend:
    addresses = {f"s{i}": server for i, server in enumerate(servers)}
    return WorkerSegmentBackend([], addresses, [Replica(server) for server in servers], engine_adapter("vllm"))


def complete_from_ray_thread(ref: Ref) -> None:
    thread = threading.Thread(target=ref.done.set_result, args=(None,))
    thread.start()
    thread.join()


def test_a_resume_waits_for_its_servers_abort_even_after_the_steps_loop_ended():
    slow, quick = ControlServer(), ControlServer()
    glue = backend(slow, quick)

    async def step_end() -> None:
        aborts = [asyncio.ensure_future(glue.abort(server)) for server in ("s0", "s1")]
        await asyncio.sleep(0)
        quick.sent[0][1].done.set_result(None)  # s1's abort returns; s0's stays inside vLLM's barrier
        await asyncio.wait_for(aborts[1], 1.0)
        resumes = [asyncio.ensure_future(glue.resume(server)) for server in ("s0", "s1")]
        await asyncio.sleep(0.01)
        quick.sent[1][1].done.set_result(None)
        await asyncio.wait_for(resumes[1], 1.0)  # s1 resumed at once
        assert [method for method, _ in slow.sent] == ["abort_all_requests"]  # s0: nothing before its abort returned
        assert set(glue.reopening()) == {"s0"}

    asyncio.run(step_end())  # the step's loop ends with s0's abort still out
    complete_from_ray_thread(slow.sent[0][1])  # s0's abort returns later, in Ray's thread
    assert [method for method, _ in slow.sent] == ["abort_all_requests", "resume_generation"]

    async def next_step_start() -> None:
        reopening = glue.reopening()
        assert set(reopening) == {"s0"}  # its resume went out but has not returned: s0 sits out
        complete_from_ray_thread(slow.sent[1][1])
        await asyncio.wait_for(reopening["s0"], 1.0)
        assert glue.reopening() == {}

    asyncio.run(next_step_start())


def test_a_failed_resume_is_refused_at_the_next_step_start_not_routed_to():
    """verl's resume_generation opens the gate only after the engine resumed: a server whose resume raised may still
    refuse every call, each an empty "aborted" answer counted as a failure, until groups are taken out. The glue counted
    a failed resume as landed; the next step's start (and validation's wait) now raise, naming the server."""
    broken, healthy = ControlServer(), ControlServer()
    glue = backend(broken, healthy)

    async def step_end() -> None:
        resumes = [asyncio.ensure_future(glue.resume(server)) for server in ("s0", "s1")]
        await asyncio.sleep(0)
        broken.sent[0][1].done.set_exception(RuntimeError("engine did not resume"))
        healthy.sent[0][1].done.set_result(None)
        await asyncio.wait_for(asyncio.gather(*resumes), 1.0)

    asyncio.run(step_end())

    async def next_step_start() -> None:
        glue.reopening()

    with pytest.raises(RuntimeError, match=r"resume_generation failed on \['s0'\].*engine did not resume"):
        asyncio.run(next_step_start())
    with pytest.raises(RuntimeError, match=r"resume_generation failed on \['s0'\]"):
        glue.wait_reopened(1.0)


async def flushed_just_now(glue: WorkerSegmentBackend) -> None:
    """A flush just went out: the next launch waits for the launch window (at most one flush per window)."""
    glue.window.request()
    await asyncio.sleep(0)


def launch_one(glue: WorkerSegmentBackend) -> tuple[RolloutPool, SegmentRequest]:
    pool = RolloutPool(PartialConfig(), group_size=1, batch_groups=1, response_length=4)
    pool.admit({"raw_prompt": "p"}, "g0")
    pool.begin_step(1, 0)
    glue.begin_step(pool)
    return pool, pool.start(pool.runnable()[0], "s0")


def test_a_step_ending_inside_the_launch_window_leaves_nothing_pending_for_the_next():
    """A step can end within the 50 ms launch window (a DAPO step whose last scored group passes just after a refill
    launched): the step end's take-back drops the unsent call, the step's loop closes before the flush, and the next
    step must start. It raised "never sent nor cancelled" from the worker's emptied list (a DAPO e2e run)."""
    glue = WorkerSegmentBackend([object()], {"s0": ControlServer()}, [Replica(ControlServer())], engine_adapter("vllm"))
    pool, request = launch_one(glue)

    async def step() -> SegmentResult:
        await flushed_just_now(glue)
        [future] = glue.launch([(pool.groups[request.ref.group_id], request)])
        await glue.take_back([request])  # before the flush: never sent
        return future.result()

    dropped = asyncio.run(step())
    assert dropped.finish is Finish.ABORTED and len(dropped.new_ids) == 0
    glue.begin_step(pool)  # the next step starts


def test_a_call_neither_sent_nor_taken_back_is_refused_at_the_next_step():
    glue = WorkerSegmentBackend([object()], {"s0": ControlServer()}, [Replica(ControlServer())], engine_adapter("vllm"))
    pool, request = launch_one(glue)

    async def step() -> None:
        await flushed_just_now(glue)
        glue.launch([(pool.groups[request.ref.group_id], request)])

    asyncio.run(step())  # the loop ends before the flush, and nothing took the call back
    with pytest.raises(RuntimeError, match="never sent nor cancelled"):
        glue.begin_step(pool)


class StreamingWorker:
    """An AgentLoopWorker handle recording each wave of calls it was sent (``run_segments``); the stream it returns
    ends at once, so the calls stay open, as calls still generating do."""

    def __init__(self) -> None:
        self.waves: list[list] = []
        waves = self.waves

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                raise StopAsyncIteration

        class RunSegments:
            @staticmethod
            def options(**_: object):
                return RunSegments

            @staticmethod
            def remote(calls, _forget) -> Stream:
                waves.append(list(calls))
                return Stream()

        self.run_segments = RunSegments


def test_a_new_groups_prompt_dropped_inside_the_launch_window_goes_with_its_next_call():
    """A new group's first call carries its raw prompt (its ids are tokenised on the worker); a step that ends inside
    the launch window drops that call unsent. The glue counted the prompt as sent at launch, so the group's next call
    went without it: the worker failed each ("neither prompt ids nor its prompt reached this worker") until the
    group was taken out, a prompt lost from training."""
    worker = StreamingWorker()
    glue = WorkerSegmentBackend([worker], {"s0": ControlServer()}, [Replica(ControlServer())], engine_adapter("vllm"))
    pool, request = launch_one(glue)

    async def first_step() -> None:
        await flushed_just_now(glue)
        [future] = glue.launch([(pool.groups[request.ref.group_id], request)])
        await glue.take_back([request])  # the step ends before the flush: never sent
        pool.finish_segment(request.ref, future.result())

    asyncio.run(first_step())
    assert worker.waves == []
    pool.begin_step(2, 0)
    glue.begin_step(pool)
    again = pool.start(pool.runnable()[0], "s0")

    async def next_step() -> None:
        glue.launch([(pool.groups[again.ref.group_id], again)])
        await asyncio.sleep(0)  # a new step's first wave leaves at once

    asyncio.run(next_step())
    [[call]] = worker.waves
    assert call.prompt_ids is None and call.raw_prompt == "p"


def test_a_steps_first_wave_reaches_the_worker_at_once_and_a_refill_right_after_waits_for_the_window():
    """Every step's first wave (the carried-over samples the step waits for) went out 50 ms after its launch, every
    engine idle meanwhile: measured through verl's trainer, a step's first engine step came 57-62 ms into it."""
    worker = StreamingWorker()
    glue = WorkerSegmentBackend([worker], {"s0": ControlServer()}, [Replica(ControlServer())], engine_adapter("vllm"))
    pool = RolloutPool(PartialConfig(), group_size=1, batch_groups=1, response_length=4)
    pool.engine_slots = 8
    for key in ("g0", "g1"):
        pool.admit({"raw_prompt": key}, key)
    pool.begin_step(1, 0)
    glue.begin_step(pool)
    first, refill = (pool.start(ref, "s0") for ref in pool.runnable())

    async def step() -> list[int]:
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), []
        glue.launch([(pool.groups[first.ref.group_id], first)])
        await asyncio.sleep(0)
        sent.append(len(worker.waves))
        glue.launch([(pool.groups[refill.ref.group_id], refill)])
        await asyncio.sleep(0.01)
        sent.append(len(worker.waves))  # held: one flush per window
        await asyncio.sleep(0.1)
        sent.append(len(worker.waves))
        assert loop.time() - started < 1.0
        return sent

    assert asyncio.run(step()) == [1, 1, 2]
    assert [[call.request_id for call in wave] for wave in worker.waves] == [[first.request_id], [refill.request_id]]
