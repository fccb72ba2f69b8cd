"""The ``partial:`` block: every knob of partial rollout, its documentation, and its presets.

One frozen dataclass; each field's docstring is the documentation of ``partial.<field>`` (docs/configuration.md
is generated from it: ``python -m verl_partial.config.docs``). ``PartialConfig()`` is the ``default`` preset, and
every preset is defined once, in ``PRESETS``: ``hydra_configs/partial/<name>.yaml`` writes the same values
(tests/unit/test_plugin_and_config.py composes each and compares it field by field) and the simulator
(``verl_partial.sim.run.mode_configs``) runs them under the same names. Validation follows
:mod:`verl_partial.config.checks`, so a bad value fails in the driver, before Ray starts, with the full
key name and the allowed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from verl_partial.config.checks import check_types, choices, require

BLOCK = "partial"

StalenessPolicy = Literal["restart", "drop", "keep", "wait"]
Schedule = Literal["fifo", "longest_first"]
KvCacheSource = Literal["auto", "off"]
CallsCapSource = Literal["auto"]
#: Calls per server ``partial.max_calls_per_server=auto`` allows where no GPU knee caps them (and its most anywhere):
#: half the server actor's Ray ``max_concurrency`` (1000 in verl), so abort/resume/sleep always find a free slot.
CALLS_PER_SERVER_CEILING = 512
#: Allowed values of ``partial.staleness_policy``.
STALENESS_POLICIES: tuple[str, ...] = choices(StalenessPolicy)
#: Allowed values of ``partial.schedule``.
SCHEDULES: tuple[str, ...] = choices(Schedule)

#: File of a checkpoint folder holding partial rollout's state (parked groups, prompts already drawn). Defined
#: here, beside the config, so the driver's resume check (verl_partial.config.job) finds it without importing the
#: glue layer and verl's agent loop with it.
STATE_FILE = "verl_partial_state.pt"


@dataclass(frozen=True)
class PartialConfig:
    """Partial rollout for verl's synchronous RayPPOTrainer; ``PartialConfig()`` is ``+partial=default``."""

    enable: bool = True
    """Master switch; ``false`` leaves verl's rollout untouched."""

    extra_groups: int = 0
    """Groups kept in flight beyond ``data.train_batch_size``. A step ends once ``train_batch_size`` whole groups are
    finished; the extra ones absorb the long tail and are continued next step (verl fully_async's staleness factor,
    slime's over-sampling). Must be 0 with ``refill=true`` and ``staleness_policy=wait``."""

    step_token_budget: int | None = None
    """Kimi k1.5-style cap on the tokens one sample may generate per step; ``null`` lets a sample run to
    ``response_length`` within one step."""

    chunk_tokens: int | None = None
    """Interruption granularity: the most tokens one generate call may produce. Between chunks the scheduler
    re-checks whether the step is done, so a backend that cannot abort still stops within one chunk. ``null``: one
    call per sample per step."""

    abort_on_done: bool = True
    """Abort in-flight requests through the backend (vLLM/SGLang/CPU all support it) as soon as the step has its
    groups; their partial tokens are parked. ``false``: let them end on their own (within one chunk)."""

    max_staleness: int = 1
    """The most policy versions a trained token may lag the policy being trained; ``staleness_policy`` says what
    happens to an older one. 0 is strictly on-policy."""

    staleness_policy: StalenessPolicy = "wait"
    """What happens to a sample whose oldest token would exceed ``max_staleness``: ``restart`` regenerates it from the
    prompt (tokens are thrown away and counted), ``drop`` removes its whole group (counted, its prompt replaced by a
    fresh one), ``keep`` trains it anyway and leaves the off-policy gap to rollout correction. ``wait`` never lets a
    sample get that old: a step does not end while an unfinished group holds a token that would exceed
    ``max_staleness`` at the next step, so nothing is thrown away, long answers are not held back, and the bound is
    hard; the price is that a step lasts until its carried-over groups are done (``refill`` keeps the engine busy
    meanwhile)."""

    refill: bool = True
    """A group that finishes during a step frees its pool slot at once (it is trained at this step's end), so the
    scheduler admits a fresh group mid-step and the engine keeps ``train_batch_size + extra_groups`` groups
    generating instead of draining towards the step end (the streaming admission of verl's fully_async rollouter and
    AReaL). ``false``: groups are admitted at the step start only."""

    fill_engine: bool = True
    """Admission follows the engines' free capacity: beyond ``train_batch_size + extra_groups`` (and the refill), a
    fresh group is admitted whenever the engines have a free slot for each of its samples (servers x
    ``rollout.max_num_seqs``), while the pool holds at most ``(1 + max_staleness) x train_batch_size`` groups, the
    most that can be generated ahead of training without a token exceeding ``max_staleness`` (AReaL's capacity
    bound). A server that never fills then runs full instead of idling while a group's last samples decode; one that
    queues has no free slot. ``false``: admission by groups only (``refill`` and ``extra_groups``)."""

    max_retries: int = 2
    """Retries of one sample's failed calls before its group is taken out (counted as ``partial/failed_groups``; its
    prompt is replaced). Counted in a row: any call that brings tokens or a finish resets the count. A call fails
    when it raises, is refused by a closed gate outside the step end, or is given up as stalled with no tokens to
    show; never for its length."""

    request_timeout_s: float = 600.0
    """Seconds a server may go without returning any result while it has calls of ours outstanding; then those calls
    are judged stalled and taken back at the server by request id. Time spent queued behind other calls of a server
    that keeps answering does not count. A taken-back call that brings its tokens back (a long decode: slow, not
    stuck) keeps them, is resumed and is not a failure; one that brings nothing counts as a failed call."""

    abort_grace_s: float = 5.0
    """At the step end, how long to wait for calls to answer the abort before taking back those still out (queued in
    an engine, which holds vLLM's abort barrier, or in transit); and how long a taken-back call may take to answer
    before it is cancelled (the only way tokens can be lost, ``partial/cancelled_calls``), then abandoned. A step
    end takes about one ``abort_grace_s`` when calls are still out, and at most ``6 * abort_grace_s`` even when a
    server hangs (grace, two take-backs, cancel, the abort's return and resume are each bounded by it)."""

    max_calls_per_server: int | CallsCapSource = "auto"
    """Most outstanding generate calls per server. ``auto``: the compute knee of the servers' GPU, by the name its
    engine reports (26 on an H20, 147 on an H200, 210 on an H100; the partial-rollout guide, "Where it gains"), at
    most 512; 512 without a GPU; an unknown GPU is refused. An integer is the cap itself, below verl's Ray
    ``max_concurrency`` (1000); set one for weight-only quantised rollout (half the knee)."""

    kv_tokens_per_server: int | KvCacheSource = "auto"
    """Tokens of KV cache per server. A server gets at most this over the mean context (prompt + response) of the
    samples finished so far in calls at once: sent more, vLLM preempts and recomputes long answers. ``auto``: the
    smallest server's, read from the engines at the first step (vLLM's "GPU KV cache size" x ``data_parallel_size``,
    SGLang's ``max_total_num_tokens``); no cap where an engine does not say. ``off``: no cap."""

    schedule: Schedule = "fifo"
    """Launch order of a step's samples. ``fifo``: oldest group first. ``longest_first``: longest expected answer
    first, estimated from the group's finished siblings or the prompt's earlier epochs (Seer, RollPacker;
    :mod:`verl_partial.core.partial.on_policy`); it cuts the tail when servers queue requests, the lever the
    ``on_policy``
    preset (``max_staleness=0``) relies on."""

    length_window_steps: int = 0
    """Length-aware batch composition (tail batching; RollPacker, Seer): ``K >= 2`` draws ``K x
    data.train_batch_size`` prompts at a time and admits them longest expected answer first (expected from the
    prompt's earlier epochs), so the window's long answers start together and share its first steps, and its later
    steps hold short answers.
    Every prompt is admitted within about K steps of its window's draw (``partial/window_delay_steps/max``), and each
    window trains exactly its own prompts. The first epoch has no history and runs in the dataloader's order. Needs
    a prompt identity across epochs (``extra_info.index``). ``0``: the dataloader's order
    (:mod:`verl_partial.core.partial.length_batching`)."""

    ledger_path: str | None = None
    """Optional JSON-lines audit log of every prompt admitted, trained, dropped or failed, one line per event; makes
    "nothing lost, nothing trained twice" checkable."""

    dump_dir: str | None = None
    """Optional folder receiving, per step, every trained sample's prompt and response token ids, log-probs and
    per-token policy versions (``step_N.pt``), for offline audit of what was trained and under which weights each
    token was generated."""

    def __post_init__(self) -> None:
        check_types(self, BLOCK)
        require(self.extra_groups >= 0, "partial.extra_groups", "an integer >= 0", self.extra_groups)
        for key, value in (("step_token_budget", self.step_token_budget), ("chunk_tokens", self.chunk_tokens)):
            require(value is None or value > 0, f"partial.{key}", "null or an integer > 0", value)
        require(self.max_staleness >= 0, "partial.max_staleness", "an integer >= 0", self.max_staleness)
        if self.staleness_policy == "wait":
            # Groups a ``wait`` step carries over hold tokens of this step's version; they must fit the next steps'
            # training, or their tokens would be thrown away after all.
            require(
                not (self.refill and self.extra_groups),
                "partial.extra_groups",
                "0 with partial.refill=true and partial.staleness_policy=wait (refill already keeps the engine fed; "
                "extra groups would carry more groups into the next step than it trains)",
                self.extra_groups,
            )
            require(
                self.max_staleness >= 1 or not (self.refill or self.extra_groups),
                "partial.max_staleness",
                ">= 1 with partial.staleness_policy=wait and partial.refill or partial.extra_groups (at 0 every "
                "carried-over group would be stale; use extra_groups=0, refill=false)",
                self.max_staleness,
            )
            # A per-step budget makes carried-over groups age in lockstep: more of them can come due in one step than
            # it trains, and wait would then have to throw the rest away after all.
            require(
                self.step_token_budget is None,
                "partial.step_token_budget",
                "null with partial.staleness_policy=wait (use staleness_policy=keep or restart with a per-step budget, "
                "as +partial=kimi does)",
                self.step_token_budget,
            )
        require(
            self.length_window_steps == 0 or self.length_window_steps >= 2,
            "partial.length_window_steps",
            "0 (the dataloader's order) or an integer >= 2 (steps per window)",
            self.length_window_steps,
        )
        require(self.max_retries >= 0, "partial.max_retries", "an integer >= 0", self.max_retries)
        require(self.request_timeout_s > 0, "partial.request_timeout_s", "a number > 0", self.request_timeout_s)
        require(self.abort_grace_s > 0, "partial.abort_grace_s", "a number > 0", self.abort_grace_s)
        require(
            isinstance(self.max_calls_per_server, str) or self.max_calls_per_server >= 1,
            "partial.max_calls_per_server",
            "auto or an integer >= 1",
            self.max_calls_per_server,
        )
        require(
            isinstance(self.kv_tokens_per_server, str) or self.kv_tokens_per_server >= 1,
            "partial.kv_tokens_per_server",
            "auto, off or an integer >= 1 (the server's KV cache in tokens)",
            self.kv_tokens_per_server,
        )

    def max_new_tokens(self, generated: int, generated_this_step: int, response_length: int) -> int:
        """Tokens the next generate call of a sample may produce; 0 means it must wait for the next step."""
        limit = response_length - generated
        if self.chunk_tokens is not None:
            limit = min(limit, self.chunk_tokens)
        if self.step_token_budget is not None:
            limit = min(limit, self.step_token_budget - generated_this_step)
        return max(0, limit)


