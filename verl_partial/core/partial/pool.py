"""The pool of in-flight GRPO groups behind partial rollout, and the rules that schedule it.

A synchronous GRPO step waits for its longest sample. The pool keeps ``batch_groups + extra_groups``
groups in flight; a step ends as soon as ``batch_groups`` whole groups are finished, and the samples
still generating are parked here -- exact token ids, per-token behaviour log-probs and the policy
version of every token -- to be continued next step.

Everything the invariants rest on is decided here, without verl or Ray, so it can be tested over
random schedules in milliseconds:

* a group is handed to training only when all its samples are finished, exactly once, oldest first;
* a sample resumes from its own tokens; its remaining budget is ``response_length`` minus what it
  already generated, so a response never exceeds ``response_length``;
* no token older than ``max_staleness`` versions is trained unless the policy is ``keep``;
* failures are retried a bounded number of times, then the group is taken out and counted;
* the whole state round-trips through ``state_dict`` so a checkpoint loses nothing.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left, bisect_right, insort
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PartialConfig
from verl_partial.core.partial.finish import Finish, finished
from verl_partial.core.partial.group_filter import GroupFilter, SampleScore

P = TypeVar("P")

TOKEN_DTYPE = np.int32
LOG_PROB_DTYPE = np.float32
VERSION_DTYPE = np.int32


# Request ids end with this character and hold it nowhere else, so no id is a prefix of another: SGLang's
# per-request abort matches ids by prefix (``Scheduler.abort_request``: ``req.rid.startswith(recv_req.rid)``), and
# ``key/0/1`` would otherwise also abort ``key/0/10``.
REQUEST_ID_END = "#"
# Bytes counted per Python scalar in a payload (a 64-bit value, as numpy or a checkpoint would store it).
_SCALAR_BYTES = 8


def _empty(dtype: type[np.generic]) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


def payload_nbytes(value: Any) -> int:
    """Data bytes of a multi-turn payload (``Trajectory.state_dict()``): array bytes, UTF-8 text, 8 per scalar;
    what a checkpoint of it stores, without Python's per-object overhead."""
    if value is None:
        return 0
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(payload_nbytes(key) + payload_nbytes(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(item) for item in value)
    return _SCALAR_BYTES


@dataclass
class SampleState:
    """One sample of a group: everything needed to resume it bit-exactly, in compact arrays.

    ``token_ids`` (int32), ``log_probs`` (float32, what engines compute in) and ``versions`` (int32, the policy
    version that generated each token) have one entry per response token; ``partial/parked_bytes`` is their
    real ``nbytes``.
    """

    token_ids: np.ndarray = field(default_factory=lambda: _empty(TOKEN_DTYPE))
    log_probs: np.ndarray = field(default_factory=lambda: _empty(LOG_PROB_DTYPE))
    versions: np.ndarray = field(default_factory=lambda: _empty(VERSION_DTYPE))
    finished: bool = False
    # Why the last segment stopped (EOS/STOP/LENGTH tell the hand-over how the answer ended).
    finish: Finish | None = None
    in_flight: bool = False
    segments: int = 0
    # Calls started for this sample over its life; makes every call's request id unique (a given-up call
    # may still be known to its server when the sample is relaunched).
    calls: int = 0
    # CONSECUTIVE failed calls; any call that brings tokens or a finish resets it.
    failures: int = 0
    tokens_this_step: int = 0
    steps_touched: list[int] = field(default_factory=list)
    # The server of this sample's previous chunk in the current step (within-step stickiness, route changes).
    last_server: str | None = None
    # Opaque state of a multi-turn agent loop (``core.trajectory.Trajectory.state_dict()``), replaced by every
    # segment that reports one and checkpointed with the sample. The arrays above then hold the model's tokens
    # only, so budgets, staleness and lag count model tokens; the loop itself bounds the whole response.
    payload: Any = None

    @property
    def oldest_version(self) -> int | None:
        return int(self.versions.min()) if len(self.versions) else None

    @property
    def nbytes(self) -> int:
        """Bytes of what parking this sample holds: its arrays plus a multi-turn payload's own copies (prompt and
        response arrays, message text), which at production size are most of a parked conversation."""
        return self.token_ids.nbytes + self.log_probs.nbytes + self.versions.nbytes + payload_nbytes(self.payload)

    def discard_tokens(self) -> int:
        thrown = len(self.token_ids)
        self.token_ids, self.log_probs, self.versions = (
            _empty(TOKEN_DTYPE),
            _empty(LOG_PROB_DTYPE),
            _empty(VERSION_DTYPE),
        )
        self.finished = False
        self.finish = None
        self.steps_touched = []
        self.payload = None
        return thrown


@dataclass
class GroupState(Generic[P]):
    """A prompt and its ``group_size`` samples; ``prompt`` is the trainer's opaque row."""

    group_id: int
    key: str
    prompt: P
    samples: list[SampleState]
    prompt_ids: np.ndarray | None = None
    # The step in which the group was admitted (``partial/group_wait_steps``).
    admitted_step: int = 0
    # Each sample's reward, computed while the step generates (a scorer given to ``run_step``); with a group filter
    # (``algorithm.filter_groups``) only once the group was judged and passed (one that fails leaves the pool). The
    # hand-over reuses it. Cleared when a sample restarts.
    scores: list[SampleScore] | None = None

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)


