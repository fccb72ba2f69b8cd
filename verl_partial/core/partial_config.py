"""Typed mirror of ``hydra_configs/partial/*.yaml``'s ``partial:`` block.

Every knob of partial rollout is one field here, validated on construction so a bad value fails in
the driver, before Ray starts, with the full key name and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass

STALENESS_POLICIES = ("restart", "drop", "keep", "wait")
SCHEDULES = ("fifo", "longest_first")


@dataclass(frozen=True)
class PartialConfig:
    """Partial rollout for verl's synchronous RayPPOTrainer.

    Attributes:
        enable: master switch; ``false`` leaves verl's rollout untouched.
        extra_groups: groups kept in flight beyond ``data.train_batch_size``. A step ends once
            ``train_batch_size`` whole groups are finished; the extra ones absorb the long tail and
            are continued next step (verl fully_async's staleness factor, slime's over-sampling).
        step_token_budget: Kimi k1.5-style cap on the tokens one sample may generate per step;
            ``null`` lets a sample run to ``response_length`` within one step.
        chunk_tokens: interruption granularity: the most tokens one generate call may produce.
            Between chunks the scheduler re-checks whether the step is done, so a backend that
            cannot abort still stops within one chunk. ``null``: one call per sample per step.
        abort_on_done: abort in-flight requests through the backend (vLLM/SGLang/CPU all support it)
            as soon as the step has its groups; their partial tokens are parked. ``false``: let them end
            on their own (within one chunk).
        max_staleness: the most policy versions a trained token may lag the policy being trained.
        staleness_policy: what happens to a sample whose oldest token would exceed ``max_staleness``:
            ``restart`` regenerates it from the prompt (tokens are thrown away and counted), ``drop``
            removes its whole group (counted, its prompt replaced by a fresh one), ``keep`` trains it
            anyway and leaves the off-policy gap to rollout correction. ``wait`` never lets a sample get that
            old: a step does not end while an unfinished group holds a token that would exceed ``max_staleness``
            at the next step, so nothing is thrown away, long answers are not held back, and the bound is hard;
            the price is that a step lasts until its carried-over groups are done (``refill`` keeps the engine
            busy meanwhile).
        refill: a group that finishes during a step frees its pool slot at once (it is trained at this step's
            end), so the scheduler admits a fresh group mid-step and the engine keeps ``train_batch_size +
            extra_groups`` groups generating instead of draining towards the step end (the streaming admission
            of verl's fully_async rollouter and AReaL). ``false``: groups are admitted at the step start only.
        max_retries: retries of one sample's failed calls before its group is taken out (counted as
            ``partial/failed_groups``; its prompt is replaced). Counted in a row: any call that brings tokens
            or a finish resets the count. A call fails when it raises, is refused by a closed gate outside the
            step end, or is given up as stalled with no tokens to show; never for its length.
        request_timeout_s: seconds a server may go without returning any result while it has calls of ours
            outstanding; then those calls are judged stalled and cancelled at the server. Time spent queued
            behind other calls of a server that keeps answering does not count. A stalled call that brings its
            tokens back (it was slow, not stuck) keeps them and is not a failure.
        abort_grace_s: at the step end, how long to wait for calls to answer the abort before cancelling
            those still parked at a gate or in transit (not a failure), and how long a cancelled call may take
            to answer before it is abandoned. A step end takes about one ``abort_grace_s`` when calls are
            parked or in transit, and at most ``5 * abort_grace_s`` even when a server hangs (abort, grace,
            cancel, its answer and resume are each bounded by it).
        max_calls_per_server: most outstanding generate calls per server; keep it below the server actor's
            Ray ``max_concurrency`` (1000 in verl) so abort/resume/sleep always find a free slot.
        schedule: launch order of a step's samples. ``fifo``: oldest group first. ``longest_first``: longest
            expected answer first, estimated from the group's finished siblings or the prompt's earlier epochs
            (Seer, RollPacker; :mod:`verl_partial.core.on_policy`); it cuts the tail when servers queue
            requests, the lever the ``on_policy`` preset (``max_staleness=0``) relies on.
        ledger_path: optional JSON-lines audit log of every prompt admitted, trained, dropped or
            failed, one line per event; makes "nothing lost, nothing trained twice" checkable.
        dump_dir: optional folder receiving, per step, every trained sample's prompt and response
            token ids, log-probs and per-token policy versions (``step_N.pt``), for offline audit
            of what was trained and under which weights each token was generated.
    """

    enable: bool = True
    extra_groups: int = 4
    step_token_budget: int | None = None
    chunk_tokens: int | None = None
    abort_on_done: bool = True
    max_staleness: int = 1
    staleness_policy: str = "restart"
    refill: bool = False
    max_retries: int = 2
    request_timeout_s: float = 600.0
    abort_grace_s: float = 5.0
    max_calls_per_server: int = 512
    schedule: str = "fifo"
    ledger_path: str | None = None
    dump_dir: str | None = None

    def __post_init__(self) -> None:
        _require(self.extra_groups >= 0, "partial.extra_groups", "an integer >= 0", self.extra_groups)
        for key, value in (("step_token_budget", self.step_token_budget), ("chunk_tokens", self.chunk_tokens)):
            _require(value is None or value > 0, f"partial.{key}", "null or an integer > 0", value)
        _require(self.max_staleness >= 0, "partial.max_staleness", "an integer >= 0", self.max_staleness)
        _require(
            self.staleness_policy in STALENESS_POLICIES,
            "partial.staleness_policy",
            f"one of {list(STALENESS_POLICIES)}",
            self.staleness_policy,
        )
        if self.staleness_policy == "wait":
            # Groups a ``wait`` step carries over hold tokens of this step's version; they must fit the next steps'
            # training, or their tokens would be thrown away after all.
            _require(
                not (self.refill and self.extra_groups),
                "partial.extra_groups",
                "0 with partial.refill=true and partial.staleness_policy=wait (refill already keeps the engine fed; "
                "extra groups would carry more groups into the next step than it trains)",
                self.extra_groups,
            )
            _require(
                self.max_staleness >= 1 or not (self.refill or self.extra_groups),
                "partial.max_staleness",
                ">= 1 with partial.staleness_policy=wait and partial.refill or partial.extra_groups (at 0 every "
                "carried-over group would be stale; use extra_groups=0, refill=false)",
                self.max_staleness,
            )
        _require(self.max_retries >= 0, "partial.max_retries", "an integer >= 0", self.max_retries)
        _require(self.request_timeout_s > 0, "partial.request_timeout_s", "a number > 0", self.request_timeout_s)
        _require(self.abort_grace_s > 0, "partial.abort_grace_s", "a number > 0", self.abort_grace_s)
        _require(
            self.max_calls_per_server >= 1, "partial.max_calls_per_server", "an integer >= 1", self.max_calls_per_server
        )
        _require(self.schedule in SCHEDULES, "partial.schedule", f"one of {list(SCHEDULES)}", self.schedule)

    def max_new_tokens(self, generated: int, generated_this_step: int, response_length: int) -> int:
        """Tokens the next generate call of a sample may produce; 0 means it must wait for the next step."""
        limit = response_length - generated
        if self.chunk_tokens is not None:
            limit = min(limit, self.chunk_tokens)
        if self.step_token_budget is not None:
            limit = min(limit, self.step_token_budget - generated_this_step)
        return max(0, limit)


def _require(ok: bool, key: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")
