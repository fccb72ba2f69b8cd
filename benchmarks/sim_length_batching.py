"""Length-aware batch composition (``+partial=tail``, ``+partial=tail_on_policy``) in the GPU-regime simulator.

    python -m benchmarks.sim_length_batching --json benchmarks/results/sim_length_batching.json \\
        --out REPORT.md

The GPU projection's setups (benchmarks/sim_gpu_projection.py: Qwen2.5-7B on 8 x H100, 32B TP2 on 4; 128 prompts x
16 samples; median 1,024 tokens, p99/p50 8 or 20, cap 32,768; a 512-prompt data set, so an epoch every 4 steps and a
prompt's history from the second epoch on). Every mode runs the real scheduler (``run_step``) and the same
``LengthBatcher`` the trainer runs, on the simulated servers, over the same steps as sync: ``WARMUP`` steps (one epoch,
so the estimates exist; the pool starts empty) then ``--steps`` measured steps, a multiple of the 8-step window the
length-bias goal is stated over.

Per row, all per trained token: the speed-up over sync (trained tokens per second of the rollout phase, ratio), its
spread over the 8-step windows (min-max), the longest-phase / shortest-phase seconds; two bounds: the highest
speed-up of any scheduler training this run's batches at its staleness (a step-time ratio, ``sim.run.ceiling``) and
of any schedule at all generating the same tokens (``work_bound``); the windowed KS distance of
trained lengths against sync's over the same 8 steps (the largest over the windows), the KS against the unbiased
length distribution over the whole run; the longest delay of a prompt from its draw to its training (steps); the
largest staleness; the share of generated tokens thrown away. A window ablation (K = 2, 4, 8) runs at 7B, p99/p50 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_peer import write_block
from benchmarks.sim_gpu_projection import SETUPS
from verl_partial.sim.bound import StepCostFloor, work_floor
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.run import ModeRun, ceiling, mode_configs, simulate
from verl_partial.sim.stats import ks_distance
from verl_partial.sim.workload import Workload

WARMUP = 4  # one epoch of the 512-prompt set: every prompt has a history after it
WINDOW = 8  # steps per window of the length-bias goal (issue 20: "windows of 8 steps")
MODES = ("default", "tail", "on_policy", "tail_on_policy")
ABLATION = (2, 4, 8)  # length_window_steps tried at 7B, p99/p50 8
START, END = "<!-- sim-length-batching:start -->", "<!-- sim-length-batching:end -->"


def _rate(run: ModeRun, steps: slice = slice(None)) -> float:
    return float(np.sum(run.tokens_trained[steps]) / np.sum(run.seconds[steps]))


def work_bound(run: ModeRun, sync: ModeRun, load: Workload, spec: ServerSpec, servers: int) -> float:
    """The highest speed-up per trained token over sync that ANY colocated schedule could reach generating the tokens
    ``run`` trained, whatever its batch composition and staleness: their decode work spread evenly over the servers
    (:func:`~verl_partial.sim.bound.work_floor`, prefill left out, the one-token-per-step term made negligible by a
    staleness as long as the run), against sync's measured rate."""
    floor = max(
        work_floor(run.trained_lengths, load.prompt_len, cost, servers, len(run.seconds))
        for cost in StepCostFloor.of_server(spec)
    )
    return float(np.mean(run.tokens_trained) / floor / _rate(sync))


