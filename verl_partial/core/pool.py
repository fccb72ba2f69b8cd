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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from verl_partial.core.partial_config import PartialConfig

P = TypeVar("P")

# Bytes one parked token costs when serialised: int32 id, float32 log-prob, int32 version.
BYTES_PER_PARKED_TOKEN = 12


@dataclass
class SampleState:
    """One sample of a group: everything needed to resume it bit-exactly."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    in_flight: bool = False
    segments: int = 0
    failures: int = 0
    tokens_this_step: int = 0
    steps_touched: list[int] = field(default_factory=list)
    # Which server answered the last segment, when the backend says (sticky routing check).
    last_route: str | None = None
    # The trainer's finished row for this sample (opaque here; verl's padded output row in the glue).
    output: Any = None

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    def discard_tokens(self) -> int:
        thrown = len(self.token_ids)
        self.token_ids, self.log_probs, self.versions = [], [], []
        self.finished = False
        self.steps_touched = []
        self.output = None
        return thrown


@dataclass
class GroupState(Generic[P]):
    """A prompt and its ``group_size`` samples; ``prompt`` is the trainer's opaque row."""

    group_id: int
    key: str
    prompt: P
    samples: list[SampleState]
    prompt_ids: list[int] | None = None

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)


@dataclass(frozen=True)
class SampleRef:
    group_id: int
    index: int


@dataclass(frozen=True)
class SegmentRequest:
    """What the glue sends to the engine for one sample: prompt + tokens so far, at most ``max_new_tokens``."""

    ref: SampleRef
    request_id: str
    prefix_ids: list[int]
    max_new_tokens: int


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
    budget_rounds: int = 0
    route_changes: int = 0


