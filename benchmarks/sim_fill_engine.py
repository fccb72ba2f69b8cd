"""Admission by the engines' free capacity, simulated: ``partial.fill_engine`` and ``partial.kv_tokens_per_server``.

    python -m benchmarks.sim_fill_engine --json benchmarks/results/sim_fill_engine.json

The real scheduler over the simulator's vLLM servers: rollout phase per trained token of ``+partial=default``, with
``fill_engine`` off (admission by finished groups), as it ships (calls capped by the KV cache each server reports), and
with that cap off (``kv_tokens_per_server=off``), and of sync, on three servers: 7B on H100s (256 slots, lengths median
1,000, p99/p50 8, cap 8,192) that never fill (fewer samples in flight than slots, even at the staleness bound) and that
queue (more samples per batch than slots); and 32B on H20s (256 slots, median 2,048, cap 16,384) whose KV cache (33,569
tokens a server) holds far fewer answers than slots, so vLLM preempts and recomputes. Seeds vary the length draws.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._machine import git_commit, machine
from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PartialConfig
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import GPUS, MODELS
from verl_partial.sim.run import mode_configs, simulate
from verl_partial.sim.workload import Workload

SEEDS = (0, 1, 2)
STEPS, WARMUP = 8, 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One server set and workload: ``batch`` prompts x ``n`` samples a step on ``servers`` servers."""

    name: str
    gpu: str
    model: str
    batch: int
    n: int
    servers: int
    p50: float
    response_length: int


# 256 samples on 512 slots never fill them, even with the staleness bound's 2 batches in flight; 512 samples on 256
# slots queue; 1,024 answers of thousands of tokens on 8 servers whose cache holds about 16 of them each.
SHAPES = (
    Shape("never fills", "H100-SXM", "Qwen2.5-7B", 32, 8, 2, 1000, 8192),
    Shape("queues", "H100-SXM", "Qwen2.5-7B", 64, 8, 1, 1000, 8192),
    Shape("KV-bound", "H20", "Qwen2.5-32B", 64, 16, 8, 2048, 16384),
)


def admission_configs(shape: Shape, spec: ServerSpec) -> dict[str, PartialConfig]:
    """Sync, ``default``, and ``default`` with admission by finished groups and with the KV cap off."""
    modes = mode_configs(shape.batch)
    # Calls per server uncapped by the GPU's knee, as when this was measured: the knee is sim_knee's subject.
    default = dataclasses.replace(modes["default"], max_calls_per_server=CALLS_PER_SERVER_CEILING)
    return {
        "sync": modes["sync"],
        "default": default,
        "default_by_groups": dataclasses.replace(default, fill_engine=False),
        "default_kv_off": dataclasses.replace(default, kv_tokens_per_server="off"),
    }


def measure(
    shapes: tuple[Shape, ...] = SHAPES,
    configs_of: Callable[[Shape, ServerSpec], dict[str, PartialConfig]] = admission_configs,
) -> list[dict[str, Any]]:
    """Each shape's modes (``configs_of`` names them) over :data:`SEEDS`, rollout phase per trained token."""
    rows = []
    for shape in shapes:
        spec = ServerSpec(gpu=GPUS[shape.gpu], model=MODELS[shape.model], max_num_seqs=256)
        for name, config in configs_of(shape, spec).items():
            per_token, preemptions = [], []
            for seed in SEEDS:
                workload = Workload(batch=shape.batch, n=shape.n, p50=shape.p50, p99_over_p50=8,
                                    response_length=shape.response_length, seed=seed)  # fmt: skip
                whole = simulate(config, workload, spec, servers=shape.servers, steps=STEPS)
                run = whole.steady(WARMUP)
                per_token.append(1e3 * sum(run.seconds) / sum(run.tokens_trained))
                preemptions.append(whole.engine.preemptions)
            rows.append({**dataclasses.asdict(shape), "shape": shape.name, "mode": name,
                         "ms_per_trained_token": per_token, "preemptions": preemptions})  # fmt: skip
    return rows


def speedups(rows: list[dict[str, Any]], shape: str, base: str, mode: str) -> list[float]:
    """``base``'s time per trained token over ``mode``'s, seed by seed (above 1: ``mode`` is faster)."""
    by_mode = {row["mode"]: row["ms_per_trained_token"] for row in rows if row["shape"] == shape}
    return [b / m for b, m in zip(by_mode[base], by_mode[mode], strict=True)]


def ratio(values: list[float]) -> str:
    return f"{statistics.fmean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def summary(rows: list[dict[str, Any]]) -> str:
    """Per shape, ``default`` over itself with ``fill_engine`` off (admission by finished groups) and over sync; and
    where the cache binds (a mode preempted), ``default`` with the cache cap off over sync."""
    parts = []
    for shape in dict.fromkeys(row["shape"] for row in rows):
        text = (f"{shape}: {ratio(speedups(rows, shape, 'default_by_groups', 'default'))} over fill_engine off, "
                f"{ratio(speedups(rows, shape, 'sync', 'default'))} over sync")  # fmt: skip
        preempted = any(sum(row.get("preemptions", [0])) for row in rows if row["shape"] == shape)
        if preempted and any(row["mode"] == "default_kv_off" for row in rows if row["shape"] == shape):
            text += f", KV cap off {ratio(speedups(rows, shape, 'sync', 'default_kv_off'))}"
        parts.append(text)
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
