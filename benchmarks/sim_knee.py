"""Calls per server capped at the GPU's compute knee, simulated: ``partial.max_calls_per_server``.

    python -m benchmarks.sim_knee --json benchmarks/results/sim_knee.json

The real scheduler over the simulator's vLLM servers: rollout phase per trained token of ``+partial=default`` as it
ships (512 calls a server), capped at the server's compute knee (``ServerSpec.compute_knee``: past it a request adds
step time, not throughput) and at half of it, and of sync. One server of 256 slots where requests queue (64 x 8
samples of 7B, lengths median 1,000, p99/p50 8, cap 8,192), on an H100 (knee 210, near its slots) and on an H20
(knee 26, far below them). The emulated-engine check of the same cap is `peer-emulated-prefix` on the evidence page.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks._machine import git_commit, machine
from benchmarks.sim_fill_engine import SEEDS, Shape, measure, ratio, speedups
from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PartialConfig
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import GPUS, MODELS
from verl_partial.sim.run import mode_configs

SHAPES = (
    Shape("H100", "H100-SXM", "Qwen2.5-7B", 64, 8, 1, 1000, 8192),
    Shape("H20", "H20", "Qwen2.5-7B", 64, 8, 1, 1000, 8192),
)


def knee_configs(shape: Shape, spec: ServerSpec) -> dict[str, PartialConfig]:
    """Sync and ``default`` uncapped (512 calls per server, the default before ``auto``), at the knee (the shipped
    ``auto``: each simulated server names its GPU) and at half of it (how far below the knee a cap may go)."""
    modes = mode_configs(shape.batch)
    default = modes["default"]
    return {
        "sync": modes["sync"],
        "default": dataclasses.replace(default, max_calls_per_server=CALLS_PER_SERVER_CEILING),
        "default_knee": default,
        "default_half_knee": dataclasses.replace(default, max_calls_per_server=max(1, spec.compute_knee // 2)),
    }


def summary(rows: list[dict[str, Any]], knees: dict[str, int]) -> str:
    """Per shape, the capped ``default`` over the uncapped one, and both over sync, seed by seed."""
    parts = []
    for shape in dict.fromkeys(row["shape"] for row in rows):
        parts.append(
            f"{shape} (knee {knees[shape]}): over uncapped, at the knee "
            f"{ratio(speedups(rows, shape, 'default', 'default_knee'))}, at half "
            f"{ratio(speedups(rows, shape, 'default', 'default_half_knee'))}; over sync, uncapped "
            f"{ratio(speedups(rows, shape, 'sync', 'default'))}, at the knee "
            f"{ratio(speedups(rows, shape, 'sync', 'default_knee'))}"
        )
    return "; ".join(parts)


def knees(shapes: tuple[Shape, ...] = SHAPES) -> dict[str, int]:
    """Each shape's compute knee, in decoding requests."""
    return {shape.name: ServerSpec(GPUS[shape.gpu], MODELS[shape.model]).compute_knee for shape in shapes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results (with date, command and commit) here")
    args = parser.parse_args(argv)
    rows = measure(SHAPES, knee_configs)
    print(summary(rows, knees()))
    if args.json:
        command = "python -m benchmarks.sim_knee " + " ".join(sys.argv[1:] if argv is None else argv)
        head = {"command": command.strip(), "machine": machine(), "commit": git_commit(), "label": "simulated"}
        body = {"seeds": list(SEEDS), "knees": knees(), "rows": rows}
        args.json.write_text(json.dumps(head | body, indent=1) + "\n")


if __name__ == "__main__":
    main()