class RolloutPool(Generic[P]):
    """In-flight groups with their parked samples; the scheduling state machine of partial rollout."""

    def __init__(self, config: PartialConfig, *, group_size: int, batch_groups: int, response_length: int) -> None:
        if group_size < 1 or batch_groups < 1 or response_length < 1:
            raise ValueError(
                f"group_size ({group_size}), batch_groups ({batch_groups}) and response_length "
                f"({response_length}) must all be >= 1"
            )
        self.config = config
        self.group_size = group_size
        self.batch_groups = batch_groups
        self.response_length = response_length
        self.groups: dict[int, GroupState[P]] = {}
        self.next_group_id = 0
        self.version = 0
        self.step = 0
        self.counters = Counters()
        self.totals = Counters()
        self.events: list[tuple[str, str]] = []

    def _count(self, **deltas: int) -> None:
        for counts in (self.counters, self.totals):
            for name, delta in deltas.items():
                setattr(counts, name, getattr(counts, name) + delta)

    # ---------------------------------------------------------------- admission
    @property
    def capacity(self) -> int:
        return self.batch_groups + self.config.extra_groups

    def free_slots(self) -> int:
        return max(0, self.capacity - len(self.groups))

    def admit(self, prompt: P, key: str) -> int:
        if self.free_slots() == 0:
            raise RuntimeError(f"pool is full ({len(self.groups)}/{self.capacity} groups); check free_slots() first")
        group_id = self.next_group_id
        self.next_group_id += 1
        samples = [SampleState() for _ in range(self.group_size)]
        self.groups[group_id] = GroupState(group_id, key, prompt, samples)
        self._count(admitted_groups=1)
        self.events.append(("admitted", key))
        return group_id

    # ---------------------------------------------------------------- step lifecycle
    def begin_step(self, step: int, version: int) -> None:
        """Start generation for training step ``step`` with policy weights of version ``version``.

        Staleness is enforced here, before any new token exists: a token generated at version v and
        trained at this step lags ``version - v``; anything beyond ``max_staleness`` is restarted or
        its group dropped, per policy.
        """
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.step, self.version = step, version
        self.counters = Counters()
        for group in list(self.groups.values()):
            for sample in group.samples:
                if sample.in_flight:
                    raise RuntimeError(f"group {group.key} still has a request in flight at step start")
                sample.tokens_this_step = 0
            self._enforce_staleness(group)

    def _enforce_staleness(self, group: GroupState[P]) -> None:
        if self.config.staleness_policy == "keep":
            return
        stale = [
            sample
            for sample in group.samples
            if sample.oldest_version is not None and self.version - sample.oldest_version > self.config.max_staleness
        ]
        if not stale:
            return
        if self.config.staleness_policy == "drop":
            self._take_out(group, "dropped")
            return
        for sample in stale:
            thrown = sample.discard_tokens()
            self._count(tokens_discarded=thrown, restarted_samples=1)

    def _take_out(self, group: GroupState[P], reason: str) -> None:
        thrown = sum(len(sample.token_ids) for sample in group.samples)
        self._count(tokens_discarded=thrown, **{f"{reason}_groups": 1})
        del self.groups[group.group_id]
        self.events.append((reason, group.key))

    def runnable(self) -> list[SampleRef]:
        """Samples that may start a segment now, oldest group first (old groups finish first, lag least)."""
        refs = []
        for group in sorted(self.groups.values(), key=lambda g: g.group_id):
            for index, sample in enumerate(group.samples):
                if not sample.finished and not sample.in_flight and self._budget(sample) > 0:
                    refs.append(SampleRef(group.group_id, index))
        return refs

    def _budget(self, sample: SampleState) -> int:
        return self.config.max_new_tokens(len(sample.token_ids), sample.tokens_this_step, self.response_length)

    def start(self, ref: SampleRef) -> SegmentRequest:
        group = self.groups[ref.group_id]
        sample = group.samples[ref.index]
        if sample.finished or sample.in_flight:
            raise RuntimeError(f"sample {group.key}/{ref.index} is not runnable")
        budget = self._budget(sample)
        if budget <= 0:
            raise RuntimeError(f"sample {group.key}/{ref.index} has no token budget left this step")
        sample.in_flight = True
        # A stable request id per sample: verl's router is sticky on it, so every segment of a sample
        # lands on the server whose prefix cache holds its tokens.
        return SegmentRequest(ref, f"{group.key}/{ref.index}", list(sample.token_ids), budget)

    def finish_segment(
        self,
        ref: SampleRef,
        new_ids: list[int],
        new_log_probs: list[float],
        *,
        eos: bool,
        prompt_ids: list[int] | None = None,
        output: Any = None,
        route: str | None = None,
    ) -> None:
        """Record a segment's output; every new token is tagged with the current policy version."""
        group = self.groups.get(ref.group_id)
        if group is None:  # taken out while the call was running (its late result is ignored)
            return
        sample = group.samples[ref.index]
        if not sample.in_flight:
            raise RuntimeError(f"sample {group.key}/{ref.index} has no segment in flight")
        if len(new_ids) != len(new_log_probs):
            raise ValueError(f"segment returned {len(new_ids)} tokens but {len(new_log_probs)} log-probs")
        if len(new_ids) > self._budget(sample):
            raise ValueError(
                f"segment of {group.key}/{ref.index} returned {len(new_ids)} tokens, over its budget "
                f"of {self._budget(sample)}"
            )
        if prompt_ids is not None:
            if group.prompt_ids is None:
                group.prompt_ids = list(prompt_ids)
            elif group.prompt_ids != list(prompt_ids):
                raise ValueError(f"prompt tokens of group {group.key} changed between segments")
        sample.in_flight = False
        if route is not None:
            if sample.last_route is not None and route != sample.last_route and sample.token_ids:
                self._count(route_changes=1)
            sample.last_route = route
        sample.segments += 1
        sample.token_ids.extend(new_ids)
        sample.log_probs.extend(new_log_probs)
        sample.versions.extend([self.version] * len(new_ids))
        sample.tokens_this_step += len(new_ids)
        if self.step not in sample.steps_touched:
            sample.steps_touched.append(self.step)
        sample.finished = eos or len(sample.token_ids) >= self.response_length
        sample.output = output if sample.finished else None
        self._count(tokens_generated=len(new_ids))

    def fail_segment(self, ref: SampleRef) -> bool:
        """Record a call that raised or timed out; returns True when the group was taken out."""
        group = self.groups.get(ref.group_id)
        if group is None:
            return True
        sample = group.samples[ref.index]
        sample.in_flight = False
        sample.failures += 1
        self._count(failed_calls=1)
        if sample.failures > self.config.max_retries:
            self._take_out(group, "failed")
            return True
        return False

    def ready_groups(self) -> list[GroupState[P]]:
        return [group for group in sorted(self.groups.values(), key=lambda g: g.group_id) if group.finished]

    def step_done(self) -> bool:
        return len(self.ready_groups()) >= self.batch_groups

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
            and not self.runnable()
            and any(not group.finished for group in self.groups.values())
        )

    def grant_budget_round(self) -> None:
        for group in self.groups.values():
            for sample in group.samples:
                sample.tokens_this_step = 0
        self._count(budget_rounds=1)

    def take_ready(self) -> list[GroupState[P]]:
        """Hand ``batch_groups`` finished groups to training, oldest first, and forget them."""
        if self.in_flight():
            raise RuntimeError("take_ready() with requests in flight: abort or await them first")
        ready = self.ready_groups()
        if len(ready) < self.batch_groups:
            raise RuntimeError(f"only {len(ready)} of {self.batch_groups} groups are finished")
        taken = ready[: self.batch_groups]
        for group in taken:
            del self.groups[group.group_id]
            self.events.append(("trained", group.key))
        self._count(trained_groups=len(taken))
        return taken

    # ---------------------------------------------------------------- metrics
    def step_metrics(self, trained: list[GroupState[P]]) -> dict[str, float]:
        """``partial/*`` metrics for the step that just trained ``trained`` (see docs/partial-rollout.md)."""
        samples = [sample for group in trained for sample in group.samples]
        lags = Counter(self.version - version for sample in samples for version in sample.versions)
        trained_tokens = sum(lags.values())
        # Parked = resumable work: unfinished samples holding tokens (not yet-unstarted ones).
        parked = [s for group in self.groups.values() for s in group.samples if not s.finished and s.token_ids]
        parked_tokens = sum(len(sample.token_ids) for group in self.groups.values() for sample in group.samples)
        segments = [sample.segments for sample in samples] or [0]
        metrics: dict[str, float] = {
            "partial/in_flight_groups": float(len(self.groups)),
            "partial/parked_samples": float(len(parked)),
            "partial/parked_tokens": float(parked_tokens),
            "partial/parked_bytes": float(parked_tokens * BYTES_PER_PARKED_TOKEN),
            "partial/resumed_fraction": sum(len(s.steps_touched) > 1 for s in samples) / max(1, len(samples)),
            "partial/segments_per_sample/mean": sum(segments) / len(segments),
            "partial/segments_per_sample/max": float(max(segments)),
            "partial/staleness/mean": sum(lag * count for lag, count in lags.items()) / max(1, trained_tokens),
            "partial/staleness/max": float(max(lags, default=0)),
            "partial/restarted_samples": float(self.counters.restarted_samples),
            "partial/dropped_groups": float(self.counters.dropped_groups),
            "partial/failed_groups": float(self.counters.failed_groups),
            "partial/failed_calls": float(self.counters.failed_calls),
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
        for lag, count in sorted(lags.items()):
            metrics[f"partial/staleness/lag_{lag}_fraction"] = count / trained_tokens
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
        self.next_group_id = state["next_group_id"]
        self.version = state["version"]
        self.step = state["step"]
        self.totals = Counters(**state["totals"])


def _shallow_fields(obj: Any) -> dict[str, Any]:
    """Field values by name, without ``dataclasses.asdict``'s recursion (it would turn payloads into dicts)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
