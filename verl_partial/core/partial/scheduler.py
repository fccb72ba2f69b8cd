"""One partial-rollout step: keep the pool full, run segments, stop once enough whole groups are done.

The loop is pure asyncio over two small protocols, so the very code the trainer runs is what the
property tests drive with a simulated engine (random lengths, latencies, failures, hung servers,
closed gates).

Rules that keep a step from stalling and training from being biased (docs/method/partial-rollout.md, "The
scheduler"). They hold on what real servers do (verl 0.9.1 over vLLM 0.24 and SGLang 0.5.12): a
cancelled call brings NOTHING back, vLLM's ``abort_all_requests`` first waits for every request queued in the
engine to produce a first output, and SGLang keeps decoding a request whose call was cancelled.

* **Giving up a call never loses its tokens.** A call is given up by taking it back: aborted at its server by
  request id, so it answers ABORTED with every token it generated. A call that does not answer within
  ``partial.abort_grace_s`` is taken back once more: a call in transit at the first was not held by its engine yet.
  Mid-step, while its server answers the take-backs, it is taken back again every ``abort_grace_s``: gates are open,
  so a call in transit reaches its engine and the next take-back returns its tokens, where a cancel would lose
  what it generated since it arrived. Only a call whose server did not even answer the last take-back (hung), or one
  still out after two take-backs at the step end (gates closed: it was refused or parks, generating nothing), is
  cancelled -- ``partial/cancelled_calls``, the only way tokens can be lost; a cancelled call returns nothing, so
  the loss is unknown and ``partial/cancelled_tokens_max`` bounds it -- and abandoned after one more grace.
* **Step end.** Stop launching -> ``backend.abort(server)`` starts for every server (gates close, rejecting late
  arrivals; running calls return ABORTED with their tokens) and every call is taken back -> answers are recorded
  for ``abort_grace_s`` -> every call still out is taken back (again): requests queued in an engine end (no
  tokens, nothing generated), which is what lets vLLM's abort barrier pass, running ones return their tokens ->
  ``backend.resume(server)`` for each server, which
  lands only once THAT server's abort returned: vLLM pauses its engine at the end of its abort, so a resume landing
  earlier is undone and leaves the engine paused. A server whose abort outlives the step end has its resume chained
  on the abort by the backend (it outlives the step's event loop), counts a ``partial/control_timeouts``, and sits
  the next step out if it has not reopened when that step starts (a call sent to it would meet a closed gate). A
  step end never waits on queued requests or ``request_timeout_s``: every call still out is also taken back as the
  aborts go out, so a request queued in an engine (no tokens) ends at once instead of holding vLLM's barrier for
  ``abort_grace_s``; that take-back is not a stage of giving up, so a call it misses keeps the chain above.
* **Stalls are judged by tokens, not by answers.** A server with calls outstanding that answered nothing for
  ``partial.request_timeout_s`` is asked for its progress (``backend.progress``: tokens generated so far by each call
  it holds; one small control call, made only then). If any of its calls generated tokens since the last reading
  (or its launch), it is decoding: its clock restarts and nothing is taken back, so a long answer is never taken
  back for being long. If none did, or the reading is not answered within ``abort_grace_s``, the server is stalled
  and its calls are taken back: a server that stops producing is caught within 2 x ``request_timeout_s`` (+ the
  grace). A backend that cannot tell (``progress`` returns None) is judged by answers alone.
  A call that brings tokens back was slow, not stuck: its tokens are kept and it counts as progress. A call that
  raised, was refused, or brought nothing back counts as a failure -- except the calls of a stalled server that
  bring nothing back behind its oldest call: queued behind it, they never ran, so a stall costs one failure, charged
  to the call that waited longest (``partial/stall_requeued_calls`` counts the others).
* **Retries.** Any result with tokens or a finish resets the sample's failure count; a group is taken out only
  after ``max_retries`` retries of one sample failed in a row. Its other calls are taken back; what they return is
  counted in ``partial/tokens_discarded``.
* **Rewards while generating.** Given a ``GroupScorer`` (verl's reward loop), the groups that finished are scored
  together while generation goes on, as verl's own loop scores each answer as it ends: the hand-over reuses the
  rewards instead of computing them all at the step end, while every engine idles. Scoring still out at the step end
  is awaited, so no reward is computed twice and no judged group is lost.
* **Group filter** (``algorithm.filter_groups``, :mod:`verl_partial.core.partial.group_filter`). A finished group
  counts towards the step only once judged by those rewards; a group whose rewards do not vary leaves the pool,
  freeing its slot for a new prompt.
* **No busy loop.** Every turn of the step loop awaits an answer or a timer, or raises.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.group_filter import SampleScore
from verl_partial.core.partial.pool import GroupState, RolloutPool, SampleRef, SegmentRequest, SegmentResult
from verl_partial.core.partial.routing import Router

__all__ = [
    "GroupScorer",
    "OutOfPrompts",
    "PromptSource",
    "SegmentBackend",
    "SegmentRequest",
    "SegmentResult",
    "StepResult",
    "run_step",
]

P = TypeVar("P")
logger = logging.getLogger(__name__)
# A dead server fails every call routed to it: the first reasons of a step say why, the metric says how many.
FAILURES_LOGGED_PER_STEP = 20


class SegmentBackend(Protocol[P]):
    """The engine side of a step (implemented by the glue, the GPU simulator and the property-test engine)."""

    @property
    def servers(self) -> Sequence[str]:
        """Addresses of the servers the router may choose from (``SegmentRequest.server``)."""

    def launch(self, wave: list[tuple[GroupState[P], SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        """Start every call of one wave (everything the scheduler starts at one moment); one future per call,
        in order, resolving with its :class:`SegmentResult` or failing. The glue turns a wave into one Ray call per
        AgentLoopWorker that streams results back as segments finish."""

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        """Abort these calls AT THEIR SERVERS, by request id: a call its engine holds answers ABORTED with every
        token generated so far (none while it was queued); a call the server does not hold yet (in transit, parked
        at a gate) is not affected; a call not yet sent by the backend ends ABORTED without tokens."""

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        """Last resort for calls that did not answer a take-back: drop the call. Real engines return nothing to
        a cancelled call (its future resolves ABORTED without tokens, or fails); the call must stop generating."""

    async def abort(self, server: str) -> None:
        """Step end, one server: close its gate, rejecting late arrivals (vLLM's
        ``abort_all_requests(reject_request=True)``; SGLang through ``verl_partial.glue.engines.sglang``); running
        calls return ABORTED with all their tokens so far. Returns once the server's abort returned (its engine is
        paused); may block while requests are queued in its engine (vLLM's admission barrier) until those are taken
        back."""

    async def resume(self, server: str) -> None:
        """Reopen ``server`` after this step's :meth:`abort` of it, never before that abort returned: if it has not,
        chain the resume on its completion so that it goes out even after this step's event loop ended. Returns once
        the resume returned."""

    def reopening(self) -> dict[str, Awaitable[None]]:
        """Servers whose last resume has not returned yet (chained on an abort that outlived its step end), each with
        an awaitable that completes once it has; called at a step's start, in its event loop. The scheduler never
        cancels these awaitables."""

    async def progress(self, server: str) -> Mapping[str, int] | None:
        """Tokens generated so far by each call ``server`` holds (queued or running), by request id; calls it does not
        hold are left out. Read only when the server answered nothing for ``request_timeout_s`` (a stall check), never
        per token. None: this server cannot tell, and its stalls are judged by answers alone. May hang with a hung
        server: the scheduler stops waiting after ``abort_grace_s``."""


class GroupScorer(Protocol[P]):
    async def score(self, groups: list[GroupState[P]]) -> list[list[SampleScore]]:
        """Each finished group's reward, one per sample, in order (the glue: verl's reward loop on the workers)."""


class PromptSource(Protocol[P]):
    def next_prompt(self) -> tuple[P, str] | None:
        """The next prompt and its unique key, or None when the source is exhausted."""


class OutOfPrompts(RuntimeError):
    """The step cannot assemble its groups: the source is empty and too few groups are left."""


@dataclass
class StepResult(Generic[P]):
    trained: list[GroupState[P]]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class _Why(Enum):
    """Why the scheduler gave up a call; decides what its answer means."""

    STALLED = "stalled"  # its server made no progress: no tokens back is a failure
    STEP_END = "step_end"  # still out at the step end: never a failure
    ORPHAN = "orphan"  # its group was taken out: its tokens are counted as discarded


class _Stage(Enum):
    """How far giving up a call has gone (module docstring, "Giving up a call")."""

    TAKEN_BACK = "taken_back"  # aborted at its server by request id: its tokens come back with its answer
    # Taken back once more (mid-step: again every grace while its server answers): a call still in transit at the
    # first take-back (its server did not hold it yet) may have reached its engine since; a take-back then returns
    # its tokens, where a cancel would lose them.
    TAKEN_BACK_AGAIN = "taken_back_again"
    CANCELLED = "cancelled"  # could not be taken back (module docstring): dropped, whatever it generated is lost


@dataclass
class _Call:
    group: GroupState
    request: SegmentRequest
    future: asyncio.Future[SegmentResult]
    tokens: int  # routing work: prefix + new tokens
    given_up: _Why | None = None
    stage: _Stage | None = None
    stage_at: float = 0.0  # when the current stage began (its grace runs from here)
    take_back: asyncio.Task[None] | None = None  # the last take-back sent for it: done once its server answered
    generated: int = 0  # tokens its server reported at the last progress reading (0 at launch)
    oldest: bool = False  # the oldest call of a stalled server: a 0-token answer is its failure


class _Step(Generic[P]):
    """The state of one ``run_step``; methods are the rules listed in the module docstring."""

    def __init__(
        self,
        pool: RolloutPool[P],
        backend: SegmentBackend[P],
        source: PromptSource[P],
        servers: list[str],
        scorer: GroupScorer[P] | None = None,
    ) -> None:
        self.pool, self.backend, self.source = pool, backend, source
        if pool.group_filter is not None and scorer is None:
            raise ValueError("a pool with a group filter needs a GroupScorer for run_step(scorer=...)")
        self.scorer = scorer
        # Scoring calls out (group filter), with the groups each scores; done ones are judged by ``wait``.
        self.scoring: dict[asyncio.Task[list[list[SampleScore]]], list[GroupState[P]]] = {}
        self.config = pool.config
        self.loop = asyncio.get_running_loop()
        self.router = Router(servers, pool.launch_cap())
        self.calls: dict[asyncio.Future[SegmentResult], _Call] = {}
        # Answers queue up through one done-callback per call, so a wake-up costs O(answers), not O(outstanding
        # calls) as asyncio.wait over every call would (thousands of wake-ups a step at 512 x 16; the step's driver
        # cost, measured: docs/evidence.md#scheduler-driver-cpu).
        self.answers: deque[asyncio.Future[SegmentResult]] = deque()
        self.answer_arrived = asyncio.Event()
        # Calls not given up, per server: a server's stall clock runs while it has any.
        self.active: Counter[str] = Counter()
        self.given_up: dict[asyncio.Future[SegmentResult], _Call] = {}
        # Rescans of the pool happen only after events that can change their outcome.
        self.launch_needed = True  # a sample may have become runnable (admission, retry, next chunk, free slot)
        self.capped = False  # the last launch stopped at max_calls_per_server
        self.maybe_done = True  # a group may have finished
        # Per server: when it last answered, or went from idle to busy (a stall clock runs only while busy).
        self.progress: dict[str, float] = dict.fromkeys(self.router.servers, self.loop.time())
        # Take-backs, cancels and the step-end abort run in the background: a hung server must not hang the loop.
        self.controls: set[asyncio.Task[None]] = set()
        self.source_empty = False
        # Set once the step-end aborts went out: from then on an empty ABORTED answer is the abort's, not a failure.
        self.aborted = False
        self.aborts: dict[str, asyncio.Task[None]] = {}  # per server: this step's abort
        # Per server: a progress reading in flight (stall check) and when it was sent.
        self.readings: dict[str, tuple[asyncio.Task[Mapping[str, int] | None], float]] = {}
        self.failures_logged = 0

    # ------------------------------------------------------------ launching
    def fill(self) -> None:
        while not self.source_empty and self.pool.free_slots() > 0:
            item = self.source.next_prompt()
            if item is None:
                self.source_empty = True
            else:
                self.pool.admit(*item)
                self.launch_needed = True

    def launch(self) -> None:
        if not self.launch_needed:
            return
        self.launch_needed = False
        # The cap follows the expected context as samples finish (``partial.kv_tokens_per_server``).
        self.router.max_calls_per_server = self.pool.launch_cap()
        wave: list[tuple[GroupState[P], SegmentRequest, int]] = []
        # Lazily: once every server is at max_calls_per_server the rest is never produced (one answer frees one slot,
        # so a launch usually takes one sample).
        for ref in self.pool.iter_runnable():
            sample = self.pool.sample(ref)
            tokens = len(sample.token_ids) + self.pool.config.max_new_tokens(
                len(sample.token_ids), sample.tokens_this_step, self.pool.response_length
            )
            server = self.router.pick(tokens, sample.last_server)
            if server is None:
                self.capped = True  # every server is at max_calls_per_server; the rest wait for a free slot
                break
            if self.router.load[server].calls == 0:
                self.progress[server] = self.loop.time()
            self.router.add(server, tokens)
            wave.append((self.pool.groups[ref.group_id], self.pool.start(ref, server), tokens))
        if not wave:
            return
        futures = self.backend.launch([(group, request) for group, request, _ in wave])
        if len(futures) != len(wave):
            raise RuntimeError(f"backend.launch returned {len(futures)} futures for a wave of {len(wave)} calls")
        for (group, request, tokens), future in zip(wave, futures, strict=True):
            self.calls[future] = _Call(group, request, future, tokens)
            self.active[request.server] += 1
            future.add_done_callback(self.answer)

    def score(self) -> None:
        """Send every finished group not judged yet and not being scored to the scorer, in one call."""
        if self.scorer is None:
            return
        scoring = {group.group_id for groups in self.scoring.values() for group in groups}
        groups = [group for group in self.pool.awaiting_scores() if group.group_id not in scoring]
        if not groups:
            return
        task = self.loop.create_task(self.scorer.score(groups))  # type: ignore[arg-type]
        task.add_done_callback(lambda _: self.answer_arrived.set())
        self.scoring[task] = groups

    def judge_scored(self) -> None:
        """Judge the groups of every scoring call that returned; a scoring error ends the step."""
        for task in [task for task in self.scoring if task.done()]:
            groups = self.scoring.pop(task)
            scores = task.result()
            if len(scores) != len(groups):
                raise RuntimeError(f"the scorer returned {len(scores)} results for {len(groups)} groups")
            for group, group_scores in zip(groups, scores, strict=True):
                self.pool.record_scores(group.group_id, group_scores)
            # Passed groups may end the step; filtered ones free slots for new prompts.
            self.maybe_done = self.launch_needed = True

    def answer(self, future: asyncio.Future[SegmentResult]) -> None:
        self.answers.append(future)
        self.answer_arrived.set()

    def forget(self, call: _Call) -> None:
        """Take a call out of the books (answered or abandoned); a freed server slot may let a waiting sample go."""
        del self.calls[call.future]
        if call.given_up is None:
            self.active[call.request.server] -= 1
        else:
            del self.given_up[call.future]
        self.router.remove(call.request.server, call.tokens)
        if self.capped:
            self.capped, self.launch_needed = False, True

    # ------------------------------------------------------------ answers
    def record(self, future: asyncio.Future[SegmentResult]) -> None:
        call = self.calls[future]
        self.forget(call)
        server, ref = call.request.server, call.request.ref
        if call.given_up is _Why.ORPHAN:  # its group is gone: whatever it generated is thrown away, and counted
            self.discard_late(future)
            return
        ending = self.aborted or call.given_up is _Why.STEP_END
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None:
            if ending:
                self.release(ref)
            else:
                self.fail(call, "cancelled" if error is None else f"{type(error).__name__}: {error}")
            return
        result = future.result()
        self.pool.check_server_version(result)
        self.progress[server] = self.loop.time()
        # A 0-token answer is progress only when it ends the call as asked (a multi-turn tool segment carries its
        # new trajectory). A 0-token "stop"/"length" without one is a server that cannot extend the sample (e.g.
        # SGLang at its context cap): counting it as progress would relaunch the sample forever.
        if len(result.new_ids) or (result.finish is not Finish.ABORTED and result.payload is not None):
            # Tokens or a finish: progress, even from a call given up as stalled (slow is not stuck).
            self.router.answered(server)
            self.pool.finish_segment(ref, result)
            group = self.pool.groups.get(ref.group_id)  # None: taken out while the call ran
            if group is None:
                return
            if group.samples[ref.index].finished:
                self.maybe_done = self.maybe_done or group.finished
            else:
                self.launch_needed = True  # its next chunk
        elif ending and result.finish is Finish.ABORTED:
            self.release(ref)
        elif call.given_up is _Why.STALLED and result.finish is Finish.ABORTED and not call.oldest:
            # Queued behind the stalled server's oldest call: it never ran, so it is no failure of its sample.
            self.pool.count(stall_requeued_calls=1)
            self.release(ref)
        else:
            # Refused by a closed gate, given up after a stall with nothing to show, or a server that returns
            # nothing while saying it finished: a failure.
            self.router.avoid(server)
            self.fail(call, f"answered {result.finish.value} with no tokens")

    def discard_late(self, future: asyncio.Future[SegmentResult]) -> None:
        if not future.cancelled() and future.exception() is None:
            thrown = len(future.result().new_ids)
            self.pool.count(tokens_generated=thrown, tokens_discarded=thrown)

    def release(self, ref: SampleRef) -> None:
        self.pool.release(ref)
        self.launch_needed = True

    def fail(self, call: _Call, why: str) -> None:
        """A failed call is logged with its reason: ``partial/failed_calls`` says how many, the log says why."""
        ref = call.request.ref
        self.failures_logged += 1
        if self.failures_logged <= FAILURES_LOGGED_PER_STEP:
            logger.warning("step %d: call %s on %s failed: %s", self.pool.step, call.request.request_id,
                           call.request.server, why)  # fmt: skip
        if self.failures_logged == FAILURES_LOGGED_PER_STEP:
            logger.warning("step %d: further failed calls are not logged; partial/failed_calls counts them",
                           self.pool.step)  # fmt: skip
        self.launch_needed = True  # its retry
        if self.pool.fail_segment(ref):
            # The group is out: nothing of it may keep generating.
            self.give_up([c for c in self.calls.values() if c.request.ref.group_id == ref.group_id], _Why.ORPHAN)

    def give_up(self, calls: list[_Call], why: _Why) -> None:
        """Take calls back at their servers; their tokens come back with their answers."""
        fresh = [call for call in calls if call.given_up is None]
        now = self.loop.time()
        for call in fresh:
            call.given_up, call.stage, call.stage_at = why, _Stage.TAKEN_BACK, now
            self.active[call.request.server] -= 1
            self.given_up[call.future] = call
        if not fresh:
            return
        if why is _Why.STALLED:
            self.pool.count(stalled_calls=len(fresh))
            fresh[0].oldest = True  # ``self.calls`` keeps launch order: the call that waited longest
        self.take_back(fresh)

    def take_back(self, calls: list[_Call]) -> None:
        """One take-back per server: whether it was answered is what tells a call in transit from a hung server."""
        self.pool.count(taken_back_calls=len(calls))
        by_server: dict[str, list[_Call]] = {}
        for call in calls:
            by_server.setdefault(call.request.server, []).append(call)
        for batch in by_server.values():
            task = self.background(self.backend.take_back([call.request for call in batch]))
            for call in batch:
                call.take_back = task

    def reachable(self, call: _Call) -> bool:
        """Mid-step, a call whose server answered its last take-back: not held by its engine yet (in transit), it
        will be once it arrives through the open gate, and a take-back then returns its tokens."""
        task = call.take_back
        return not self.aborted and task is not None and task.done() and not task.cancelled() and not task.exception()

    def background(self, control: Awaitable[None]) -> asyncio.Task[None]:
        task = self.loop.create_task(control)  # type: ignore[arg-type]
        self.controls.add(task)
        task.add_done_callback(self.controls.discard)
        task.add_done_callback(_consume)
        return task

    # ------------------------------------------------------------ timers
    def next_deadline(self) -> float | None:
        """The earliest moment a rule fires: a busy server's stall check, the end of the grace of a progress reading or
        of a given-up call."""
        grace = self.config.abort_grace_s
        timeout = self.config.request_timeout_s
        deadlines = [self.progress[server] + timeout for server in self.busy() if server not in self.readings]
        # An answered reading is due now (its wake-up may have come before the loop waited again).
        deadlines += [self.loop.time() if task.done() else sent + grace for task, sent in self.readings.values()]
        deadlines += [call.stage_at + grace for call in self.given_up.values()]
        return min(deadlines, default=None)

    def busy(self) -> list[str]:
        return [server for server, calls in self.active.items() if calls > 0]

    def fire_timers(self, now: float) -> None:
        self.check_progress(now)
        for server in self.busy():
            if server not in self.readings and now >= self.progress[server] + self.config.request_timeout_s:
                self.read_progress(server, now)
        unanswered = [c for c in self.given_up.values() if now >= c.stage_at + self.config.abort_grace_s]
        again: list[_Call] = []
        cancel: list[_Call] = []
        for call in unanswered:
            if call.stage is _Stage.TAKEN_BACK or (call.stage is _Stage.TAKEN_BACK_AGAIN and self.reachable(call)):
                again.append(call)
            elif call.stage is _Stage.TAKEN_BACK_AGAIN:
                cancel.append(call)
        for calls, stage in ((again, _Stage.TAKEN_BACK_AGAIN), (cancel, _Stage.CANCELLED)):
            for call in calls:
                call.stage, call.stage_at = stage, now
        if again:
            self.take_back(again)
        if cancel:
            bound = sum(call.request.max_new_tokens for call in cancel)
            self.pool.count(cancelled_calls=len(cancel), cancelled_tokens_max=bound)
            self.background(self.backend.cancel([call.request for call in cancel]))
        for call in unanswered:
            if call.stage is _Stage.CANCELLED and call.stage_at < now:
                self.abandon(call)

    def read_progress(self, server: str, now: float) -> None:
        """A stall check: ask the server how far its calls got (module docstring, "Stalls")."""
        self.pool.count(progress_reads=1)
        task = self.background(self.backend.progress(server))
        task.add_done_callback(lambda _: self.answer_arrived.set())  # wakes the loop to judge it
        self.readings[server] = (task, now)

    def check_progress(self, now: float) -> None:
        """Judge every progress reading that was answered or whose grace ran out."""
        for server, (task, sent) in list(self.readings.items()):
            if not task.done() and now < sent + self.config.abort_grace_s:
                continue
            del self.readings[server]
            calls = [c for c in self.calls.values() if c.request.server == server and c.given_up is None]
            if not calls:
                continue  # its calls answered or were given up meanwhile
            if task.done() and not task.cancelled() and task.exception() is None:
                held = task.result()
                if held is None:  # the server cannot tell: no answer for request_timeout_s is a stall
                    self.stalled(server, now)
                    continue
                grew = [c for c in calls if held.get(c.request.request_id, 0) > c.generated]
                for call in grew:
                    call.generated = held[call.request.request_id]
                if grew:  # decoding: slow is not stuck
                    self.progress[server] = max(self.progress[server], sent)
                    continue
            self.stalled(server, now)  # no token since the last reading, or no answer within the grace

    def stalled(self, server: str, now: float) -> None:
        self.router.avoid(server)
        self.progress[server] = now
        self.give_up([c for c in self.calls.values() if c.request.server == server], _Why.STALLED)

    def abandon(self, call: _Call) -> None:
        """A given-up call whose server did not even answer the cancel: forget it (its late answer is ignored)."""
        self.forget(call)
        _consume(call.future)
        self.pool.count(abandoned_calls=1)
        if call.given_up is _Why.STALLED:
            self.fail(call, "stalled, and its server answered neither the take-back nor the cancel")
        elif call.given_up is _Why.STEP_END:
            self.release(call.request.ref)

    async def wait(self, timeout: float | None) -> float:
        """Record every answer that arrives before ``timeout`` (relative) or the next rule deadline."""
        deadline = self.next_deadline()
        if timeout is not None:
            end = self.loop.time() + timeout
            deadline = end if deadline is None else min(deadline, end)
        wait_for = None if deadline is None else max(0.0, deadline - self.loop.time())
        timed_out = False
        if not self.answers and not any(task.done() for task in self.scoring):
            self.answer_arrived.clear()
            try:
                await asyncio.wait_for(self.answer_arrived.wait(), wait_for)
            except asyncio.TimeoutError:
                timed_out = True
        while self.answers:
            future = self.answers.popleft()
            if future in self.calls:
                self.record(future)
            else:  # an abandoned call's late answer: its sample moved on, so its tokens are thrown away, and counted
                self.discard_late(future)
        self.judge_scored()
        # Woken by the deadline: it is due, even if the clock reads a rounding step short of it (a deadline one
        # float ulp ahead of the clock would otherwise be re-armed forever with a zero timeout).
        now = self.loop.time()
        if timed_out and deadline is not None:
            now = max(now, deadline)
        self.fire_timers(now)
        return now

    # ------------------------------------------------------------ step end
    async def end(self) -> None:
        """The step-end protocol (module docstring): nothing is left generating, nothing waits on queued requests or
        timeouts; :meth:`reopen` then resumes the servers aborted here. Scoring still out is awaited and judged."""
        await self.end_calls()
        self.score()  # groups that finished in the step end's answers
        while self.scoring:
            await asyncio.wait(list(self.scoring))
            self.judge_scored()

    async def end_calls(self) -> None:
        if not self.calls:
            return
        if not self.config.abort_on_done:
            # A backend that cannot abort: calls end within one chunk; stalls are still detected.
            while self.calls:
                await self.wait(None)
            return
        self.aborted = True
        self.aborts = {server: self.background(self.backend.abort(server)) for server in self.router.servers}
        # Whatever is out is queued in an engine (holding vLLM's abort barrier), running, or in transit. Taking it all
        # back now ends the first at once (no tokens: nothing to wait for), so the barrier falls and the abort ends the
        # second with its tokens. This take-back is no stage of giving up: a call it missed (in transit, refused or
        # parked at the closed gate) goes through the usual chain after the grace.
        self.take_back(list(self.calls.values()))
        now = self.loop.time()
        grace_end = now + self.config.abort_grace_s
        while self.calls and now < grace_end:
            now = await self.wait(grace_end - now)
        # Still out: in transit at the first take-back, or running behind an abort that has not landed yet.
        self.give_up(list(self.calls.values()), _Why.STEP_END)
        while self.calls:
            await self.wait(None)

    async def reopen(self) -> None:
        """Resume every server aborted this step. Each resume lands only once that server's abort returned (the
        backend chains it): an abort still running now (a hung server, or vLLM's barrier held by a request no
        take-back reached) counts as a control timeout and its resume goes out after this step. The others' resumes
        are awaited for at most ``abort_grace_s``; one that does not return in time counts too."""
        late = [server for server, abort in self.aborts.items() if not abort.done()]
        resumes = [self.background(self.backend.resume(server)) for server in self.aborts if server not in late]
        for server in late:
            self.background(self.backend.resume(server))
        unanswered = 0
        if resumes:
            _, pending = await asyncio.wait(resumes, timeout=self.config.abort_grace_s)
            unanswered = len(pending)
        self.pool.count(control_timeouts=len(late) + unanswered)

    def load_metrics(self) -> dict[str, float]:
        tokens = [self.pool.server_tokens.get(server, 0) for server in self.router.servers]
        mean = sum(tokens) / len(tokens)
        return {
            "partial/server_load/tokens_max": float(max(tokens)),
            "partial/server_load/tokens_mean": float(mean),
            "partial/server_load/max_over_mean": max(tokens) / mean if mean else 1.0,
            "partial/server_load/calls_max": float(self.router.peak_calls),
            # Calls per server allowed at the step end (``partial.max_calls_per_server``, lowered by the KV cache).
            "partial/server_load/calls_cap": float(self.router.max_calls_per_server),
            # The servers' compute knee ``max_calls_per_server=auto`` caps at; 0: no knee (an integer set, or no GPU).
            "partial/server_load/calls_knee": float(
                (self.pool.server_call_knee or 0) if self.pool.config.max_calls_per_server == "auto" else 0
            ),
            # The KV cache per server that cap divides (``partial.kv_tokens_per_server``); 0: not capped by the cache.
            "partial/server_load/kv_tokens": float(self.pool.kv_tokens() or 0),
            # Servers sitting this step out: their abort outlived the last step end and they had not reopened yet.
            "partial/server_load/closed": float(len(self.backend.servers) - len(self.router.servers)),
        }


async def _open_servers(backend: SegmentBackend[P], timeout: float) -> list[str]:
    """The servers a step may route to: those whose last resume returned. One whose resume is still chained on an
    abort that outlived the last step end sits this step out (a call reaching it first would meet its closed gate,
    or a vLLM engine paused after it). If every server is still closed, wait for the first to reopen, at most
    ``timeout`` (``request_timeout_s``: a server that makes no progress that long is stalled)."""
    closed = backend.reopening()
    if len(closed) == len(backend.servers):
        waiting = [asyncio.ensure_future(reopened) for reopened in closed.values()]
        await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        closed = backend.reopening()
        if len(closed) == len(backend.servers):
            raise RuntimeError(
                f"no server reopened within partial.request_timeout_s={timeout} s after the last step end: the aborts "
                f"of {sorted(closed)} have not returned (hung servers?)"
            )
    return [server for server in backend.servers if server not in closed]


def _consume(done: asyncio.Future) -> None:
    """Retrieve a finished future's exception so an ignored failure is not reported as never retrieved."""
    if done.done() and not done.cancelled():
        done.exception()
    elif not done.done():
        done.add_done_callback(_consume)


