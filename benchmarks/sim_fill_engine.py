"""Admission by the engines' free slots (``partial.fill_engine``) against admission by finished groups, simulated.

    python -m benchmarks.sim_fill_engine --json benchmarks/results/sim_fill_engine.json

The real scheduler over the simulator's vLLM servers (7B on H100s, ``max_num_seqs`` 256, lengths lognormal with
median 1,000 and p99/p50 8, cap 8,192): rollout phase per trained token of ``+partial=default`` with and without
``fill_engine``, and of sync, on a server that never fills (fewer samples in flight than slots, even at the staleness
bound) and on one that queues (more samples per batch than slots). Seeds vary the length draws.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks._machine import git_commit, machine
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import GPUS, MODELS
from verl_partial.sim.run import mode_configs, simulate
from verl_partial.sim.workload import Workload

SEEDS = (0, 1, 2)
STEPS, WARMUP = 8, 2
# (name, prompts per batch, samples per prompt, servers): 256 samples on 512 slots never fill them, even with the
# staleness bound's 2 batches in flight; 512 samples on 256 slots queue.
SHAPES = (("never fills", 32, 8, 2), ("queues", 64, 8, 1))


def measure() -> list[dict[str, Any]]:
    spec = ServerSpec(gpu=GPUS["H100-SXM"], model=MODELS["Qwen2.5-7B"], max_num_seqs=256)
    rows = []
    for shape, batch, n, servers in SHAPES:
        modes = mode_configs(batch)
        configs = {
            "sync": modes["sync"],
            "default": modes["default"],
            "default_by_groups": dataclasses.replace(modes["default"], fill_engine=False),
        }
        for name, config in configs.items():
            per_token = []
            for seed in SEEDS:
                workload = Workload(batch=batch, n=n, p50=1000, p99_over_p50=8, response_length=8192, seed=seed)
                run = simulate(config, workload, spec, servers=servers, steps=STEPS).steady(WARMUP)
                per_token.append(1e3 * sum(run.seconds) / sum(run.tokens_trained))
            rows.append({"shape": shape, "batch": batch, "n": n, "servers": servers, "mode": name,
                         "ms_per_trained_token": per_token})  # fmt: skip
    return rows


def speedups(rows: list[dict[str, Any]], shape: str, base: str, mode: str) -> list[float]:
    """``base``'s time per trained token over ``mode``'s, seed by seed (above 1: ``mode`` is faster)."""
    by_mode = {row["mode"]: row["ms_per_trained_token"] for row in rows if row["shape"] == shape}
    return [b / m for b, m in zip(by_mode[base], by_mode[mode], strict=True)]


def summary(rows: list[dict[str, Any]]) -> str:
    parts = []
    for shape, *_ in SHAPES:
        fill = speedups(rows, shape, "default_by_groups", "default")
        sync = speedups(rows, shape, "sync", "default")
        parts.append(f"{shape}: {statistics.fmean(fill):.2f}x ({min(fill):.2f}-{max(fill):.2f}) over admission by "
                     f"finished groups, {statistics.fmean(sync):.2f}x over sync")  # fmt: skip
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results (with date, command and commit) here")
    args = parser.parse_args(argv)
    rows = measure()
    print(summary(rows))
    if args.json:
        command = "python -m benchmarks.sim_fill_engine " + " ".join(sys.argv[1:] if argv is None else argv)
        head = {"command": command.strip(), "machine": machine(), "commit": git_commit(), "label": "simulated"}
        args.json.write_text(json.dumps(head | {"seeds": list(SEEDS), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
