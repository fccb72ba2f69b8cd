"""Levers tried against the `default` preset's alternating phases in the GPU projection (docs/method/gpu-simulator.md).

At 7B / p99/p50 = 20 the `default` preset (`wait` + `refill`) stays well short of the bound for sync's batch
composition at staleness 1 (figures: docs/method/gpu-simulator.md), and its rollout phases alternate between
short and long. The cause: a group admitted late in a phase must finish in the next one,
so one long answer admitted late makes the next phase almost as long as sync's. Each variant below attacks
that cause. Each runs the real scheduler in the simulator, beside `default` and sync on the same workload:

* ``restart_young``: at a step end, a group admitted in the ending phase whose unfinished answers hold fewer than
  ``Y`` tokens is restarted (all its tokens thrown away), so it is no longer tied to the next phase.
* ``oracle_admission``: prompts are admitted from a look-ahead buffer knowing each group's longest answer (an
  oracle no real trainer has): the longest groups at a phase start, the shortest mid-phase. With a mid-phase cap,
  no group whose longest answer exceeds it is admitted mid-phase. An upper bound on length-aware admission.
* ``min_phase``: a step does not end before a fraction of the previous phase has passed, so a short phase lets
  the long answers it started run longer (the scheduler's loop is woken at that moment through its deadline
  hook; an experiment on its internals, not a knob).
* ``extra_groups``: more groups in flight than the batch, which the presets refuse under ``wait`` + ``refill``
  because the next step could not train every group tied to it. Here that refusal is replaced by a rule: at a
  step start, the tied groups beyond what the step can train are restarted, fewest tokens first (counted).

    python -m benchmarks.sim_tail_levers --json benchmarks/results/sim_tail_levers.json   # ~3 min of CPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.sim_gpu_projection import SETUPS
from verl_partial.core.partial import scheduler
from verl_partial.core.partial.pool import RolloutPool
from verl_partial.sim import run as simrun
from verl_partial.sim.backend import SimBackend
from verl_partial.sim.run import ModeRun, mode_configs, simulate, throughput_limit
from verl_partial.sim.stats import ks_distance
from verl_partial.sim.workload import PromptCycle, Workload

LOOKAHEAD_GROUPS = 256  # prompts the oracle may choose from: two steps' worth


class CarriedRecorder(RolloutPool[int]):
    """``default``'s pool, unchanged, recording at each step end the answers carried into the next phase (count and
    tokens each: what the next phase must finish)."""

    carried: list[list[int]] = []

    def begin_step(self, step: int, version: int, server_version: int | None = None) -> None:
        samples = [sample for group in self.groups.values() for sample in group.samples if not sample.finished]
        running = [len(sample.token_ids) for sample in samples if len(sample.token_ids)]
        type(self).carried.append(sorted(running))
        super().begin_step(step, version, server_version)


class RestartYoungPool(RolloutPool[int]):
    """``default``'s pool, but a group admitted in the ending phase with every unfinished answer shorter than
    ``young_tokens`` is restarted at the step start instead of being carried (tokens counted as discarded)."""

    young_tokens = 0

    def begin_step(self, step: int, version: int, server_version: int | None = None) -> None:
        ending = self.step
        super().begin_step(step, version, server_version)
        for group in self.groups.values():
            unfinished = [sample for sample in group.samples if not sample.finished]
            if group.admitted_step == ending and unfinished:
                if max(len(sample.token_ids) for sample in unfinished) < self.young_tokens:
                    thrown = sum(sample.discard_tokens() for sample in group.samples)
                    self.count(tokens_discarded=thrown, restarted_samples=len(group.samples))


class OracleAdmission(PromptCycle):
    """Admission that knows each group's longest answer: longest first at a phase start, shortest mid-phase, and
    mid-phase none longer than ``mid_phase_cap`` (None: no cap)."""

    mid_phase_cap: float | None = None

    def __init__(self, workload: Workload) -> None:
        super().__init__(workload)
        self.buffer: list[tuple[int, int, str]] = []
        self.phase: tuple[int, float] | None = None  # (step, virtual time of its first admission)

    def _longest(self, prompt: int, key: str) -> int:
        wl = self.workload
        return max(min(wl.length(prompt, key, index, 0), wl.response_length) for index in range(wl.n))

    def next_prompt(self) -> tuple[int, str] | None:
        while len(self.buffer) < LOOKAHEAD_GROUPS:
            prompt = self.issued % self.workload.prompts
            key = f"p{prompt}@e{self.issued // self.workload.prompts}"
            self.issued += 1
            self.buffer.append((self._longest(prompt, key), prompt, key))
        now = asyncio.get_running_loop().time()
        if self.phase is None or self.phase[0] != self.step:
            self.phase = (self.step, now)
        at_start = now == self.phase[1]
        self.buffer.sort()
        if not at_start and self.mid_phase_cap is not None and self.buffer[0][0] > self.mid_phase_cap:
            return None  # nothing short enough: no more admissions this phase
        _, prompt, key = self.buffer.pop(-1 if at_start else 0)
        self.admitted_at[key] = self.step
        return prompt, key


class ExtraGroupsPool(RolloutPool[int]):
    """``default``'s pool with extra groups: at a step start, unfinished groups holding tokens beyond the batch's
    room (the step must train them all) are restarted, the ones with the fewest tokens first."""

    def begin_step(self, step: int, version: int, server_version: int | None = None) -> None:
        tied = [g for g in self.groups.values() if not g.finished and any(len(s.token_ids) for s in g.samples)]
        room = max(0, self.batch_groups - sum(1 for g in self.groups.values() if g.finished))
        tied.sort(key=lambda group: sum(len(sample.token_ids) for sample in group.samples))
        thrown = sum(sample.discard_tokens() for group in tied[: max(0, len(tied) - room)] for sample in group.samples)
        super().begin_step(step, version, server_version)
        self.count(tokens_discarded=thrown)


class MinPhasePool(RolloutPool[int]):
    """``default``'s pool whose step is not done before ``fraction`` x the previous phase has passed, while
    anything still runs (with nothing running there is nothing to wait for)."""

    fraction = 0.0
    hold_until = 0.0
    phase_start: float | None = None
    previous_phase = 0.0

    def begin_step(self, step: int, version: int, server_version: int | None = None) -> None:
        now = asyncio.get_running_loop().time()
        if self.phase_start is not None:
            self.previous_phase = now - self.phase_start
        self.phase_start = now
        type(self).hold_until = now + self.fraction * self.previous_phase
        super().begin_step(step, version, server_version)

    def step_done(self) -> bool:
        holding = asyncio.get_running_loop().time() < self.hold_until and self.in_flight() > 0
        return super().step_done() and not holding


class _HoldStep(scheduler._Step):
    """The scheduler's per-step state, woken at :class:`MinPhasePool`'s hold end to re-check the step end."""

    def next_deadline(self) -> float | None:
        deadline = super().next_deadline()
        if isinstance(self.pool, MinPhasePool) and self.loop.time() < MinPhasePool.hold_until:
            return MinPhasePool.hold_until if deadline is None else min(deadline, MinPhasePool.hold_until)
        return deadline

    def fire_timers(self, now: float) -> None:
        super().fire_timers(now)
        if isinstance(self.pool, MinPhasePool) and now >= MinPhasePool.hold_until:
            self.maybe_done = True


class RecordingBackend(SimBackend):
    """The simulated servers, kept so a run's mean decode batch can be read after it (warm-up steps included)."""

    last: RecordingBackend | None = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        RecordingBackend.last = self

    @classmethod
    def running_per_step(cls) -> float:
        engines = cls.last.engines.values() if cls.last else []
        steps = sum(engine.stats.decode_steps for engine in engines)
        return sum(engine.stats.tokens for engine in engines) / steps if steps else 0.0


