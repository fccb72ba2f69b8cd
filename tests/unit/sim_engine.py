"""A test double of verl 0.9.1's rollout servers with REAL-ENGINE semantics, on a virtual clock (issue 19).

Each sample has a fixed target length drawn from a heavy-tailed distribution; token ids and log-probs are pure
functions of (prompt, sample, position, version), so any lost, duplicated, re-granted, mis-versioned or
after-EOS token is detectable. What the double checks itself (resumed from a wrong prefix or after an EOS, a
prefix match hitting another call, a resume that overtook an abort) goes to ``SimEngine.violations``; it is never
raised into a call, where the scheduler would count it as an ordinary failure.

Each :class:`SimServer` speaks one engine (``engine="vllm"`` or ``"sglang"``), copied from the code that ships:

vLLM 0.24 behind verl's ``vLLMHttpServer`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``):
  * ``max_num_seqs`` slots and a FIFO waiting queue;
  * ``abort_all_requests``: closes the gate (``_park_until_admitted`` rejects late arrivals with "aborted" when
    ``reject_request``, else parks them), then waits up to ``_GATE_BARRIER_TIMEOUT_S`` (60 s) while ``_admitting >
    0`` -- ``_admitting`` falls at a request's first output or when its generator ends, so QUEUED requests hold
    the barrier while running ones keep decoding -- then ``pause_generation`` aborts everything: running requests
    return all their tokens, queued ones none; the engine stays paused until ``resume_generation``. The pause
    reaches the engine ``pause_delay_s`` after the barrier (the engine's own latency: aborting and draining in-flight
    requests under load); the abort returns only then;
  * ``abort_request(request_id)``: a request the engine holds (queued or running) ends "aborted" with its tokens
    so far (none if queued); anything else answers "not found" and is unaffected;
  * a Ray-cancelled call: ``AsyncLLM.generate`` aborts the request on ``CancelledError``; the client gets nothing.

SGLang 0.5.12 behind verl's ``SGLangHttpServer`` (``sglang/srt/managers/schedule_batch.py``, ``Req.check_finished``;
``tokenizer_manager.py``):
  * an abort (all or per request) lets each RUNNING request decode one more token; ``check_finished`` tests the
    abort before length and length before EOS: the extra token may be an EOS or the last allowed token while the
    reason says "abort", and an EOS that is the last allowed token says "length";
  * ``pause_generation(mode="abort")`` parks late arrivals at ``is_pause_cond`` (it ignores ``reject_request``);
    the rejecting gate of our server fix (``verl_partial/glue/engines/sglang.py``) is modelled by ``reject_request``:
    it closes BEFORE the pause and answers late arrivals "abort" with no tokens;
  * ``abort_request(rid)`` matches request ids BY PREFIX;
  * a Ray-cancelled call sends no abort (no ``CancelledError`` handler): the request keeps decoding and holding its
    slot until it finishes or an abort reaches it; cancelled at the pause gate it leaks its state. Our server fix
    (``cancel_aborts=True``) sends ``abort_request(rid)`` first, as vLLM does;
  * new tokens are capped at ``max_model_len - prompt - 1``: at the cap, "length" with 0 tokens;
  * ``TokenizerManager.rid_to_state`` (a state from arrival, before the pause gate, until a scheduler output deletes
    it): an abort of a queued request is echoed back and handled later by ``_handle_abort_req``, which indexes the
    table without a guard (a KeyError kills SGLang: a violation). With ``cancel_aborts`` the double runs our fix's own
    ``_cancel`` and ``_forget_answered`` (``verl_partial/glue/engines/sglang.py``) on that table.

Speculative servers (``spec_run`` > 1): an engine step appends a run of 1..``spec_run`` tokens. vLLM 0.24's scheduler
checks stop (EOS, ``max_tokens``) after each token and drops the rest of the run; SGLang 0.5.12 appends the whole run,
then checks abort (the whole output is returned, past ``max_new_tokens`` too), length (cut at ``max_new_tokens``),
EOS (cut after the first EOS of the run). Every answer -- token ids, log-probs, the engine's stop reason as verl's
server reports it -- goes through the real finish mapper and ``SegmentEnd.cut``, as the glue's ``_generate`` does.

On both, a resume that lands while the server's abort has not returned is undone by the pause that ends the abort
and leaves the engine paused: the double records it (a violation). ``resume`` chains the resume on the server's
abort as the glue does (``WorkerSegmentBackend``), and a call launched to a server whose gate is closed or whose
engine is paused (resumed too late) is a violation too.

Calls can fail, hang, be slow, and servers can die (answer nothing, not even aborts). A hung call wedges its
server's batch: both engines decode their running requests in lockstep, so nothing on that server gets a token until
the hung call is aborted (what ``progress``, the stall check's reading, then reports).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import verl  # noqa: F401 -- first: verl's plugin hook imports verl_partial's glue, which the next lines import too

from verl_partial.core.engines.adapter import FINISH_MAPPERS
from verl_partial.core.partial.pool import GroupState, SegmentRequest, SegmentResult
from verl_partial.glue.engines.sglang import _cancel, _forget_answered
from verl_partial.sim.clock import run_virtual

__all__ = [
    "EOS",
    "PROMPT_LEN",
    "CallCancelled",
    "SimEngine",
    "SimServer",
    "full_tokens",
    "log_prob_at",
    "run_virtual",
    "target_length",
]

EOS = 1_000  # outside the range of token_at
PROMPT_LEN = 1  # every prompt is one token (``SegmentResult.prompt_ids``)
GATE_BARRIER_TIMEOUT_S = 60.0  # verl's vllm_async_server._GATE_BARRIER_TIMEOUT_S

Engine = Literal["vllm", "sglang"]


class CallCancelled(RuntimeError):
    """What a Ray-cancelled call raises at its client (``ray.exceptions.TaskCancelledError``'s stand-in)."""


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


@functools.lru_cache(maxsize=1 << 16)
def full_tokens(key: str, index: int, seed: int, response_length: int) -> tuple[int, ...]:
    """What the model would say without any length limit (the trained response is its first response_length)."""
    length = target_length(key, index, seed, response_length)
    return tuple(EOS if p == length - 1 else token_at(key, index, p) for p in range(length))


def log_prob_at(position: int, version: int) -> float:
    # Encodes the generating version so a test can tell which weights produced each token.
    return -(version + 1) * 1e-3 - position * 1e-7


@dataclass
class SimServer:
    name: str
    engine: Engine = "vllm"
    token_latency: float = 0.01
    dies_at: float = float("inf")  # from then on it answers nothing, not even aborts
    max_num_seqs: int = 1_000  # requests decoded at once; the rest wait in the engine's queue
    max_model_len: int | None = None  # prompt + response cap (None: unlimited)
    cancel_aborts: bool = False  # SGLang with our server fix: a cancelled call aborts its request
    stuck: bool = False  # a wedged engine: its requests produce no token until aborted (it still answers aborts)
    wedged: int = 0  # hung calls running: the batch decodes in lockstep, so no call gets a token meanwhile
    # Gate (vLLM ``_submission_paused`` / our SGLang fix's rejecting gate) and engine pause (vLLM
    # ``pause_generation``, SGLang ``is_pause``).
    gate_closed: bool = False
    rejecting: bool = False
    paused: bool = False
    admitting: int = 0  # vLLM ``_admitting``
    pause_delay_s: float = 0.0  # from the end of the barrier (SGLang: the abort call) to the pause landing
    spec_run: int = 1  # speculative decoding: an engine step appends a run of 1..spec_run tokens (1: off)
    aborting: bool = False  # an abort is under way (it has not returned)
    resumed_while_aborting: bool = False
    waiting: deque[SimCall] = field(default_factory=deque)
    running: set[SimCall] = field(default_factory=set)
    # Who waits for the next change of gate, pause, queue or admissions (each registered before it yields).
    watchers: list[asyncio.Future[None]] = field(default_factory=list)

    # SGLang's TokenizerManager (set by SimEngine): what our server fix's cancel reads and the abort echo indexes.
    tokenizer_manager: SimTokenizerManager | None = None

    def dead(self, now: float) -> bool:
        return now >= self.dies_at

    def poke(self) -> None:
        watchers, self.watchers = self.watchers, []
        for watcher in watchers:
            if not watcher.done():
                watcher.set_result(None)

    def next_change(self) -> asyncio.Future[None]:
        """A future done at the next :meth:`poke`, registered at once: a change between a caller's check and its
        wait is never missed (a shared event cleared by each waiter, as before, lost such wake-ups, so vLLM's
        barrier, which verl polls every 10 ms, could hold for its full 60 s in the double)."""
        watcher = asyncio.get_running_loop().create_future()
        self.watchers.append(watcher)
        return watcher


@dataclass(eq=False)
class SimReqState:
    """SGLang's ``ReqState`` as our server fix reads it: ``finished``, ``event``, and whether it was dispatched."""

    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    dispatched: bool = False


@dataclass
class SimTokenizerManager:
    """SGLang 0.5.12's ``TokenizerManager`` as far as our server fix touches it: ``rid_to_state`` (a state from the
    request's arrival, before the pause gate, until a scheduler output deletes it) and ``abort_request(rid)``, which
    does nothing for an id it holds no state of, else sends the abort to the scheduler."""

    send_abort: Callable[[str], None]
    rid_to_state: dict[str, SimReqState] = field(default_factory=dict)
    aborts_sent: int = 0

    def abort_request(self, rid: str) -> None:
        if rid in self.rid_to_state:  # tokenizer_manager.py@0.5.12:1490 "if not abort_all and rid not in ..."
            self.aborts_sent += 1
            self.send_abort(rid)


@dataclass(eq=False)
class SimCall:
    request: SegmentRequest
    key: str
    prefix: list[int]
    future: asyncio.Future[SegmentResult]  # what the scheduler holds
    state: str = "transit"  # transit -> (parked) -> queued -> running -> done
    launched_at: float = 0.0
    ended_at: float = float("inf")
    abort: bool = False  # told to abort (per request or all)
    cancelled: bool = False  # Ray-cancelled: the client got nothing back
    zombie: bool = False  # cancelled on SGLang without our fix: decodes on, unseen
    first_output: bool = False
    echoed: bool = False  # SGLang: the scheduler's echo of its abort while queued reached the tokenizer
    registered: bool = False  # SGLang: its state entered rid_to_state
    queued_at: float = 0.0
    started_at: float = 0.0
    new_ids: list[int] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


@dataclass
class SimEngine:
    """Implements ``SegmentBackend``: launch / take_back / cancel / abort / resume (per server) / reopening over
    :class:`SimServer` s."""

    seed: int
    response_length: int
    servers_: list[SimServer]
    fail_rate: float = 0.0  # a call raises after it starts running
    hang_rate: float = 0.0  # a call is stuck at its server without tokens until aborted
    slow_rate: float = 0.0  # a call decodes 20x slower than its server
    max_transit: float = 0.0  # client -> server delay, uniform in [0, max_transit]
    reject_request: bool = True  # abort rejects late arrivals (vLLM reject_request=True; our SGLang fix)
    cancel_raises: bool = False  # a cancelled call's future fails (else: resolves ABORTED with no tokens)
    version: int = 0
    calls: dict[str, SimCall] = field(default_factory=dict)
    tokens_generated: int = 0  # by calls the client still waits for
    tokens_delivered: int = 0  # in results handed to the client
    tokens_lost: int = 0  # generated by calls that were cancelled: the client never saw them
    zombie_tokens: int = 0  # generated after a cancel that did not stop the request (SGLang without our fix)
    leaked_states: int = 0  # SGLang requests cancelled at the pause gate
    taken_back: dict[str, float] = field(default_factory=dict)  # request id -> when take_back reached it
    cancelled_ids: dict[str, float] = field(default_factory=dict)  # request id -> when its cancel arrived
    max_outstanding: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Answers whose reason hides the truth (SGLang): "abort" on an EOS or on the last allowed token, "length" on an
    # EOS, and 0-token "length" at the model-length cap. Tests use them to show their case really happened.
    tricky: Counter[str] = field(default_factory=Counter)
    # Calls that waited in their server's queue for ``long_decode_s`` or more behind a call of their own group (a long
    # answer with queued siblings, issue 26 item 4), counted when that call ends; the soak sets it to request_timeout_s.
    long_decode_s: float = float("inf")
    queued_behind_long: int = 0
    queued_taken_back: Counter[int] = field(default_factory=Counter)  # per version (step - 1): queued calls taken back
    progress_reads: int = 0
    # SGLang: echoes of an abort while queued handled by the tokenizer, those of calls the client had cancelled (the
    # echo that killed 0.5.12 when the state went first), and aborts our fix's reaper sent.
    abort_echoes: int = 0
    echoes_after_cancel: int = 0
    # Speculative servers: engine steps that appended more than one token, returned runs holding an EOS before their
    # last token, and tokens the finish mapper's cut dropped (after an EOS, or past the call's max_new_tokens).
    spec_runs: int = 0
    eos_inside_run: int = 0
    tokens_cut: int = 0
    never: asyncio.Future[None] | None = None
    _taking_back: bool = False
    open: Counter[str] = field(default_factory=Counter)
    reopened: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # per server: its last (chained) resume

    def __post_init__(self) -> None:
        for server in self.servers_:
            if server.engine == "sglang":
                server.tokenizer_manager = SimTokenizerManager(functools.partial(self._scheduler_abort, server))

    @property
    def servers(self) -> list[str]:
        return [server.name for server in self.servers_]

    def server(self, name: str) -> SimServer:
        return next(server for server in self.servers_ if server.name == name)

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def outstanding(self, server: str) -> int:
        """Calls on ``server`` the client still waits for (kept as a count: read at every launch)."""
        return self.open[server]

    def generating(self) -> list[str]:
        """Requests decoding on a live server that nobody told to stop. Zombies are counted apart; a request told to
        abort ends within one engine step (SGLang: after its one more token), which no client can wait for when the
        abort went with a cancel."""
        now = self.now()
        return [
            c.request.request_id
            for server in self.servers_
            if not server.dead(now)
            for c in server.running
            if not c.zombie and not c.abort
        ]

    def live_calls(self) -> list[SimCall]:
        """Calls a live server still works on, or will once they arrive, for a client that still waits."""
        now = self.now()
        return [
            c
            for c in self.calls.values()
            if c.state != "done" and not c.cancelled and not self.server(c.request.server).dead(now)
        ]

    # ------------------------------------------------------------ SegmentBackend
    def launch(self, wave: list[tuple[GroupState, SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        loop = asyncio.get_running_loop()
        futures = []
        for group, request in wave:
            if request.request_id in self.calls:
                raise AssertionError(f"request id {request.request_id} reused")
            prefix = group.samples[request.ref.index].token_ids
            assert len(prefix) == request.prefix_len
            call = SimCall(request, group.key, prefix.tolist(), loop.create_future(), launched_at=self.now())
            self.calls[request.request_id] = call
            call.task = loop.create_task(self._serve(call))
            futures.append(call.future)
            name = request.server
            if self.server(name).gate_closed or self.server(name).paused:
                self.violations.append(f"{request.request_id} launched to {name} before its resume")
            self.open[name] += 1
            call.future.add_done_callback(lambda _, name=name: self.open.subtract([name]))
            self.max_outstanding[name] = max(self.max_outstanding.get(name, 0), self.outstanding(name))
        return futures

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        """Abort each call at its server by request id (vLLM ``abort_request``; SGLang ``abort_request``, prefix
        match). A call the engine does not hold (in transit, parked, done) is unaffected. A dead server does not
        answer."""
        dead = False
        for request in requests:
            server = self.server(request.server)
            if server.dead(self.now()):
                dead = True
                continue
            self.taken_back.setdefault(request.request_id, self.now())
            self._taking_back = True
            try:
                if server.tokenizer_manager is not None:  # our take_back_requests: abort_request(rid) per id held
                    server.tokenizer_manager.abort_request(request.request_id)
                else:
                    self._scheduler_abort(server, request.request_id)
            finally:
                self._taking_back = False
        if dead:
            await self._hang()

    def _scheduler_abort(self, server: SimServer, rid: str) -> None:
        """The engine's per-request abort: vLLM by exact id, SGLang's scheduler by prefix."""
        held = [c for c in (*server.waiting, *server.running) if not c.abort]
        if server.engine == "vllm":
            matched = [c for c in held if c.request.request_id == rid]
        else:
            matched = [c for c in held if c.request.request_id.startswith(rid)]
        for call in matched:
            if call.state == "queued" and self._taking_back:
                self.queued_taken_back[self.version] += 1
            if call.request.request_id != rid:
                self.violations.append(
                    f"abort_request({rid!r}) prefix-matched another call {call.request.request_id!r} on {server.name}"
                )
            self._abort(server, call)

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        """Ray cancel: the client gets nothing back. vLLM (and SGLang with our fix) abort the request; SGLang
        without it decodes on."""
        dead = False
        for request in requests:
            call, server = self.calls[request.request_id], self.server(request.server)
            if server.dead(self.now()):
                dead = True
                continue
            self.cancelled_ids.setdefault(request.request_id, self.now())
            if call.future.done() or call.cancelled:
                continue
            call.cancelled = True
            self.tokens_lost += len(call.new_ids)
            if self.cancel_raises:
                call.future.set_exception(CallCancelled(f"{request.request_id} cancelled"))
            else:
                call.future.set_result(self._result(call, [], "abort"))
            if server.engine == "sglang" and server.cancel_aborts:
                # Our server fix's CancelledError handler, the real one: a state never dispatched goes at once, a
                # dispatched one is aborted and kept (a reaper re-sends the abort) until SGLang answered it.
                _cancel(server, request.request_id)
            if call.state in ("transit", "parked"):
                if call.state == "parked" and server.engine == "sglang" and not server.cancel_aborts:
                    self.leaked_states += 1  # cancelled at is_pause_cond: its state stays in the tokenizer manager
                if call.task is not None:
                    call.task.cancel()
            elif server.engine == "vllm":
                self._abort(server, call)
            elif server.cancel_aborts:
                pass  # aborted by _cancel above
            else:
                call.zombie = True  # SGLang: no CancelledError handler, no abort sent
        if dead:
            await self._hang()

    async def abort(self, name: str) -> None:
        """verl's ``abort_all_requests(reject_request=True)`` on one server; returns once its engine is paused."""
        server = self.server(name)
        await self._alive(server)  # the control call hangs like the server
        server.aborting, server.resumed_while_aborting = True, False
        server.gate_closed, server.rejecting = True, self.reject_request
        if server.engine == "vllm":
            await self._vllm_barrier(server)
        else:
            server.gate_closed = self.reject_request  # our fix's gate; SGLang's own pause ignores reject_request
        if server.pause_delay_s:
            await asyncio.sleep(server.pause_delay_s)
            await self._alive(server)
        # pause_generation: everything the engine holds is aborted; it stays paused until resume.
        for call in [*server.waiting, *server.running]:
            self._abort(server, call)
        server.paused, server.aborting = True, False
        if server.resumed_while_aborting:
            self.violations.append(
                f"a resume overtook the abort on {name} (returned at t={self.now():.3f}): the pause landed after it "
                "and left the engine paused"
            )
        server.poke()

    async def _vllm_barrier(self, server: SimServer) -> None:
        """``abort_all_requests``: wait (<= 60 s) while admitted requests have no first output."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GATE_BARRIER_TIMEOUT_S
        while server.admitting > 0 and loop.time() < deadline:
            try:
                await asyncio.wait_for(server.next_change(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
            await self._alive(server)

    async def resume(self, name: str) -> None:
        """verl's ``resume_generation``, chained on the server's abort as the glue chains it: it lands only once that
        abort returned, and the chain outlives the caller (the scheduler stops waiting after its grace)."""
        task = self.reopened[name] = asyncio.ensure_future(self._resume_after_abort(self.server(name)))
        await asyncio.shield(task)

    def reopening(self) -> dict[str, asyncio.Task[None]]:
        return {name: task for name, task in self.reopened.items() if not task.done()}

    async def progress(self, name: str) -> dict[str, int]:
        """Tokens so far of each request the server holds (queued: 0), as our server-side reading reports them. A dead
        server does not answer."""
        server = self.server(name)
        await self._alive(server)
        self.progress_reads += 1
        return {c.request.request_id: len(c.new_ids) for c in (*server.waiting, *server.running)}

    async def _resume_after_abort(self, server: SimServer) -> None:
        while server.aborting:
            await server.next_change()
        await self._alive(server)  # a dead server never answers it: it stays closed
        self.land_resume(server)

    def land_resume(self, server: SimServer) -> None:
        """The resume reaching ``server``: while its abort has not returned, it opens the gate and the pause that ends
        the abort lands after it (recorded when the abort returns)."""
        if server.aborting:
            server.resumed_while_aborting = True
            server.gate_closed, server.rejecting = False, False
        else:
            server.gate_closed, server.rejecting, server.paused = False, False, False
        server.poke()
        self._schedule(server)

    # ------------------------------------------------------------ the engine
    def _abort(self, server: SimServer, call: SimCall) -> None:
        """Tell the engine to end a request it holds: queued ones end at once, running ones at their next token
        boundary (SGLang: after one more token)."""
        if call.abort or call.state not in ("queued", "running"):
            return
        call.abort = True
        if call.state == "queued":
            server.waiting.remove(call)
            call.state = "aborted_queued"
            if server.tokenizer_manager is not None:
                # scheduler.py@0.5.12:3574: a request popped from the waiting queue is echoed to the tokenizer, whose
                # handler runs later, in its own loop (the scheduler is another process).
                asyncio.get_running_loop().call_soon(self._abort_echo, server, call)
        call.wake.set()
        server.poke()  # a decode step waiting on a wedged batch re-checks its abort

    def _abort_echo(self, server: SimServer, call: SimCall) -> None:
        """``TokenizerManager._handle_abort_req`` (tokenizer_manager.py@0.5.12:2417-2421): no guard, no delete. A
        state deleted before the echo raises KeyError there, which kills SGLang's process tree: a violation."""
        rid = call.request.request_id
        self.abort_echoes += 1
        self.echoes_after_cancel += call.cancelled
        try:
            state = server.tokenizer_manager.rid_to_state[rid]
        except KeyError:
            self.violations.append(f"{rid}: SGLang's abort echo found no state (KeyError: the server dies)")
        else:
            state.finished = True
            state.event.set()
        call.echoed = True
        call.wake.set()

    def _scheduler_output(self, server: SimServer, call: SimCall) -> None:
        """A request the scheduler ended reaching the tokenizer (tokenizer_manager.py@0.5.12:1671, 1871): its state,
        if still there, is finished and deleted."""
        tm = server.tokenizer_manager
        state = None if tm is None else tm.rid_to_state.pop(call.request.request_id, None)
        if state is not None:
            state.finished = True
            state.event.set()

    def _ran_long(self, server: SimServer, call: SimCall) -> None:
        """At the end of a running call: count its siblings that waited in the queue ``long_decode_s`` or more."""
        if call in server.running:
            waited = self.now() - self.long_decode_s
            self.queued_behind_long += sum(c.key == call.key and c.queued_at <= waited for c in server.waiting)

    def _schedule(self, server: SimServer) -> None:
        while server.waiting and len(server.running) < server.max_num_seqs and not server.paused:
            call = server.waiting.popleft()
            call.state, call.started_at = "running", self.now()
            server.running.add(call)
            call.wake.set()

    async def _serve(self, call: SimCall) -> None:
        server = self.server(call.request.server)
        try:
            outcome = await self._arrive_and_run(call, server)
        except asyncio.CancelledError:
            return  # cancelled before its server ran it
        except Exception as error:  # an injected failure: the client sees it
            if not call.future.done():
                call.future.set_exception(error)
            return
        finally:
            self._ran_long(server, call)
            call.state, call.ended_at = "done", self.now()
            server.running.discard(call)
            self._schedule(server)
        if call.future.done():
            return  # cancelled: the client already has its (empty) answer
        if server.tokenizer_manager is not None and server.cancel_aborts:
            _forget_answered(server.tokenizer_manager, call.request.request_id)  # our fix's generate, on return
        self.tokens_delivered += len(outcome.new_ids)
        call.future.set_result(outcome)

    async def _arrive_and_run(self, call: SimCall, server: SimServer) -> SegmentResult:
        request = call.request
        await asyncio.sleep(_u(self.seed, "transit", request.request_id) * self.max_transit)
        await self._alive(server)
        tm = server.tokenizer_manager
        while server.gate_closed or (server.engine == "sglang" and server.paused):
            if server.gate_closed and server.rejecting:
                if tm is not None and tm.rid_to_state.get(request.request_id) is not None:
                    del tm.rid_to_state[request.request_id]  # (parked before the gate closed: answered, gone)
                return self._result(call, [], "abort")  # rejected at the gate, never entered the engine
            if tm is not None:
                self._register(tm, call)  # SGLang registers the state before its pause gate
            call.state = "parked"
            await server.next_change()
            await self._alive(server)
        # Past the gate: vLLM counts the admission until the first output or the end of the request.
        vllm = server.engine == "vllm"
        if vllm:
            server.admitting += 1
        if tm is not None:
            self._register(tm, call).dispatched = True
        call.state, call.queued_at = "queued", self.now()
        server.waiting.append(call)
        self._schedule(server)
        try:
            # SGLang answers an abort while queued with the echo only.
            while call.state == "queued" or (call.state == "aborted_queued" and tm is not None and not call.echoed):
                call.wake.clear()
                await call.wake.wait()
            if call.state == "aborted_queued":
                return self._result(call, [], "abort")
            try:
                return await self._run(call, server)
            finally:
                self._scheduler_output(server, call)
        finally:
            if vllm and not call.first_output:
                server.admitting -= 1
                server.poke()

    def _register(self, tm: SimTokenizerManager, call: SimCall) -> SimReqState:
        rid = call.request.request_id
        if rid not in tm.rid_to_state:
            if call.registered:
                self.violations.append(f"{rid}: its SGLang state was deleted before the request ended")
            tm.rid_to_state[rid] = SimReqState()
            call.registered = True
        return tm.rid_to_state[rid]

    async def _alive(self, server: SimServer) -> None:
        if server.dead(self.now()):
            await self._hang()

    async def _hang(self) -> None:
        """Wait forever, like anything sent to a dead server. One future the engine holds, so the waiting tasks stay
        referenced (and are cancelled at the end of ``run_virtual``) instead of being collected while pending."""
        if self.never is None:
            self.never = asyncio.get_running_loop().create_future()
        await self.never

    async def _run(self, call: SimCall, server: SimServer) -> SegmentResult:
        request = call.request
        draw = _u(self.seed, "fault", request.request_id)
        if draw < self.fail_rate:
            raise RuntimeError("injected failure")
        if server.stuck or draw < self.fail_rate + self.hang_rate:
            server.wedged += 1
            try:
                while not call.abort:
                    call.wake.clear()
                    await call.wake.wait()
            finally:
                server.wedged -= 1
                server.poke()
            return self._result(call, [], "abort")
        expected = full_tokens(call.key, request.ref.index, self.seed, self.response_length)
        start = len(call.prefix)
        if EOS in call.prefix:
            self.violations.append(f"{request.request_id}: resumed after an EOS")
        elif tuple(call.prefix) != expected[:start]:
            self.violations.append(f"{request.request_id}: resumed from a wrong prefix")
        max_new = request.max_new_tokens
        if server.max_model_len is not None:
            room = server.max_model_len - PROMPT_LEN - start
            # SGLang caps new tokens at max_model_len - prompt - 1; verl clamps vLLM's max_tokens to max_model_len
            # - prompt (vLLM then reports the truncated answer as "completed").
            max_new = min(max_new, room - 1 if server.engine == "sglang" else room)
            if max_new <= 0:
                return self._result(call, [], "length" if server.engine == "sglang" else "completed")
        latency = server.token_latency * (20 if draw > 1 - self.slow_rate else 1)
        while True:
            await self._decode_step(call, server, latency)
            if call.abort and server.engine == "vllm":
                return self._result(call, call.new_ids, "abort")  # vLLM: nothing after the abort
            # One engine step: one token, or a speculative run of accepted tokens (its length a pure function too).
            run = 1 + _h(self.seed, "run", request.request_id, len(call.new_ids)) % server.spec_run
            self.spec_runs += run > 1
            if server.engine == "vllm":
                # vLLM 0.24's scheduler appends a run token by token, checks stop (EOS, max_tokens) after each and
                # drops the rest of the run: it reports "completed" for both.
                for _ in range(run):
                    token = self._token_at(call, expected, start + len(call.new_ids))
                    self._emit(call, server, token)
                    if token == EOS or len(call.new_ids) >= max_new:
                        return self._result(call, call.new_ids, "completed")
                continue
            # SGLang 0.5.12 appends the whole run (scheduler_output_processor_mixin.py 552-564), then check_finished:
            # abort (the step after it: the whole run is returned), length (the output cut at max_new_tokens,
            # ``finished_len``), EOS among the run's tokens (cut after the first).
            run_start = len(call.new_ids)
            for _ in range(run):
                self._emit(call, server, self._token_at(call, expected, start + len(call.new_ids)))
            if call.abort:
                return self._result(call, call.new_ids, "abort")
            if len(call.new_ids) >= max_new:
                return self._result(call, call.new_ids[:max_new], "length")
            if EOS in call.new_ids[run_start:]:
                return self._result(call, call.new_ids[: call.new_ids.index(EOS, run_start) + 1], "stop")

    def _token_at(self, call: SimCall, expected: tuple[int, ...], position: int) -> int:
        """The model's token at ``position``; past its EOS, what a run decoded on would hold (pure as well)."""
        return expected[position] if position < len(expected) else token_at(call.key, call.request.ref.index, position)

    async def _decode_step(self, call: SimCall, server: SimServer, latency: float) -> None:
        """The time of one token of this call. An abort cuts it short: vLLM drops the request at once, SGLang
        decodes its one more token within one step of the server's own pace (a slow call is slow for its own
        reasons, not because the engine's steps are)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + latency
        if not call.abort:
            call.wake.clear()
            timer = loop.call_at(end, call.wake.set)
            try:
                await call.wake.wait()
            finally:
                timer.cancel()
        if call.abort and server.engine == "sglang" and loop.time() < end:
            await asyncio.sleep(min(server.token_latency, end - loop.time()))
        while server.wedged and not call.abort:
            await server.next_change()
        await self._alive(server)

    def _emit(self, call: SimCall, server: SimServer, token: int) -> None:
        call.new_ids.append(token)
        if call.zombie:
            self.zombie_tokens += 1
        elif call.cancelled:
            self.tokens_lost += 1
        else:
            self.tokens_generated += 1
        if not call.first_output:
            call.first_output = True
            if server.engine == "vllm":
                server.admitting -= 1
                server.poke()

    def _result(self, call: SimCall, new_ids: list[int], raw: str) -> SegmentResult:
        server = self.server(call.request.server)
        if raw == "abort" and server.engine == "vllm":
            raw = "aborted"
        if raw in ("abort", "length") and server.engine == "sglang":
            if not new_ids:
                self.tricky["length_0_tokens" if raw == "length" else "abort_0_tokens"] += 1
            elif new_ids[-1] == EOS:
                self.tricky[f"{raw}_on_eos"] += 1
            elif raw == "abort" and len(new_ids) == call.request.max_new_tokens:
                self.tricky["abort_on_last_allowed"] += 1
        if EOS in new_ids[:-1]:
            self.eos_inside_run += 1
        # What verl's server returns (token ids, their log-probs, the engine's stop reason), through the real mapper
        # and cut, as the glue's ``_generate`` does.
        start = len(call.prefix)
        log_probs = [log_prob_at(start + i, self.version) for i in range(len(new_ids))]
        end = FINISH_MAPPERS[server.engine](raw, new_ids, call.request.max_new_tokens, {EOS})
        self.tokens_cut += len(new_ids) - end.keep
        return SegmentResult(
            new_ids=np.asarray(end.cut(new_ids), dtype=np.int32),
            new_log_probs=np.asarray(end.cut(log_probs), dtype=np.float32),
            finish=end.finish,
            server=server.name,
            server_version=self.version,
            prompt_ids=np.asarray([_h(call.key) % 97], dtype=np.int32),
        )

    def shutdown(self) -> None:
        for call in self.calls.values():
            if call.task is not None and not call.task.done():
                call.task.cancel()