@dataclass(frozen=True)
class SampleRef:
    group_id: int
    index: int


@dataclass(frozen=True)
class SegmentRequest:
    """One generate call the scheduler asks for.

    The prefix (``pool.groups[ref.group_id].samples[ref.index].token_ids``, ``prefix_len`` tokens) is read by the
    backend from the pool, never copied here. ``server`` is the address the router chose; ``request_id`` is unique
    per call.
    """

    ref: SampleRef
    request_id: str
    prefix_len: int
    max_new_tokens: int
    server: str


@dataclass(frozen=True)
class SegmentResult:
    """What one generate call produced: new tokens only, never the prefix it was given, never a verl row.

    ``server`` is the server that answered; ``server_version`` its own ``global_steps`` (the policy version of
    its weights), checked against the version the pool expects; ``prompt_ids`` the tokenised prompt, which the
    first segment of a group reports (later ones may repeat it; it must not change).
    """

    new_ids: np.ndarray
    new_log_probs: np.ndarray
    finish: Finish
    server: str
    server_version: int | None = None
    prompt_ids: np.ndarray | None = None
    # A multi-turn loop's new sample state (see ``SampleState.payload``); ``None`` keeps the previous one.
    payload: Any = None


@dataclass
class Counters:
    """Counts behind the ``partial/*`` metrics; the pool keeps one per step and one for the run (checkpointed)."""

    admitted_groups: int = 0
    trained_groups: int = 0
    tokens_generated: int = 0
    tokens_discarded: int = 0
    restarted_samples: int = 0
    dropped_groups: int = 0
    failed_groups: int = 0
    failed_calls: int = 0
    stalled_calls: int = 0
    # Calls of a stalled server that came back without tokens behind its oldest call: never ran, no failure.
    stall_requeued_calls: int = 0
    progress_reads: int = 0  # stall checks: one control call to a server that answered nothing for request_timeout_s
    taken_back_calls: int = 0
    cancelled_calls: int = 0
    # A cancelled call returns nothing, so the tokens it generated are unknown: at most its max_new_tokens each.
    cancelled_tokens_max: int = 0
    abandoned_calls: int = 0
    control_timeouts: int = 0
    budget_rounds: int = 0
    route_changes: int = 0
    judged_groups: int = 0  # finished groups whose rewards the group filter read
    filtered_groups: int = 0  # judged groups whose rewards did not vary: taken out, never trained
    filtered_tokens: int = 0
    # Samples that finished and their contexts (prompt + response tokens): the expected context of a sample, which
    # ``partial.kv_tokens_per_server`` turns into a per-server call cap (``RolloutPool.launch_cap``).
    finished_samples: int = 0
    finished_context_tokens: int = 0


def check_carry_fits(config: PartialConfig, batch_groups: int) -> None:
    """``wait`` throws nothing away only if the groups a step carries over (up to ``extra_groups``, all holding
    tokens of this step's version) can be trained within ``max_staleness`` steps."""
    if config.staleness_policy == "wait" and config.extra_groups > config.max_staleness * batch_groups:
        raise ValueError(
            f"partial.extra_groups must be <= partial.max_staleness x data.train_batch_size "
            f"({config.max_staleness} x {batch_groups}) with partial.staleness_policy=wait, got "
            f"{config.extra_groups}: the groups a step carries over must be trainable within the staleness bound"
        )