async def run_step(
    pool: RolloutPool[P],
    backend: SegmentBackend[P],
    source: PromptSource[P],
    *,
    step: int,
    version: int,
    server_version: int | None = None,
    scorer: GroupScorer[P] | None = None,
) -> StepResult[P]:
    """Generate until ``pool.batch_groups`` groups are finished; park the rest; hand those groups over.

    ``server_version``: the ``global_steps`` every server must report (None: not checked). ``scorer``: the rewards of
    finished groups while the step generates, needed by a pool with a group filter (only passing groups count).
    Times come from the running event loop's clock, so a virtual-time loop drives the same code in tests.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    pool.begin_step(step, version, server_version)
    state = _Step(pool, backend, source, await _open_servers(backend, pool.config.request_timeout_s), scorer)
    try:
        while True:
            state.fill()
            state.score()
            if state.maybe_done:
                state.maybe_done = False
                if pool.step_done():
                    break
            state.launch()
            if not state.calls and not state.scoring:
                if pool.needs_budget_round(can_admit=not state.source_empty):
                    pool.grant_budget_round()
                    if not pool.has_runnable():
                        # A grant that makes nothing runnable would loop here forever without awaiting anything.
                        raise RuntimeError(
                            f"step {step}: unfinished samples have no token budget left even after a budget round "
                            "(a sample at response_length that is not finished); refusing to spin"
                        )
                    state.launch_needed = True
                    continue
                raise OutOfPrompts(
                    f"step {step} needs {pool.batch_groups} finished groups but only {len(pool.ready_groups())} "
                    f"can be assembled: the prompt source is exhausted and {len(pool.groups)} groups remain "
                    "(groups dropped or failed near the end of training exceed partial.extra_groups)"
                )
            await state.wait(None)
        ended = loop.time()
        await state.end()
    finally:
        for task in state.scoring:  # an error: scoring still out is dropped, its groups stay unjudged
            task.cancel()
            _consume(task)
        # On an error, too: no call may outlive the step (cancelled at its server, then forgotten).
        if state.calls:
            state.give_up(list(state.calls.values()), _Why.STEP_END)
            for call in list(state.calls.values()):
                state.abandon(call)
        if state.controls:  # the aborts, and take-backs or cancels still on their way
            await asyncio.wait(list(state.controls), timeout=pool.config.abort_grace_s)
        await state.reopen()
    trained = pool.take_ready()
    metrics = pool.step_metrics(trained) | state.load_metrics()
    metrics["partial/step_end_s"] = loop.time() - ended
    return StepResult(trained=trained, metrics=metrics, seconds=loop.time() - started)