_DEFAULT = PartialConfig()

#: Every ``+partial=<name>`` preset; ``hydra_configs/partial/<name>.yaml`` holds the same values.
PRESETS: dict[str, PartialConfig] = {
    # Streaming partial rollout at a hard staleness bound: refill + wait, nothing thrown away.
    "default": _DEFAULT,
    # The default before streaming admission: 4 extra groups absorb the tail; a sample that would exceed
    # max_staleness is regenerated from its prompt (its tokens thrown away and counted).
    "restart": dataclasses.replace(
        _DEFAULT, extra_groups=4, staleness_policy="restart", refill=False, fill_engine=False
    ),
    # Kimi k1.5: a per-step token budget; long answers are generated in segments over several steps, the
    # off-policy part left to rollout correction.
    "kimi": dataclasses.replace(
        _DEFAULT,
        extra_groups=8,
        step_token_budget=1024,
        max_staleness=8,
        staleness_policy="keep",
        refill=False,
        fill_engine=False,
    ),
    # Strictly on-policy: no over-provisioning, the tail cut by launching the longest expected answers first.
    "on_policy": dataclasses.replace(
        _DEFAULT,
        extra_groups=0,
        max_staleness=0,
        staleness_policy="restart",
        refill=False,
        fill_engine=False,
        schedule="longest_first",
    ),
}
# Length-aware batch composition (tail batching) over windows of 4 steps, at either staleness bound: ``default``'s
# (<= 1) and ``on_policy``'s (0). 4 steps: docs/method/gpu-simulator.md compares 2, 4 and 8.
PRESETS["tail"] = dataclasses.replace(PRESETS["default"], length_window_steps=4)
PRESETS["tail_on_policy"] = dataclasses.replace(PRESETS["on_policy"], length_window_steps=4)