class RolloutPool(Generic[P]):
    """In-flight groups with their parked samples; the scheduling state machine of partial rollout."""

    def __init__(
        self,
        config: PartialConfig,
        *,
        group_size: int,
        batch_groups: int,
        response_length: int,
        priority: Callable[[GroupState[P], SampleState], float] | None = None,
        group_filter: GroupFilter | None = None,
        engine_slots: int | None = None,
        server_kv_tokens: int | None = None,
        server_call_knee: int | None = None,
    ) -> None:
        if group_size < 1 or batch_groups < 1 or response_length < 1:
            raise ValueError(
                f"group_size ({group_size}), batch_groups ({batch_groups}) and response_length "
                f"({response_length}) must all be >= 1"
            )
        self.config = config
        self.group_size = group_size
        self.batch_groups = batch_groups
        self.response_length = response_length
        if config.schedule == "longest_first" and priority is None:
            raise ValueError(
                "partial.schedule=longest_first needs a launch priority: "
                "RolloutPool(..., priority=verl_partial.core.partial.on_policy.LengthEstimator(...).priority)"
            )
        check_carry_fits(config, batch_groups)
        # Samples every engine together can run at once (``partial.fill_engine``); the glue sets it once the servers
        # exist (they start after the trainer that builds the pool).
        self.engine_slots = engine_slots
        # KV-cache tokens of the smallest server, as its engine reports it (``partial.kv_tokens_per_server=auto``;
        # None: no engine says); the glue sets it once the servers exist, like ``engine_slots``.
        self.server_kv_tokens = server_kv_tokens
        # Compute knee of the servers' GPUs, in running requests (``partial.max_calls_per_server=auto``; None: no
        # server runs on a GPU); the glue sets it from the GPU names the engines report, like ``server_kv_tokens``.
        self.server_call_knee = server_call_knee
        # Launch order (``partial.schedule``): a sort key, ascending, under ``longest_first``; oldest group first under
        # ``fifo`` (an estimator may exist for ``length_window_steps`` alone, its priority is then not for launches).
        self.priority = priority if config.schedule == "longest_first" else None
        self.groups: dict[int, GroupState[P]] = {}
        # Ids of finished groups, kept in step with ``groups`` so that admission (``free_slots``, on every wake of
        # the scheduler) and ``step_done`` do not rescan every sample: at 512 x 16 that rescan was a third of the
        # scheduler's driver time.
        self._finished: set[int] = set()
        # Finished groups without rewards yet (``record_scores`` records them). With ``group_filter`` such a group is
        # not ready (not in ``_finished``) until judged and passed; without one it is ready at once, and its rewards
        # are computed early so that the hand-over need not compute them while the engines idle.
        self.group_filter = group_filter
        self._unscored: set[int] = set()
        # The runnable samples (``_is_runnable``), kept in step with every change to a sample, so that a launch costs
        # O(samples it launches) instead of a scan of every sample: with max_calls_per_server binding, every answer
        # frees one slot and launches one sample, and at 512 x 16 that full scan (and sort) per launch was ~95% of
        # the scheduler's driver time (docs/evidence.md#scheduler-driver-cpu). ``_runnable`` maps a group id to the
        # indices of its runnable samples (no empty sets); ``_runnable_ids`` holds the same group ids, ascending.
        # Samples change only through this class's methods: each that can flip ``_is_runnable`` calls ``_index``.
        self._runnable: dict[int, set[int]] = {}
        self._runnable_ids: list[int] = []
        # Unfinished samples of every group held (running, queued or parked): what they will ask of the engines'
        # slots. Kept in step like ``_finished``, since ``free_slots`` reads it on every wake of the scheduler.
        self._open_samples = 0
        self.next_group_id = 0
        self.version = 0
        self.server_version: int | None = None
        self.step = 0
        self.counters = Counters()
        self.totals = Counters()
        self.events: list[tuple[str, str]] = []
        # Per step: response lengths of samples that finished this step, and tokens each server returned.
        self.finished_lengths: list[int] = []
        self.server_tokens: Counter[str] = Counter()

    def count(self, **deltas: int) -> None:
        """Add to this step's counters and the run totals."""
        for counts in (self.counters, self.totals):
            for name, delta in deltas.items():
                setattr(counts, name, getattr(counts, name) + delta)

    # ---------------------------------------------------------------- admission
    @property
    def capacity(self) -> int:
        return self.batch_groups + self.config.extra_groups

    def free_slots(self) -> int:
        """Groups that may be admitted now. With ``partial.refill`` the groups this step will train (the first
        ``batch_groups`` finished ones) no longer hold a slot, so a finished group is replaced mid-step.

        With ``partial.fill_engine``, beyond that, a whole group whenever the engines have a free slot for each of
        its samples, while the pool holds at most ``(1 + max_staleness) x batch_groups`` groups: groups admitted at
        version ``v`` train by version ``v + max_staleness``, oldest first, so at most that many can be admitted
        ahead of training without one of them getting too old (AReaL's capacity formula, in groups). A server that
        queues has no free slot, and admission is the refill's alone."""
        held = len(self.groups)
        if self.config.refill:
            held -= min(self.batch_groups, len(self._finished))
        slots = max(0, self.capacity - held)
        if slots or not self.config.fill_engine:
            return slots
        if self.engine_slots is None or self.engine_slots < 1:
            raise RuntimeError(
                f"partial.fill_engine needs the engines' sample slots (servers x rollout.max_num_seqs), got "
                f"engine_slots={self.engine_slots}: set RolloutPool.engine_slots before the step"
            )
        bound = (1 + self.config.max_staleness) * self.batch_groups - len(self.groups)
        return max(0, min(bound, (self.engine_slots - self._open_samples) // self.group_size))

    def launch_cap(self) -> int:
        """Most calls one server may have outstanding: :meth:`calls_cap`, and no more than the server's
        KV cache (``partial.kv_tokens_per_server``) over the expected context of a sample (the mean over the samples
        finished so far in the run; until one has, the cache is not the limit). A server then holds about as much
        context as its cache, so it does not preempt and recompute the requests it admitted by their length at
        admission; the samples beyond the cap wait in the pool, where waiting costs nothing."""
        cap = self.calls_cap()
        kv_tokens, finished = self.kv_tokens(), self.totals.finished_samples
        if kv_tokens is None or not finished:
            return cap
        expected_context = self.totals.finished_context_tokens / finished
        return max(1, min(cap, int(kv_tokens // expected_context)))

    def calls_cap(self) -> int:
        """``partial.max_calls_per_server``: the integer set, or under ``auto`` the servers' compute knee
        (``server_call_knee``) up to ``CALLS_PER_SERVER_CEILING``, which is also the cap where no server has a GPU."""
        setting = self.config.max_calls_per_server
        if setting != "auto":
            return int(setting)
        knee = self.server_call_knee
        return CALLS_PER_SERVER_CEILING if knee is None else max(1, min(knee, CALLS_PER_SERVER_CEILING))

    def kv_tokens(self) -> int | None:
        """The KV-cache tokens per server the launch cap divides: the configured size, the engines' under ``auto``,
        None under ``off`` or when no engine reported one."""
        setting = self.config.kv_tokens_per_server
        if setting == "off":
            return None
        return self.server_kv_tokens if setting == "auto" else int(setting)

    def open_samples(self) -> int:
        """Unfinished samples held (running, queued or parked)."""
        return self._open_samples

    def admit(self, prompt: P, key: str) -> int:
        if REQUEST_ID_END in key:
            raise ValueError(f"group key {key!r} must not contain {REQUEST_ID_END!r}: request ids end with it")
        if self.free_slots() == 0:
            raise RuntimeError(f"pool is full ({len(self.groups)}/{self.capacity} groups); check free_slots() first")
        group_id = self.next_group_id
        self.next_group_id += 1
        samples = [SampleState() for _ in range(self.group_size)]
        group = GroupState(group_id, key, prompt, samples, admitted_step=self.step)
        self.groups[group_id] = group
        self._open_samples += self.group_size
        for index in range(self.group_size):
            self._index(group, index)
        self.count(admitted_groups=1)
        self.events.append(("admitted", key))
        return group_id

    # ---------------------------------------------------------------- step lifecycle
    def begin_step(self, step: int, version: int, server_version: int | None = None) -> None:
        """Start generation for training step ``step`` with policy weights of version ``version``.

        ``server_version``, when given, is the ``global_steps`` every server must report with its results
        (anything else means the weights were not synced). Staleness is enforced here, before any new token
        exists: a token generated at version v and trained at this step lags ``version - v``; anything beyond
        ``max_staleness`` is restarted or its group dropped, per policy.
        """
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.step, self.version, self.server_version = step, version, server_version
        self.counters = Counters()
        self.finished_lengths = []
        self.server_tokens = Counter()
        for group in list(self.groups.values()):
            for sample in group.samples:
                if sample.in_flight:
                    raise RuntimeError(f"group {group.key} still has a request in flight at step start")
                sample.tokens_this_step = 0
                # The prefix cache does not survive a step end: no stickiness across steps.
                sample.last_server = None
            self._enforce_staleness(group)
        self._sort_finished()
        self._reindex()  # budgets were reset and stale samples restarted: once per step, a full rebuild is cheap

    def _enforce_staleness(self, group: GroupState[P]) -> None:
        """``wait`` lets no unfinished sample reach this point stale; a finished group the last step could not train
        (more were ready than ``batch_groups``) can be, and is restarted like under ``restart`` (counted)."""
        if self.config.staleness_policy == "keep":
            return
        stale = [sample for sample in group.samples if self._lag(sample, self.version) > self.config.max_staleness]
        if not stale:
            return
        if self.config.staleness_policy == "drop":
            self._take_out(group, "dropped")
            return
        for sample in stale:
            self._open_samples += sample.finished
            thrown = sample.discard_tokens()
            self.count(tokens_discarded=thrown, restarted_samples=1)
        group.scores = None  # its samples change: judged again once finished

    @staticmethod
    def _lag(sample: SampleState, version: int) -> int:
        """How many versions the sample's oldest token lags ``version`` (0 for a sample without tokens)."""
        oldest = sample.oldest_version
        return 0 if oldest is None else version - oldest

    def must_train_this_step(self, group: GroupState[P]) -> bool:
        """Under ``wait``: a group holding a token that would exceed ``max_staleness`` at the next step (versions
        advance by one per step) must be finished -- every sample, even one not started -- and trained in this one;
        an unfinished such group holds the step end."""
        return self.config.staleness_policy == "wait" and any(
            self._lag(sample, self.version + 1) > self.config.max_staleness for sample in group.samples
        )

    def _take_out(self, group: GroupState[P], reason: str) -> None:
        thrown = sum(len(sample.token_ids) for sample in group.samples)
        self.count(tokens_discarded=thrown, **{f"{reason}_groups": 1})
        self._open_samples -= sum(not sample.finished for sample in group.samples)
        del self.groups[group.group_id]
        self._finished.discard(group.group_id)
        self._unscored.discard(group.group_id)
        self._unindex(group.group_id)
        self.events.append((reason, group.key))

    def runnable(self) -> list[SampleRef]:
        """Samples that may start a segment now, oldest group first (old groups finish first, lag least), or in
        ``priority`` order when one is set (e.g. longest expected first, :mod:`verl_partial.core.partial.on_policy`).

        All of them; a launcher that may stop early (servers at ``max_calls_per_server``) uses
        :meth:`iter_runnable`, which costs only what it yields."""
        return list(self.iter_runnable())

    def iter_runnable(self) -> Iterator[SampleRef]:
        """:meth:`runnable`'s samples in the same order, produced as they are consumed.

        The caller may ``start`` each yielded sample before asking for the next (the scheduler's launch does);
        a sample that stopped being runnable meanwhile is skipped. Oldest group first, samples by index: each step
        finds the next group from the index of runnable samples, so the thousands of samples in flight (or finished)
        are never visited. Under a ``priority`` the order is a stable sort of that order by ``priority``, which can
        change as siblings finish or history grows, so it is evaluated here, at the start of the iteration -- over
        the runnable samples only."""
        if self.priority is not None:
            priority, groups = self.priority, self.groups
            refs = [
                SampleRef(group_id, index)
                for group_id in self._runnable_ids
                for index in sorted(self._runnable[group_id])
            ]
            refs.sort(key=lambda ref: priority(groups[ref.group_id], groups[ref.group_id].samples[ref.index]))
            for ref in refs:
                if ref.index in self._runnable.get(ref.group_id, ()):
                    yield ref
            return
        last = -1
        while True:
            position = bisect_right(self._runnable_ids, last)
            if position == len(self._runnable_ids):
                return
            last = self._runnable_ids[position]
            for index in sorted(self._runnable[last]):
                if index in self._runnable.get(last, ()):
                    yield SampleRef(last, index)

    def has_runnable(self) -> bool:
        """Whether any sample may start a segment now (O(1))."""
        return bool(self._runnable)

    def _is_runnable(self, sample: SampleState) -> bool:
        return not sample.finished and not sample.in_flight and self._budget(sample) > 0

    def _index(self, group: GroupState[P], index: int) -> None:
        """Re-evaluate one sample for the index of runnable samples; called after every change to a sample that
        can flip ``_is_runnable`` (its finish, in-flight flag, tokens or this step's tokens)."""
        group_id = group.group_id
        indices = self._runnable.get(group_id)
        if self._is_runnable(group.samples[index]):
            if indices is None:
                self._runnable[group_id] = {index}
                insort(self._runnable_ids, group_id)
            else:
                indices.add(index)
        elif indices is not None:
            indices.discard(index)
            if not indices:
                self._unindex(group_id)

    def _unindex(self, group_id: int) -> None:
        """Take a group out of the index of runnable samples (it left the pool, or has none left)."""
        if self._runnable.pop(group_id, None) is not None:
            del self._runnable_ids[bisect_left(self._runnable_ids, group_id)]

    def _reindex(self) -> None:
        """Rebuild the index of runnable samples from every sample: after the changes that touch them all (a step's
        budgets reset, a budget round, a checkpoint loaded)."""
        self._runnable = {}
        for group_id in sorted(self.groups):
            group = self.groups[group_id]
            indices = {index for index, sample in enumerate(group.samples) if self._is_runnable(sample)}
            if indices:
                self._runnable[group_id] = indices
        self._runnable_ids = list(self._runnable)

    def _budget(self, sample: SampleState) -> int:
        return self.config.max_new_tokens(len(sample.token_ids), sample.tokens_this_step, self.response_length)

    def sample(self, ref: SampleRef) -> SampleState:
        return self.groups[ref.group_id].samples[ref.index]

    def start(self, ref: SampleRef, server: str) -> SegmentRequest:
        """Mark a sample in flight on ``server`` and describe its call; counts a route change when the
        sample's previous chunk this step ran elsewhere (the client's own choice, not a server field)."""
        group = self.groups[ref.group_id]
        sample = group.samples[ref.index]
        if sample.finished or sample.in_flight:
            raise RuntimeError(f"sample {group.key}/{ref.index} is not runnable")
        budget = self._budget(sample)
        if budget <= 0:
            raise RuntimeError(f"sample {group.key}/{ref.index} has no token budget left this step")
        sample.in_flight = True
        self._index(group, ref.index)
        if sample.last_server is not None and sample.last_server != server:
            self.count(route_changes=1)
        sample.last_server = server
        request_id = f"{group.key}/{ref.index}/{sample.calls}{REQUEST_ID_END}"
        sample.calls += 1
        return SegmentRequest(ref, request_id, len(sample.token_ids), budget, server)

    def check_server_version(self, result: SegmentResult) -> None:
        """A server answering with other weights than this step's means the weight sync failed: stop. A result
        without tokens (a tool-calls segment of a multi-turn sample, a call cancelled before its server answered)
        generated nothing, so there is nothing to check."""
        if self.server_version is not None and len(result.new_ids) and result.server_version != self.server_version:
            raise RuntimeError(
                f"server {result.server} generated with global_steps={result.server_version} but step {self.step} "
                f"expects global_steps={self.server_version}: its weights were not synced"
            )

    def finish_segment(self, ref: SampleRef, result: SegmentResult) -> None:
        """Record a segment's output; every new token is tagged with the current policy version.

        Any result with tokens or a non-abort finish is progress and resets the sample's consecutive failures.
        """
        self.check_server_version(result)
        group = self.groups.get(ref.group_id)
        if group is None:  # taken out while the call was running: its tokens are thrown away, and counted
            self.count(tokens_generated=len(result.new_ids), tokens_discarded=len(result.new_ids))
            return
        sample = group.samples[ref.index]
        if not sample.in_flight:
            raise RuntimeError(f"sample {group.key}/{ref.index} has no segment in flight")
        new_ids = np.asarray(result.new_ids, dtype=TOKEN_DTYPE)
        new_log_probs = np.asarray(result.new_log_probs, dtype=LOG_PROB_DTYPE)
        if new_ids.ndim != 1 or new_ids.shape != new_log_probs.shape:
            raise ValueError(f"segment returned {new_ids.shape} token ids but {new_log_probs.shape} log-probs")
        if len(new_ids) > self._budget(sample):
            raise ValueError(
                f"segment of {group.key}/{ref.index} returned {len(new_ids)} tokens, over its budget "
                f"of {self._budget(sample)}"
            )
        if result.prompt_ids is not None:
            prompt_ids = np.asarray(result.prompt_ids, dtype=TOKEN_DTYPE)
            if group.prompt_ids is None:
                group.prompt_ids = prompt_ids
            elif not np.array_equal(group.prompt_ids, prompt_ids):
                raise ValueError(f"prompt tokens of group {group.key} changed between segments")
        sample.in_flight = False
        sample.failures = 0
        sample.segments += 1
        sample.token_ids = np.concatenate([sample.token_ids, new_ids])
        sample.log_probs = np.concatenate([sample.log_probs, new_log_probs])
        sample.versions = np.concatenate([sample.versions, np.full(len(new_ids), self.version, VERSION_DTYPE)])
        sample.tokens_this_step += len(new_ids)
        if self.step not in sample.steps_touched:
            sample.steps_touched.append(self.step)
        sample.finished = finished(result.finish, len(sample.token_ids), self.response_length)
        # A sample holding its whole response_length ended on its budget, whatever the server called it.
        sample.finish = result.finish if result.finish is not Finish.ABORTED or not sample.finished else Finish.LENGTH
        if result.payload is not None:
            sample.payload = result.payload
        self._index(group, ref.index)
        if sample.finished:
            self._open_samples -= 1
            self.finished_lengths.append(len(sample.token_ids))
            prompt_tokens = 0 if group.prompt_ids is None else len(group.prompt_ids)
            self.count(finished_samples=1, finished_context_tokens=prompt_tokens + len(sample.token_ids))
            if group.finished:
                self._unscored.add(group.group_id)
                if self.group_filter is None:
                    self._finished.add(group.group_id)
        self.server_tokens[result.server] += len(new_ids)
        self.count(tokens_generated=len(new_ids))

    def release(self, ref: SampleRef) -> None:
        """A call given up without tokens through no fault of the sample (step end): runnable again, no failure."""
        group = self.groups.get(ref.group_id)
        if group is not None:
            group.samples[ref.index].in_flight = False
            self._index(group, ref.index)

    def fail_segment(self, ref: SampleRef) -> bool:
        """Record a call that raised, was refused or stalled without tokens; returns True when the group was
        taken out (``max_retries`` retries of one sample failed in a row)."""
        group = self.groups.get(ref.group_id)
        if group is None:
            return True
        sample = group.samples[ref.index]
        sample.in_flight = False
        sample.failures += 1
        self._index(group, ref.index)
        self.count(failed_calls=1)
        if sample.failures > self.config.max_retries:
            self._take_out(group, "failed")
            return True
        return False

    def _sort_finished(self) -> None:
        """Rebuild the finished sets from the groups (a step start, a checkpoint loaded): under a group filter a
        finished group is ready once judged (``scores``), else it waits to be judged; without one it is ready, and
        awaits early rewards while it has none."""
        finished = [group for group in self.groups.values() if group.finished]
        self._open_samples = sum(not sample.finished for group in self.groups.values() for sample in group.samples)
        judged = self.group_filter is None
        self._finished = {group.group_id for group in finished if judged or group.scores is not None}
        self._unscored = {group.group_id for group in finished if group.scores is None}

    def awaiting_scores(self) -> list[GroupState[P]]:
        """Finished groups whose rewards are not known yet, oldest first: to be judged (with a group filter), or
        ready already and scored early for the hand-over (without one)."""
        return [self.groups[group_id] for group_id in sorted(self._unscored)]

    def record_scores(self, group_id: int, scores: list[SampleScore]) -> bool:
        """A finished group's rewards (one per sample), kept for the hand-over. With a group filter the group is
        judged too: one whose metric does not vary is taken out and counted (``filtered``), one that passes becomes
        ready; this raises once the step judged ``max_num_gen_batches`` batches without enough passing groups.
        Returns whether the group holds its rewards now (False for a group taken out, trained or restarted while they
        were computed, or filtered)."""
        group = self.groups.get(group_id)
        if group is None or group_id not in self._unscored:
            return False
        if len(scores) != len(group.samples):
            raise ValueError(f"{len(scores)} scores for the {len(group.samples)} samples of group {group.key}")
        self._unscored.discard(group_id)
        if self.group_filter is None:
            group.scores = list(scores)
            return True
        self.count(judged_groups=1)
        passed = self.group_filter.passes(group.key, scores)
        if passed:
            group.scores = list(scores)
            self._finished.add(group_id)
        else:
            self.count(filtered_tokens=sum(len(sample.token_ids) for sample in group.samples))
            self._take_out(group, "filtered")
        self.group_filter.check_bound(self.counters.judged_groups, len(self._finished), self.batch_groups)
        return passed

    def ready_groups(self) -> list[GroupState[P]]:
        """Finished groups, those holding the oldest tokens first, then in admission order.

        By tokens, not by admission: a group admitted early whose calls got nowhere (taken back in transit at step
        ends) finishes on fresh tokens, while one admitted after it holds tokens as old as the bound allows. Taken
        in admission order at a step where both were done, the second was left over and restarted at the next step
        start under ``wait`` (found by the property test, seed 501)."""
        finished = [self.groups[group_id] for group_id in sorted(self._finished)]
        return sorted(finished, key=self._oldest_token_version)

    @staticmethod
    def _oldest_token_version(group: GroupState[P]) -> float:
        versions = [version for sample in group.samples if (version := sample.oldest_version) is not None]
        return min(versions, default=math.inf)

    def step_done(self) -> bool:
        """``batch_groups`` finished groups, and (``wait``) no unfinished group that must be trained this step, nor
        more groups left over than the next step can train before their tokens get too old.

        The look-ahead matters with extra groups: groups admitted later can finish first and fill a step, while the
        older ones keep generating; if more old groups then come due at once than one step trains, one of them would
        exceed ``max_staleness`` (found by the property test, seed 7961). Waiting lets the old ones finish, and holding
        older tokens they are taken first."""
        if len(self._finished) < self.batch_groups:
            return False
        if self.config.staleness_policy != "wait":
            return True
        # Not ready: unfinished, or (group filter) finished and not judged yet.
        if any(
            group.group_id not in self._finished and self.must_train_this_step(group) for group in self.groups.values()
        ):
            return False
        if len(self.groups) <= 2 * self.batch_groups:
            return True  # at most a batch is left after this step's: the next step trains it (the default's case)
        taken = {group.group_id for group in self.ready_groups()[: self.batch_groups]}
        due_next = sum(
            1
            for group in self.groups.values()
            if group.group_id not in taken
            and any(self._lag(sample, self.version + 2) > self.config.max_staleness for sample in group.samples)
        )
        return due_next <= self.batch_groups

    def in_flight(self) -> int:
        return sum(sample.in_flight for group in self.groups.values() for sample in group.samples)

    def needs_budget_round(self, can_admit: bool) -> bool:
        """Every unfinished sample used its per-step budget, yet the step lacks groups: grant another round.

        Only a ``step_token_budget`` can cause this, once no new prompt can be admitted either.
        Training needs exactly ``batch_groups`` groups per step, so the budget caps one round, and
        the rounds a step needed are reported as ``partial/budget_rounds``.
        """
        return (
            not self.step_done()
            and self.in_flight() == 0
            and not (can_admit and self.free_slots() > 0)
            and not self.has_runnable()
            and any(not group.finished for group in self.groups.values())
        )

    def grant_budget_round(self) -> None:
        for group in self.groups.values():
            for sample in group.samples:
                sample.tokens_this_step = 0
        self._reindex()
        self.count(budget_rounds=1)

    def take_ready(self) -> list[GroupState[P]]:
        """Hand ``batch_groups`` finished groups to training (:meth:`ready_groups`' order), and forget them."""
        if self.in_flight():
            raise RuntimeError("take_ready() with requests in flight: abort or await them first")
        ready = self.ready_groups()
        if len(ready) < self.batch_groups:
            raise RuntimeError(f"only {len(ready)} of {self.batch_groups} groups are finished")
        taken = ready[: self.batch_groups]
        for group in taken:  # finished: none of its samples is in the index of runnable samples
            del self.groups[group.group_id]
            self._finished.discard(group.group_id)
            self._unscored.discard(group.group_id)
            self.events.append(("trained", group.key))
        self.count(trained_groups=len(taken))
        return taken

    # ---------------------------------------------------------------- metrics
    def parked_bytes(self) -> int:
        """Real bytes of the token state the pool holds (sample arrays and tokenised prompts)."""
        samples = sum(sample.nbytes for group in self.groups.values() for sample in group.samples)
        prompts = sum(group.prompt_ids.nbytes for group in self.groups.values() if group.prompt_ids is not None)
        return samples + prompts

    def step_metrics(self, trained: list[GroupState[P]]) -> dict[str, float]:
        """``partial/*`` metrics for the step that just trained ``trained`` (see docs/method/partial-rollout.md)."""
        samples = [sample for group in trained for sample in group.samples]
        lags: Counter[int] = Counter()
        for sample in samples:
            values, counts = np.unique(self.version - sample.versions.astype(np.int64), return_counts=True)
            lags.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))
        trained_tokens = sum(lags.values())
        # Parked = resumable work: unfinished samples holding tokens (not yet-unstarted ones).
        parked = [s for group in self.groups.values() for s in group.samples if not s.finished and len(s.token_ids)]
        parked_tokens = sum(len(sample.token_ids) for group in self.groups.values() for sample in group.samples)
        segments = [sample.segments for sample in samples] or [0]
        metrics: dict[str, float] = {
            "partial/in_flight_groups": float(len(self.groups)),
            "partial/parked_samples": float(len(parked)),
            "partial/parked_tokens": float(parked_tokens),
            "partial/parked_bytes": float(self.parked_bytes()),
            "partial/resumed_fraction": sum(len(s.steps_touched) > 1 for s in samples) / max(1, len(samples)),
            "partial/segments_per_sample/mean": sum(segments) / len(segments),
            "partial/segments_per_sample/max": float(max(segments)),
            "partial/staleness/mean": sum(lag * count for lag, count in lags.items()) / max(1, trained_tokens),
            "partial/staleness/max": float(max(lags, default=0)),
            "partial/restarted_samples": float(self.counters.restarted_samples),
            "partial/dropped_groups": float(self.counters.dropped_groups),
            "partial/failed_groups": float(self.counters.failed_groups),
            "partial/failed_calls": float(self.counters.failed_calls),
            "partial/stalled_calls": float(self.counters.stalled_calls),
            "partial/taken_back_calls": float(self.counters.taken_back_calls),
            "partial/stall_requeued_calls": float(self.counters.stall_requeued_calls),
            "partial/progress_reads": float(self.counters.progress_reads),
            "partial/cancelled_calls": float(self.counters.cancelled_calls),
            "partial/cancelled_tokens_max": float(self.counters.cancelled_tokens_max),
            "partial/abandoned_calls": float(self.counters.abandoned_calls),
            "partial/control_timeouts": float(self.counters.control_timeouts),
            "partial/budget_rounds": float(self.counters.budget_rounds),
            "partial/route_changes": float(self.counters.route_changes),
            "partial/tokens_generated": float(self.counters.tokens_generated),
            "partial/tokens_trained": float(trained_tokens),
            "partial/tokens_discarded": float(self.counters.tokens_discarded),
            "partial/total/admitted_groups": float(self.totals.admitted_groups),
            "partial/total/trained_groups": float(self.totals.trained_groups),
            "partial/total/dropped_groups": float(self.totals.dropped_groups),
            "partial/total/failed_groups": float(self.totals.failed_groups),
        }
        if self.group_filter is not None:
            metrics["partial/filtered_groups"] = float(self.counters.filtered_groups)
            metrics["partial/filtered_tokens"] = float(self.counters.filtered_tokens)
            metrics["partial/judged_groups"] = float(self.counters.judged_groups)
            metrics["partial/total/filtered_groups"] = float(self.totals.filtered_groups)
        for lag, count in sorted(lags.items()):
            metrics[f"partial/staleness/lag_{lag}_fraction"] = count / trained_tokens
        metrics.update(
            length_bias_metrics(
                [len(sample.token_ids) for sample in samples],
                self.finished_lengths,
                [self.step - group.admitted_step for group in trained],
            )
        )
        return metrics

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        if self.in_flight():
            raise RuntimeError("cannot checkpoint the pool with requests in flight")
        return {
            "groups": [
                _shallow_fields(group) | {"samples": [_shallow_fields(s) for s in group.samples]}
                for group in self.groups.values()
            ],
            "next_group_id": self.next_group_id,
            "version": self.version,
            "step": self.step,
            "totals": _shallow_fields(self.totals),
            "shape": {
                "group_size": self.group_size,
                "batch_groups": self.batch_groups,
                "response_length": self.response_length,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shape = {
            "group_size": self.group_size,
            "batch_groups": self.batch_groups,
            "response_length": self.response_length,
        }
        if state["shape"] != shape:
            raise ValueError(
                f"checkpointed partial-rollout pool has shape {state['shape']} but this run has {shape}; "
                "resume with the same data.train_batch_size, rollout.n and response_length"
            )
        self.groups = {}
        for raw in state["groups"]:
            samples = [SampleState(**sample) for sample in raw["samples"]]
            group = GroupState(**{**raw, "samples": samples})
            self.groups[group.group_id] = group
        self._sort_finished()
        self.next_group_id = state["next_group_id"]
        self.version = state["version"]
        self.step = state["step"]
        self.totals = Counters(**state["totals"])
        self._reindex()


def length_bias_metrics(
    trained_lengths: list[int], finished_lengths: list[int], wait_steps: list[int]
) -> dict[str, float]:
    """Does partial rollout bias training towards short answers? Compare the response lengths trained this step
    with those of every sample that finished this step (trained now or waiting in an unfinished group), and
    report how many steps each trained group waited since admission. A ``trained_mean`` persistently below
    ``finished_mean`` means long answers are being held back; ``group_wait_steps`` shows for how long."""
    metrics: dict[str, float] = {}
    for name, lengths in (("trained", trained_lengths), ("finished", finished_lengths)):
        if not lengths:
            continue
        values = np.asarray(lengths, dtype=np.float64)
        metrics[f"partial/length/{name}_mean"] = float(values.mean())
        metrics[f"partial/length/{name}_p50"] = float(np.percentile(values, 50))
        metrics[f"partial/length/{name}_p90"] = float(np.percentile(values, 90))
        metrics[f"partial/length/{name}_max"] = float(values.max())
    if wait_steps:
        metrics["partial/group_wait_steps/mean"] = sum(wait_steps) / len(wait_steps)
        metrics["partial/group_wait_steps/max"] = float(max(wait_steps))
    return metrics


def _shallow_fields(obj: Any) -> dict[str, Any]:
    """Field values by name, without ``dataclasses.asdict``'s recursion (it would turn payloads into dicts)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