def row(name: str, run: ModeRun, sync: ModeRun, load: Workload, limit: float) -> dict[str, object]:
    return {
        "variant": name,
        "speedup": float(np.mean(sync.seconds) / np.mean(run.seconds)),
        "share_of_limit": float(np.mean(run.tokens_trained) / np.mean(run.seconds) / limit),
        "running_per_server_step": RecordingBackend.running_per_step(),
        "phases_s": [round(float(s), 1) for s in run.seconds],
        "discarded_fraction": float(np.sum(run.tokens_discarded) / max(1.0, np.sum(run.tokens_generated))),
        "staleness_max": float(np.max(run.staleness_max)),
        "ks_vs_unbiased": ks_distance(run.lengths, load.reference_lengths()),
        "max_group_wait": float(run.waits.max()),
    }


def measure(steps: int, warmup: int) -> list[dict[str, object]]:
    spec, servers = SETUPS["7B"]
    load = Workload(batch=128, n=16, p50=1024, p99_over_p50=20.0, response_length=32768, prompts=512)
    default = mode_configs(load.batch)["default"]
    limit = throughput_limit(spec, servers, load)
    simrun.SimBackend = RecordingBackend  # the same servers, kept for the decode-batch column
    sync = simulate(mode_configs(load.batch)["sync"], load, spec, servers, steps + warmup).steady(warmup)
    rows = [row("sync", sync, sync, load, limit)]
    CarriedRecorder.carried = []
    run = simulate(default, load, spec, servers, steps + warmup, pool_type=CarriedRecorder).steady(warmup)
    # carried[k] is recorded at step k's start: the answers step k - 1 left running.
    ends = CarriedRecorder.carried[warmup + 1 :] + [[]]
    rows.append(row("default", run, sync, load, limit) | {"carried_at_step_end": [
        {"phase_s": round(float(seconds), 1), "answers": len(tokens), "tokens_p50": float(np.median(tokens or [0])),
         "tokens_max": max(tokens or [0])} for seconds, tokens in zip(run.seconds, ends, strict=True)
    ]})  # fmt: skip
    for young in (2048, 4096, 8192, 16384):
        RestartYoungPool.young_tokens = young
        run = simulate(default, load, spec, servers, steps + warmup, pool_type=RestartYoungPool).steady(warmup)
        rows.append(row(f"restart_young Y={young}", run, sync, load, limit))
    for cap in (None, 4096, 8192):
        OracleAdmission.mid_phase_cap = cap
        run = simulate(default, load, spec, servers, steps + warmup, source_type=OracleAdmission).steady(warmup)
        rows.append(row(f"oracle_admission cap={cap}", run, sync, load, limit))
    scheduler._Step = _HoldStep  # only MinPhasePool runs use the hold; every other pool sees the original loop
    for fraction in (0.5, 0.7, 0.9):
        MinPhasePool.fraction = fraction
        run = simulate(default, load, spec, servers, steps + warmup, pool_type=MinPhasePool).steady(warmup)
        rows.append(row(f"min_phase {fraction} x previous", run, sync, load, limit))
    for extra in (32, 64, 128):
        more = dataclasses.replace(default)  # a copy; the preset itself stays as it is
        object.__setattr__(more, "extra_groups", extra)  # past the preset's refusal: the rule above stands in
        run = simulate(more, load, spec, servers, steps + warmup, pool_type=ExtraGroupsPool).steady(warmup)
        rows.append(row(f"extra_groups {extra}", run, sync, load, limit))
    return rows


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| variant | speed-up vs sync | % of ref. | answers decoded per server step | shortest / longest "
             "phase s | thrown away | staleness max | KS vs unbiased | max wait |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        phases = r["phases_s"]
        lines.append(
            f"| {r['variant']} | {r['speedup']:.2f}x | {r['share_of_limit']:.0%} | "
            f"{r['running_per_server_step']:.0f} | "
            f"{min(phases):.0f} / {max(phases):.0f} | "
            f"{r['discarded_fraction']:.2%} | {r['staleness_max']:.0f} | {r['ks_vs_unbiased']:.3f} | "
            f"{r['max_group_wait']:.0f} |"
        )
    return "\n".join(lines)


def carried_table(rows: list[dict[str, object]]) -> str:
    lines = ["`default`, at each step end:", "",
             "| measured step | phase s | answers carried into the next phase | their tokens, median | max |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for index, end in enumerate(next(r for r in rows if r["variant"] == "default")["carried_at_step_end"][:-1]):
        lines.append(f"| step {index + 1} | {end['phase_s']:.0f} | {end['answers']} | {end['tokens_p50']:,.0f} | "
                     f"{end['tokens_max']:,} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.process_time()
    rows = measure(args.steps, args.warmup)
    print(table(rows))
    print()
    print(carried_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"cpu_seconds": time.process_time() - started, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
