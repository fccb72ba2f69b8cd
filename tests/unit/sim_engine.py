"""A simulated multi-server engine with verl's vLLM gate semantics, on a virtual clock, for the scheduler tests.

Each sample has a fixed target length drawn from a heavy-tailed distribution; token ids and log-probs are pure
functions of (prompt, sample, position, version), so any lost, duplicated, re-granted or mis-versioned token is
detectable. Servers behave like verl 0.9.1's ``vLLMHttpServer`` (``vllm_async_server.py``): ``abort_all`` closes a
gate and aborts running calls (they return their tokens so far); a call arriving at a closed gate parks until
``resume`` (or, when rejecting, returns "aborted" with no tokens); a parked call is admitted -- and generates --
when the gate reopens, unless it was cancelled. Calls can be slow, fail, hang (abortable) and servers can die
(answer nothing, not even aborts). Servers report either vLLM-shaped or SGLang-shaped stop reasons, mapped by the
production mappers of ``verl_partial.core.finish``.

The virtual clock (:class:`VirtualClockLoop`) jumps to the next timer whenever nothing is ready, so simulated
minutes cost microseconds and a real stall (waiting on something that never comes) surfaces as an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import selectors
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from verl_partial.core.finish import FINISH_MAPPERS
from verl_partial.core.pool import GroupState, SegmentRequest, SegmentResult

EOS = 1_000  # outside the range of token_at
T = TypeVar("T")


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("virtual clock: nothing ready and no timer pending -- the simulation is stalled")
        self.loop.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock advances only by jumping to the next timer."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a :class:`VirtualClockLoop`; tasks left pending (calls lost to dead servers) are
    cancelled at the end."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _u(*parts: object) -> float:
    return (_h(*parts) % 1_000_003) / 1_000_003


def target_length(key: str, index: int, seed: int, response_length: int) -> int:
    """Heavy tail: most samples short, a few ~10x longer, some past response_length (truncated)."""
    u = (_h(seed, key, index) % 10_000) / 10_000
    length = int(4 / max(1e-3, 1 - u) ** 0.9)
    return max(1, min(length, response_length + 5))


def token_at(key: str, index: int, position: int) -> int:
    return _h(key, index, position) % 997


def full_tokens(key: str, index: int, seed: int, response_length: int) -> list[int]:
    """What the model would say without any length limit (the trained response is its first response_length)."""
    length = target_length(key, index, seed, response_length)
    return [EOS if p == length - 1 else token_at(key, index, p) for p in range(length)]


def log_prob_at(position: int, version: int) -> float:
    # Encodes the generating version so a test can tell which weights produced each token.
    return -(version + 1) * 1e-3 - position * 1e-7


@dataclass
class SimServer:
    name: str
    shape: str = "vllm"  # which verl server's stop_reason words it speaks: "vllm" or "sglang"
    token_latency: float = 0.01
    dies_at: float = float("inf")  # from then on it answers nothing, not even aborts
    max_num_seqs: int = 1_000  # calls decoded at once; the rest wait in the server's queue
    gate_open: bool = True
    rejecting: bool = False
    opened: asyncio.Event | None = None
    seqs: asyncio.Semaphore | None = None

    def dead(self, now: float) -> bool:
        return now >= self.dies_at

    def slots(self) -> asyncio.Semaphore:
        if self.seqs is None:
            self.seqs = asyncio.Semaphore(self.max_num_seqs)
        return self.seqs

    def gate(self) -> asyncio.Event:
        if self.opened is None:
            self.opened = asyncio.Event()
            self.opened.set()
        return self.opened


@dataclass(eq=False)
class SimCall:
    request: SegmentRequest
    key: str
    prefix: list[int]
    state: str = "transit"  # transit -> (parked) -> queued -> running -> done
    launched_at: float = 0.0
    ended_at: float = float("inf")
    abort: bool = False
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


@dataclass
class SimEngine:
    """Implements ``SegmentBackend``: launch / cancel / abort_all / resume over :class:`SimServer` s."""

    seed: int
    response_length: int
    servers_: list[SimServer]
    fail_rate: float = 0.0  # a call raises after arriving
    hang_rate: float = 0.0  # a call gets stuck at its server without tokens until aborted
    slow_rate: float = 0.0  # a call decodes 20x slower than its server
    max_transit: float = 0.0  # client -> server delay, uniform in [0, max_transit]
    reject_request: bool = True  # abort_all closes gates rejecting late arrivals (vLLM reject_request=True)
    version: int = 0
    calls: dict[str, SimCall] = field(default_factory=dict)
    decoding: set[str] = field(default_factory=set)
    tokens_generated: int = 0
    cancelled_ids: dict[str, float] = field(default_factory=dict)  # request id -> when its cancel arrived
    max_outstanding: dict[str, int] = field(default_factory=dict)

    @property
    def servers(self) -> list[str]:
        return [server.name for server in self.servers_]

    def server(self, name: str) -> SimServer:
        return next(server for server in self.servers_ if server.name == name)

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def outstanding(self, server: str) -> int:
        return sum(c.state != "done" and c.request.server == server for c in self.calls.values())

    def generating(self) -> list[str]:
        """Calls decoding on a live server (a dead server generates nothing, whatever its calls' state)."""
        now = self.now()
        return [rid for rid in self.decoding if not self.server(self.calls[rid].request.server).dead(now)]

    def live_calls(self) -> list[SimCall]:
        """Calls that may still generate: unfinished, not told to abort, on a live server (a dead server's calls
        are lost with it)."""
        now = self.now()
        return [
            c
            for c in self.calls.values()
            if c.state != "done" and not c.abort and not self.server(c.request.server).dead(now)
        ]

    # ------------------------------------------------------------ SegmentBackend
    def launch(self, wave: list[tuple[GroupState, SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        futures = []
        for group, request in wave:
            if request.request_id in self.calls:
                raise AssertionError(f"request id {request.request_id} reused")
            prefix = group.samples[request.ref.index].token_ids
            assert len(prefix) == request.prefix_len
            call = SimCall(request, group.key, prefix.tolist(), launched_at=self.now())
            self.calls[request.request_id] = call
            call.task = asyncio.ensure_future(self._serve(call, group))
            futures.append(call.task)
            name = request.server
            self.max_outstanding[name] = max(self.max_outstanding.get(name, 0), self.outstanding(name))
        return futures

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        for request in requests:
            call = self.calls[request.request_id]
            if self.server(request.server).dead(self.now()):
                continue  # a dead server does not answer its abort
            self.cancelled_ids.setdefault(request.request_id, self.now())
            if call.state == "running":
                self._stop(call)  # abort_request: returns its tokens so far
            elif call.state in ("transit", "parked", "queued") and call.task is not None:
                call.task.cancel()  # the client's cancel reaches the call before the engine admits it

    async def abort_all(self) -> None:
        await asyncio.gather(*[self._abort_server(server) for server in self.servers_])

    async def _abort_server(self, server: SimServer) -> None:
        if server.dead(self.now()):
            await asyncio.Event().wait()  # the control call hangs like the server
        server.gate_open, server.rejecting = False, self.reject_request
        server.gate().clear()
        for call in self.calls.values():
            if call.request.server == server.name and call.state == "running":
                self._stop(call)
            elif call.request.server == server.name and call.state == "queued" and call.task is not None:
                call.task.cancel()  # vLLM's pause aborts waiting requests too: no tokens

    def _stop(self, call: SimCall) -> None:
        """Abort a running call: it appends no token after this moment and returns what it has."""
        call.abort = True
        call.aborted.set()
        self.decoding.discard(call.request.request_id)

    async def resume(self) -> None:
        for server in self.servers_:
            if not server.dead(self.now()):
                server.gate_open, server.rejecting = True, False
                server.gate().set()

    # ------------------------------------------------------------ one call
    async def _serve(self, call: SimCall, group: GroupState) -> SegmentResult:
        try:
            return await self._arrive_and_run(call, group)
        finally:
            call.state, call.ended_at = "done", self.now()

    async def _arrive_and_run(self, call: SimCall, group: GroupState) -> SegmentResult:
        request, server = call.request, self.server(call.request.server)
        attempt_draw = _u(self.seed, "fault", request.request_id)
        try:
            await asyncio.sleep(_u(self.seed, "transit", request.request_id) * self.max_transit)
            if server.dead(self.now()):
                await asyncio.Event().wait()
            while not server.gate_open:
                if server.rejecting:
                    return self._result(call, [], "abort")
                call.state = "parked"
                await server.gate().wait()
            call.state = "queued"
            await server.slots().acquire()
        except asyncio.CancelledError:
            # Cancelled in transit, at the gate or in the queue (the engine's abort of a waiting request).
            return self._result(call, [], "abort")
        call.state = "running"
        try:
            if attempt_draw < self.fail_rate:
                raise RuntimeError("injected failure")
            if attempt_draw < self.fail_rate + self.hang_rate:
                await call.aborted.wait()
                return self._result(call, [], "abort")
            return await self._decode(call, server, group, attempt_draw)
        finally:
            server.slots().release()

    async def _decode(self, call: SimCall, server: SimServer, group: GroupState, draw: float) -> SegmentResult:
        request = call.request
        index = request.ref.index
        expected = full_tokens(call.key, index, self.seed, self.response_length)
        start = len(call.prefix)
        assert call.prefix == expected[:start], "resumed from a wrong prefix"
        latency = server.token_latency * (20 if draw > 1 - self.slow_rate else 1)
        new_ids: list[int] = []
        self.decoding.add(request.request_id)
        try:
            for position in range(start, start + request.max_new_tokens):
                await asyncio.sleep(latency)
                if server.dead(self.now()):
                    self.decoding.discard(request.request_id)  # lost with its server; generates nothing more
                    await asyncio.Event().wait()
                if call.abort:
                    return self._result(call, new_ids, "abort")
                new_ids.append(expected[position])
                self.tokens_generated += 1
                if new_ids[-1] == EOS:
                    break
        finally:
            self.decoding.discard(request.request_id)
        if server.shape == "vllm":
            return self._result(call, new_ids, "completed")
        return self._result(call, new_ids, "stop" if new_ids[-1] == EOS else "length")

    def _result(self, call: SimCall, new_ids: list[int], raw: str) -> SegmentResult:
        server = self.server(call.request.server)
        if raw == "abort" and server.shape == "vllm":
            raw = "aborted"
        finish = FINISH_MAPPERS[server.shape](raw, new_ids, call.request.max_new_tokens, {EOS})
        start = len(call.prefix)
        return SegmentResult(
            new_ids=np.asarray(new_ids, dtype=np.int32),
            new_log_probs=np.asarray(
                [log_prob_at(start + i, self.version) for i in range(len(new_ids))], dtype=np.float32
            ),
            finish=finish,
            server=server.name,
            server_version=self.version,
            prompt_ids=np.asarray([_h(call.key) % 97], dtype=np.int32),
        )

    def shutdown(self) -> None:
        for call in self.calls.values():
            if call.task is not None and not call.task.done():
                call.task.cancel()