def row(run: ModeRun, sync: ModeRun, load: Workload, spec: ServerSpec, servers: int) -> dict[str, Any]:
    """One table row; ``run`` and ``sync`` cover the same measured steps."""
    windows = [slice(start, start + WINDOW) for start in range(0, len(run.seconds) - WINDOW + 1, WINDOW)]
    per_window = [_rate(run, w) / _rate(sync, w) for w in windows]
    ks_windows = [
        ks_distance(np.concatenate(run.trained_lengths[w]), np.concatenate(sync.trained_lengths[w])) for w in windows
    ]
    return {
        "speedup_per_token": _rate(run) / _rate(sync),
        "speedup_window_min": min(per_window),
        "speedup_window_max": max(per_window),
        "phase_s_min": float(np.min(run.seconds)),
        "phase_s_max": float(np.max(run.seconds)),
        "ks_window_max": max(ks_windows),
        "ks_vs_unbiased": ks_distance(run.lengths, load.reference_lengths()),
        "max_delay_steps": float(run.waits.max()),
        # Bounds: for the batches this run trained at its staleness (step time, sim/run.py's ceiling), and for any
        # schedule of the same tokens (work).
        "bound_its_batches": ceiling(sync, run, load, spec, servers),
        "work_bound_per_token": work_bound(run, sync, load, spec, servers),
        "staleness_max": float(np.max(run.staleness_max)),
        "discarded_fraction": float(np.sum(run.tokens_discarded) / max(1.0, np.sum(run.tokens_generated))),
    }


def measure(steps: int, report: dict[str, Any], json_path: Path | None) -> None:
    """Appends rows to ``report["rows"]``, rewriting ``json_path`` after each, so a long run can be read early."""
    for size, (spec, servers) in SETUPS.items():
        for tail in (8.0, 20.0):
            load = Workload(batch=128, n=16, p50=1024, p99_over_p50=tail, response_length=32768, prompts=512)
            configs = mode_configs(load.batch)
            sync = simulate(configs["sync"], load, spec, servers, WARMUP + steps).steady(WARMUP)
            variants = [(mode, configs[mode]) for mode in MODES]
            if (size, tail) == ("7B", 8.0):
                variants += [
                    (f"{mode} K={k}", dataclasses.replace(configs[mode], length_window_steps=k))
                    for mode in ("tail", "tail_on_policy")
                    for k in ABLATION
                    if k != configs[mode].length_window_steps
                ]
            for name, config in variants:
                run = simulate(config, load, spec, servers, WARMUP + steps).steady(WARMUP)
                figures = row(run, sync, load, spec, servers)
                report["rows"].append({"model": size, "tail": tail, "mode": name, **figures})
                print(json.dumps(report["rows"][-1]), flush=True)
                if json_path:
                    json_path.write_text(json.dumps(report, indent=1) + "\n")


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | p99/p50 | mode | speed-up per trained token | over 8-step windows | shortest / longest phase s | "
        "bound for its batches | work bound, any schedule | KS vs sync, worst 8-step window | KS vs unbiased | "
        "longest delay (steps) | staleness max | thrown away |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tail']:.0f} | {r['mode']} | {r['speedup_per_token']:.2f}x | "
            f"{r['speedup_window_min']:.2f}-{r['speedup_window_max']:.2f}x | "
            f"{r['phase_s_min']:.0f} / {r['phase_s_max']:.0f} | {r['bound_its_batches']:.2f}x | "
            f"{r['work_bound_per_token']:.2f}x | {r['ks_window_max']:.3f} | {r['ks_vs_unbiased']:.3f} | "
            f"{r['max_delay_steps']:.0f} | {r['staleness_max']:.0f} | {r['discarded_fraction']:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32, help="measured steps per mode (a multiple of 8)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--from-json", type=Path, help="render stored rows, run nothing")
    parser.add_argument("--out", type=Path, help="markdown file whose sim-length-batching block is replaced")
    args = parser.parse_args()
    if args.steps % WINDOW:
        raise SystemExit(f"--steps must be a multiple of {WINDOW}, got {args.steps}")
    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        started = time.process_time()
        report = {"date": _dt.date.today().isoformat(), "steps": args.steps, "warmup": WARMUP, "rows": []}
        measure(args.steps, report, args.json)
        report["cpu_seconds"] = time.process_time() - started
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
    text = (
        f"Simulated {report['date']} (`python -m benchmarks.sim_length_batching`, {report['steps']} measured steps "
        f"per mode after {report['warmup']}, every mode over the same steps as sync).\n\n" + table(report["rows"])
    )
    print(text)
    if args.out:
        write_block(args.out, text, START, END)


if __name__ == "__main__":
    main()
