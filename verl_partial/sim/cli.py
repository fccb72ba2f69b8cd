"""``verl-partial simulate`` / ``python -m verl_partial.sim``: project partial rollout onto your GPUs and workload.

Runs verl-partial's real scheduler against a roofline model of vLLM servers in virtual time (a few seconds of CPU
per simulated step) and prints, per mode, the rollout seconds per step (mean, shortest and longest phase: a
scheduler that alternates short and long phases shows it there), the speed-up over synchronous rollout,
the share of the reference rate (every server decoding at full concurrency at the mean context: an estimate, not a
limit), staleness, thrown-away tokens, the length bias of what is trained, and the bound: the highest speed-up any
colocated schedule that trains those same batches could reach at that staleness (verl_partial/sim/bound.py;
schedules that regroup samples into other batches are not covered). The model, its sources and its validation
error are in docs/method/gpu-simulator.md; the bound method in docs/method/gpu-simulator.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from collections.abc import Sequence

from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import GPUS, MODELS, ModelSpec
from verl_partial.sim.run import RENAMED_MODES, ceiling, mode_configs, simulate, summarize, throughput_limit
from verl_partial.sim.workload import Workload

COLUMNS = (
    ("rollout_s", "rollout s/step", "{:.1f}"),
    ("rollout_s_min", "shortest phase s", "{:.1f}"),
    ("rollout_s_max", "longest phase s", "{:.1f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("share_of_limit", "% of reference rate", "{:.0%}"),
    ("staleness_mean", "staleness mean", "{:.2f}"),
    ("staleness_max", "max", "{:.0f}"),
    ("discarded_fraction", "discarded", "{:.1%}"),
    ("ks_vs_sync", "KS vs sync", "{:.3f}"),
    ("max_group_wait", "max wait (steps)", "{:.0f}"),
    ("ceiling", "bound for its own batches at its staleness", "{:.2f}x"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", choices=sorted(MODELS), default="Qwen2.5-7B", help="model preset (config.json shape)")
    model.add_argument("--model-params", type=float, help="dense model of this many parameters (Qwen2.5-like shape)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H100-SXM")
    parser.add_argument("--gpus", type=int, default=8, help="rollout GPUs in total")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of one vLLM server")
    parser.add_argument("--batch", type=int, default=128, help="prompts per step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (rollout.n)")
    parser.add_argument("--p50", type=float, default=1024, help="median response length, tokens")
    parser.add_argument("--p99", type=float, help="99th percentile of the response length (default 8 x p50)")
    parser.add_argument("--response-length", type=int, default=32768, help="data.max_response_length")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4096, help="prompts in the data set (epochs cycle over it)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.80)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="what-if: fixed cost per engine step (default 0, as validated)",
    )
    parser.add_argument("--steps", type=int, default=10, help="simulated steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages")
    parser.add_argument(
        "--modes",
        default="sync,restart,keep,kimi,on_policy,default",
        help=f"comma list of {sorted(mode_configs(4))} (the +partial presets under their names, and variants)",
    )
    parser.add_argument("--extra-groups", type=int, help="override partial.extra_groups of every non-sync mode")
    parser.add_argument("--json", help="also write the rows to this JSON file")


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model = ModelSpec.dense(args.model_params) if args.model_params else MODELS[args.model]
    if args.gpus % args.tp:
        raise ValueError(f"--gpus ({args.gpus}) must be a multiple of --tp ({args.tp})")
    spec = ServerSpec(
        GPUS[args.gpu],
        model,
        tp=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        step_overhead_s=args.step_overhead_ms / 1e3,
    )
    workload = Workload(
        batch=args.batch,
        n=args.n,
        p50=args.p50,
        p99_over_p50=(args.p99 / args.p50) if args.p99 else 8.0,
        response_length=args.response_length,
        prompt_len=args.prompt_length,
        prompts=args.prompts,
    )
    servers = args.gpus // args.tp
    configs = mode_configs(args.batch)
    modes = [_current_mode_name(mode.strip()) for mode in args.modes.split(",")]
    unknown = sorted(set(modes) - set(configs))
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; allowed {sorted(configs)}")
    limit = throughput_limit(spec, servers, workload)
    print(
        f"{model.name} on {args.gpus} x {args.gpu} (TP{args.tp}, {servers} servers, KV cache "
        f"{spec.kv_capacity_tokens:,} tokens/server); {args.batch} x {args.n} per step, p50 {args.p50:.0f}, "
        f"p99/p50 {workload.p99_over_p50:.1f}, cap {args.response_length}; reference rate {limit:,.0f} tokens/s",
        flush=True,
    )
    runs = {}
    for mode in ["sync", *[m for m in modes if m != "sync"]]:
        config = configs[mode]
        if args.extra_groups is not None and mode != "sync":
            config = dataclasses.replace(config, extra_groups=args.extra_groups)
        runs[mode] = simulate(config, workload, spec, servers, args.steps).steady(args.warmup)
    rows = {
        mode: {
            **summarize(record, runs["sync"], workload, limit),
            "ceiling": ceiling(runs["sync"], record, workload, spec, servers),
        }
        for mode, record in runs.items()
        if mode in modes
    }
    print(
        "bound: the highest speed-up over sync of any schedule that trains those same batches at that staleness "
        "(regrouping samples into other batches is not covered; docs/method/gpu-simulator.md); "
        f"bound (sync's batch composition) at staleness <= 1: "
        f"{ceiling(runs['sync'], runs['sync'], workload, spec, servers, 1):.2f}x"
    )
    print("| mode | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for mode, row in rows.items():
        print(f"| {mode} | " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"limit_tokens_per_s": limit, "rows": rows}, out, indent=2)
    return rows


def _current_mode_name(mode: str) -> str:
    """``mode``, or the preset name it was renamed to (with a warning naming both)."""
    if mode not in RENAMED_MODES:
        return mode
    warnings.warn(
        f"--modes {mode} is deprecated: it is the +partial={RENAMED_MODES[mode]} preset, use --modes "
        f"{RENAMED_MODES[mode]}",
        FutureWarning,
        stacklevel=2,
    )
    return RENAMED_MODES[mode]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-partial simulate", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0
