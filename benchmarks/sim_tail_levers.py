"""Two levers tried against the `default` preset's alternating phases in the GPU projection (docs/gpu-projection.md).

At 7B / p99/p50 = 20 the `default` preset (`wait` + `refill`) reaches 1.53x of a 2.63x ceiling, and its rollout
phases alternate between short and long. The cause: a group admitted late in a phase must finish in the next one,
so one long answer admitted late makes the next phase almost as long as sync's. Each variant below attacks
that cause. Each runs the real scheduler in the simulator, beside `default` and sync on the same workload:

* ``restart_young``: at a step end, a group admitted in the ending phase whose unfinished answers hold fewer than
  ``Y`` tokens is restarted (all its tokens thrown away), so it is no longer tied to the next phase.
* ``oracle_admission``: prompts are admitted from a look-ahead buffer knowing each group's longest answer (an
  oracle no real trainer has): the longest groups at a phase start, the shortest mid-phase. With a mid-phase cap,
  no group whose longest answer exceeds it is admitted mid-phase. An upper bound on length-aware admission.

    python benchmarks/sim_tail_levers.py --json benchmarks/results/sim_tail_levers.json   # ~3 min of CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
from sim_gpu_projection import SETUPS  # the projection's setups (benchmarks/ is the script's folder)

from verl_partial.core.pool import RolloutPool
from verl_partial.sim.run import ModeRun, ks_distance, mode_configs, simulate
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


def row(name: str, run: ModeRun, sync: ModeRun, load: Workload) -> dict[str, object]:
    return {
        "variant": name,
        "speedup": float(np.mean(sync.seconds) / np.mean(run.seconds)),
        "phases_s": [round(float(s), 1) for s in run.seconds],
        "discarded_fraction": float(np.sum(run.tokens_discarded) / max(1.0, np.sum(run.tokens_generated))),
        "staleness_max": float(np.max(run.staleness_max)),
        "ks_vs_unbiased": ks_distance(run.lengths, load.reference_lengths()),
        "max_group_wait": float(run.waits.max()),
    }


def measure(steps: int, warmup: int) -> list[dict[str, object]]:
    spec, servers = SETUPS["7B"]
    load = Workload(batch=128, n=16, p50=1024, p99_over_p50=20.0, response_length=32768, prompts=512)
    default = mode_configs(load.batch)["stream"]
    sync = simulate(mode_configs(load.batch)["sync"], load, spec, servers, steps + warmup).steady(warmup)
    rows = [row("sync", sync, sync, load)]
    CarriedRecorder.carried = []
    run = simulate(default, load, spec, servers, steps + warmup, pool_type=CarriedRecorder).steady(warmup)
    # carried[k] is recorded at step k's start: the answers step k - 1 left running.
    ends = CarriedRecorder.carried[warmup + 1 :] + [[]]
    rows.append(row("default", run, sync, load) | {"carried_at_step_end": [
        {"phase_s": round(float(seconds), 1), "answers": len(tokens), "tokens_p50": float(np.median(tokens or [0])),
         "tokens_max": max(tokens or [0])} for seconds, tokens in zip(run.seconds, ends, strict=True)
    ]})  # fmt: skip
    for young in (2048, 4096, 8192, 16384):
        RestartYoungPool.young_tokens = young
        run = simulate(default, load, spec, servers, steps + warmup, pool_type=RestartYoungPool).steady(warmup)
        rows.append(row(f"restart_young Y={young}", run, sync, load))
    for cap in (None, 4096, 8192):
        OracleAdmission.mid_phase_cap = cap
        run = simulate(default, load, spec, servers, steps + warmup, source_type=OracleAdmission).steady(warmup)
        rows.append(row(f"oracle_admission cap={cap}", run, sync, load))
    return rows


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| variant | speed-up vs sync | shortest / longest phase s | thrown away | staleness max | KS vs unbiased "
             "| max wait |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        phases = r["phases_s"]
        lines.append(
            f"| {r['variant']} | {r['speedup']:.2f}x | {min(phases):.0f} / {max(phases):.0f} | "
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
