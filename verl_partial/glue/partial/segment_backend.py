"""The scheduler's engine side over verl's AgentLoopWorkers: one Ray call per worker per launch wave, answers
streamed back per call, take-backs and cancels batched per worker (the driver's Ray traffic stays O(workers)).

:class:`WorkerSegmentBackend` implements :class:`verl_partial.core.partial.scheduler.SegmentBackend`; the worker side is
:class:`verl_partial.glue.partial.agent_loop.PartialAgentLoopWorker`, the per-engine control calls
:mod:`verl_partial.core.engines.adapter`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from verl_partial.core.engines.adapter import EngineAdapter
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.launch_window import LaunchWindow
from verl_partial.core.partial.pool import GroupState, RolloutPool, SegmentRequest, SegmentResult
from verl_partial.glue.partial.agent_loop import SegmentAnswer, SegmentCall
from verl_partial.glue.partial.tool_loop import ROW_KEYS

Row = dict[str, Any]

WORKER_MAX_CONCURRENCY = 100_000


class WorkerSegmentBackend:
    """The scheduler's backend (launch / take_back / cancel / abort / resume) over verl's AgentLoopWorkers.

    A group's calls always go to the same worker (``group_id % workers``), so its prompt is tokenised once and a
    wave of new groups costs one Ray call per worker it touches. Results stream back per call
    (:meth:`PartialAgentLoopWorker.run_segments`). Lives as long as the loader: it remembers which groups' prompts
    each worker has cached. ``servers`` and ``replicas`` are in the same order (verl's ``LLMServerManager``: one
    address per replica).

    A server's resume is chained on its abort's Ray refs, not on this step's event loop (one per step,
    ``run_on_own_loop``): vLLM's abort pauses its engine only after its admission barrier, so a resume sent before
    the abort returned would be undone, and an abort may return after the step's loop is gone.
    """

    def __init__(
        self,
        workers: list[Any],
        servers: dict[str, Any],
        replicas: list[Any],
        engine: EngineAdapter,
        tool_loop: bool = False,
    ) -> None:
        self.workers = workers
        # Samples run verl's tool agent loop (their calls carry the row's fields and the parked trajectory).
        self.tool_loop = tool_loop
        self.engine = engine
        self._servers = list(servers)
        if len(replicas) != len(self._servers):
            raise ValueError(f"{len(self._servers)} server addresses for {len(replicas)} replicas: expected one each")
        self.replicas = dict(zip(self._servers, replicas, strict=True))
        # Per server: its last abort, done when every control server returned; its last resume, likewise.
        self.aborts: dict[str, concurrent.futures.Future[list[BaseException]]] = {}
        self.resumes: dict[str, concurrent.futures.Future[list[BaseException]]] = {}
        self.pool: RolloutPool[Row] | None = None
        self.futures: dict[str, asyncio.Future[SegmentResult]] = {}
        self.calls: dict[str, tuple[int, str]] = {}  # request id -> (worker, server) of calls sent
        self.pending: dict[int, list[tuple[SegmentCall, asyncio.Future[SegmentResult]]]] = {}
        # At most one flush (one Ray call per worker) per launch window, the first at once.
        self.window = LaunchWindow(self._flush)
        self.streams: set[asyncio.Task[None]] = set()
        # Groups whose raw prompt was sent to a worker and whose ids the pool does not hold yet, per worker.
        self.prompt_sent: dict[int, set[str]] = {index: set() for index in range(len(workers))}

    @property
    def servers(self) -> list[str]:
        return self._servers

    def begin_step(self, pool: RolloutPool[Row]) -> None:
        """Each step runs on its own event loop (``run_on_own_loop``): nothing of the last one's loop may linger."""
        if self.pending:
            raise RuntimeError("calls of the previous step were never sent nor cancelled")
        self.window.reset()
        # Calls the scheduler abandoned last step (their server never answered the cancel) are forgotten.
        self.futures.clear()
        self.calls.clear()
        self.pool = pool

    def launch(self, wave: list[tuple[GroupState[Row], SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        loop = asyncio.get_running_loop()
        futures = []
        for group, request in wave:
            worker = worker_of(group.group_id, len(self.workers))
            sample = group.samples[request.ref.index]
            call = SegmentCall(
                request_id=request.request_id,
                server=request.server,
                group_key=group.key,
                prefix=sample.token_ids[: request.prefix_len],
                max_new_tokens=request.max_new_tokens,
                prompt_ids=group.prompt_ids,
                # Kept on the first call that goes out (_flush): a call dropped inside the window never delivers it.
                raw_prompt=group.prompt["raw_prompt"] if group.prompt_ids is None else None,
                row={key: group.prompt[key] for key in ROW_KEYS if key in group.prompt} if self.tool_loop else None,
                payload=sample.payload,
            )
            future: asyncio.Future[SegmentResult] = loop.create_future()
            self.futures[request.request_id] = future
            self.pending.setdefault(worker, []).append((call, future))
            futures.append(future)
        self.window.request()
        return futures

    def _flush(self) -> None:
        pending, self.pending = self.pending, {}
        groups = self.pool.groups.values() if self.pool is not None else ()
        unknown = {group.key for group in groups if group.prompt_ids is None}
        for worker, items in pending.items():
            known = self.prompt_sent[worker] - unknown
            self.prompt_sent[worker] -= known
            calls = self._prompt_once(worker, [call for call, _ in items])
            stream = self.workers[worker].run_segments.options(num_returns="streaming").remote(calls, sorted(known))
            for call in calls:
                self.calls[call.request_id] = (worker, call.server)
            task = asyncio.ensure_future(self._receive(stream, calls))
            self.streams.add(task)
            task.add_done_callback(self.streams.discard)

    def _prompt_once(self, worker: int, calls: list[SegmentCall]) -> list[SegmentCall]:
        """The calls as they go out: a group's raw prompt rides only on its first call a worker receives (the
        worker tokenises it once and keeps the ids until the driver holds them), decided when the calls are sent,
        so a call dropped in its launch window never counts as having delivered it."""
        sent = self.prompt_sent[worker]
        out = []
        for call in calls:
            if call.raw_prompt is not None:
                if call.group_key in sent:
                    call = dataclasses.replace(call, raw_prompt=None)
                else:
                    sent.add(call.group_key)
            out.append(call)
        return out

    async def _receive(self, stream: Any, calls: list[SegmentCall]) -> None:
        try:
            async for ref in stream:
                answer: SegmentAnswer = await ref
                self._resolve(answer)
        except Exception as error:  # the worker died: every call of this wave still open fails
            for call in calls:
                future = self.futures.pop(call.request_id, None)
                self.calls.pop(call.request_id, None)
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(f"AgentLoopWorker stream failed: {error!r}"))

    def _resolve(self, answer: SegmentAnswer) -> None:
        future = self.futures.pop(answer.request_id, None)
        _, server = self.calls.pop(answer.request_id, (None, ""))
        if future is None or future.done():
            return
        if answer.error is not None:
            future.set_exception(RuntimeError(f"generate call {answer.request_id} on {server}: {answer.error}"))
            return
        future.set_result(
            SegmentResult(
                new_ids=answer.new_ids,
                new_log_probs=answer.new_log_probs,
                finish=answer.finish,
                server=server,
                server_version=answer.server_version,
                prompt_ids=answer.prompt_ids,
                payload=answer.payload,
            )
        )

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        await asyncio.gather(
            *[self.workers[w].take_back_segments.remote(ids) for w, ids in self._sent_by_worker(requests).items()]
        )

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        await asyncio.gather(
            *[self.workers[w].cancel_segments.remote(ids) for w, ids in self._sent_by_worker(requests).items()]
        )

    def _sent_by_worker(self, requests: list[SegmentRequest]) -> dict[int, list[str]]:
        """The calls among ``requests`` that went out, by worker (one Ray call per worker); calls still waiting for
        their launch window are dropped here instead."""
        by_worker: dict[int, list[str]] = {}
        for request in requests:
            if self._drop_pending(request.request_id):
                continue
            sent = self.calls.get(request.request_id)
            if sent is not None:
                by_worker.setdefault(sent[0], []).append(request.request_id)
        return by_worker

    def _drop_pending(self, request_id: str) -> bool:
        """A call still waiting for its launch window is never sent: it ends ABORTED with no tokens. A worker left
        with no call is removed, so a step that ends before the window's flush leaves nothing pending behind it."""
        for worker, items in self.pending.items():
            for position, (call, future) in enumerate(items):
                if call.request_id == request_id:
                    del items[position]
                    if not items:
                        del self.pending[worker]
                    self.futures.pop(request_id, None)
                    future.set_result(
                        SegmentResult(
                            new_ids=call.prefix[:0],
                            new_log_probs=np.zeros(0, dtype=np.float32),
                            finish=Finish.ABORTED,
                            server=call.server,
                        )
                    )
                    return True
        return False

    async def abort(self, server: str) -> None:
        aborted = self.aborts[server] = _when_all(self.engine.abort_calls(self.replicas[server]))
        await _on_loop(aborted)

    async def resume(self, server: str) -> None:
        resumed = self.resumes[server] = concurrent.futures.Future()
        replica = self.replicas[server]

        def send(_: object = None) -> None:  # now, or in Ray's callback thread once the abort returned
            _when_all(self.engine.resume_calls(replica), resumed.set_result)

        aborted = self.aborts.pop(server, None)
        if aborted is None:
            send()
        else:
            aborted.add_done_callback(send)
        await _on_loop(resumed)

    def wait_reopened(self, timeout_s: float) -> None:
        """Block until every server's chained resume has landed (driver thread, outside any step's loop).

        A step end's abort can outlive the step; the server's gate then rejects every call until the resume chained
        on it lands. verl's validation, sent right after such a step, would be answered with empty "aborted"
        outputs and score them, silently. Raises, naming the servers, if they are still closed after ``timeout_s``.
        """
        self.check_resumes()
        pending = {server: resumed for server, resumed in self.resumes.items() if not resumed.done()}
        if not pending:
            return
        _, closed = concurrent.futures.wait(pending.values(), timeout=timeout_s)
        self.check_resumes()
        if closed:
            names = sorted(server for server, resumed in pending.items() if resumed in closed)
            raise RuntimeError(
                f"servers {names} are still closed {timeout_s:.0f} s after the step end (their abort has not "
                "returned, so their resume was never sent); validation would be answered with empty outputs"
            )

    async def progress(self, server: str) -> dict[str, int] | None:
        """Tokens so far of each request the server's replica holds (a stall check, ``SegmentBackend.progress``)."""
        readings = await asyncio.gather(*self.engine.progress_calls(self.replicas[server]))
        if any(reading is None for reading in readings):
            return None
        return {request_id: tokens for reading in readings for request_id, tokens in reading.items()}

    def reopening(self) -> dict[str, asyncio.Future[None]]:
        self.check_resumes()
        return {server: _on_loop(resumed) for server, resumed in self.resumes.items() if not resumed.done()}

    def check_resumes(self) -> None:
        """Raise, naming the servers, if a resume failed: verl's ``resume_generation`` reopens the gate only after the
        engine resumed, so a server whose resume raised may still reject every call (as empty "aborted" answers,
        failures that would take groups out) or sit paused. Never routed to as if it were open."""
        failed = {server: resumed.result() for server, resumed in self.resumes.items() if resumed.done()}
        failed = {server: errors for server, errors in failed.items() if errors}
        if failed:
            detail = "; ".join(f"{server}: {errors[0]!r}" for server, errors in sorted(failed.items()))
            raise RuntimeError(
                f"resume_generation failed on {sorted(failed)}, whose gates may still be closed: {detail}"
            )


def worker_of(group_id: int, workers: int) -> int:
    """The AgentLoopWorker that runs a group's segments, and scores it: its cached prompt tokens live there."""
    return group_id % workers


def _when_all(
    refs: list[Any], then: Callable[[list[BaseException]], None] | None = None
) -> concurrent.futures.Future[list[BaseException]]:
    """A future (not tied to any event loop) done once every Ray call of ``refs`` returned, failed or not, with the
    errors of those that failed; ``then`` gets them at that moment, in whichever thread completes it."""
    done: concurrent.futures.Future[list[BaseException]] = concurrent.futures.Future()
    if then is not None:
        done.add_done_callback(lambda finished: then(finished.result()))
    remaining, errors, lock = [len(refs)], [], threading.Lock()

    def one(call: concurrent.futures.Future[Any]) -> None:
        error = concurrent.futures.CancelledError() if call.cancelled() else call.exception()
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            done.set_result(errors)

    for ref in refs:
        ref.future().add_done_callback(one)
    if not refs:
        done.set_result(errors)
    return done


def _on_loop(done: concurrent.futures.Future[Any]) -> asyncio.Future[None]:
    """An asyncio future of the running loop that completes with ``done``. Cancelling it (the step's loop ends) leaves
    ``done`` and what is chained on it alone, and a completion after the loop closed is dropped."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def complete() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def wake(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(complete)

    done.add_done_callback(wake)
    return waiter
