"""GPU-regime projection and length-bias sweep with the simulator (method and results: docs/method/gpu-simulator.md).

Projection: Qwen2.5-7B (TP1, 8 servers) and Qwen2.5-32B (TP2, 4 servers) on 8 x H100 SXM; 128 prompts x 16
samples per step; prompt 256 tokens; response lengths lognormal with median 1,024 and p99/p50 of 8 or 20, capped
at 32,768; a 512-prompt data set (an epoch every 4 steps, so the on-policy mode has each prompt's history from
the second epoch on). Modes: sync, the restart preset (the previous default), keep, kimi, on_policy, on_policy with
over-provisioning, keep with a quarter of the batch in extra groups, and the default preset (staleness_policy=wait +
refill: streaming admission at a hard staleness bound of 1).

Length bias: one Qwen2.5-7B server (one GPU's share of the projection: 16 prompts x 16 per step), the heavier
tail (p99/p50 = 20), every staleness policy x extra_groups in {1/16, 1/4, 1/2, 1} x batch, plus wait + refill; KS of
trained lengths to the unbiased distribution, thrown-away tokens, longest wait of a group in steps, speed-up.

All parameters were fixed before the first run; nothing is tuned to a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from verl_partial.config.partial import PartialConfig
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import H100_SXM, QWEN25_7B, QWEN25_32B
from verl_partial.sim.run import ceiling, mode_configs, simulate, summarize, throughput_limit
from verl_partial.sim.workload import Workload

NO_STALLS = {"request_timeout_s": 1e9}
SETUPS = {"7B": (ServerSpec(H100_SXM, QWEN25_7B, tp=1), 8), "32B": (ServerSpec(H100_SXM, QWEN25_32B, tp=2), 4)}
MODES = ("sync", "restart", "keep", "kimi", "on_policy", "on_policy_over", "keep_quarter", "default")
# Steps left out before a mode is measured: the partial modes start with an empty pool; the on-policy modes need
# one epoch (4 steps) of prompt history before their estimates exist. Sync is measured over the same steps as each
# mode it is compared with (its own row: the partial modes' steps).
PARTIAL_WARMUP = 2
WARMUP = {"on_policy": 4, "on_policy_over": 4}
BIAS_WARMUP = 4  # the length-bias sweep: every policy and sync over the same steps after these


def projection(steps: int, step_overhead_s: float = 0.0) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for size, (spec, servers) in SETUPS.items():
        spec = dataclasses.replace(spec, step_overhead_s=step_overhead_s)
        for tail in (8.0, 20.0):
            load = Workload(batch=128, n=16, p50=1024, p99_over_p50=tail, response_length=32768, prompts=512)
            limit = throughput_limit(spec, servers, load)
            configs = mode_configs(load.batch)
            configs["keep_quarter"] = PartialConfig(
                staleness_policy="keep", extra_groups=load.batch // 4, refill=False, **NO_STALLS
            )
            sync_run = simulate(configs["sync"], load, spec, servers, steps + max(WARMUP.values()))
            for mode in MODES:
                warmup = WARMUP.get(mode, PARTIAL_WARMUP)
                sync = sync_run.steady(warmup, steps)
                if mode == "sync":
                    run = sync
                else:
                    run = simulate(configs[mode], load, spec, servers, steps + warmup).steady(warmup)
                row = summarize(run, sync, load, limit)
                # What this run trained, at its staleness; and sync's (unbiased) batches at staleness 1.
                row["ceiling_at_its_staleness"] = ceiling(sync, run, load, spec, servers)
                row["ceiling_at_staleness_1"] = ceiling(sync, sync, load, spec, servers, 1)
                row["measured_steps"] = [warmup, warmup + steps]
                rows.append({"model": size, "tail": tail, "mode": mode, "limit_tokens_per_s": limit, **row})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def bias_sweep(steps: int, batch: int) -> list[dict[str, object]]:
    """One 7B server's share of a job (``batch`` prompts x 16 per step), every staleness policy x extra_groups in
    {1/16, 1/4, 1/2, 1} x batch, ``steps`` measured steps after 4 warm-up steps."""
    spec = SETUPS["7B"][0]
    load = Workload(batch=batch, n=16, p50=1024, p99_over_p50=20.0, response_length=32768, prompts=4096)
    limit = throughput_limit(spec, 1, load)
    sync = simulate(mode_configs(batch)["sync"], load, spec, 1, steps + BIAS_WARMUP).steady(BIAS_WARMUP)
    rows = [{"policy": "sync", "extra_groups": 0, **summarize(sync, sync, load, limit)}]
    print(json.dumps(rows[-1]), flush=True)
    sweep = [
        (policy, extra, False)
        for policy in ("restart", "drop", "keep", "wait")
        for extra in sorted({max(1, batch // 16), batch // 4, batch // 2, batch})
    ]
    for policy, extra, refill in [*sweep, ("wait", 0, True)]:
        config = PartialConfig(extra_groups=extra, staleness_policy=policy, refill=refill, **NO_STALLS)
        run = simulate(config, load, spec, 1, steps + BIAS_WARMUP).steady(BIAS_WARMUP)
        name = f"{policy} + refill" if refill else policy
        rows.append({"policy": name, "extra_groups": extra, **summarize(run, sync, load, limit)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/sim_projection.json")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per mode")
    parser.add_argument("--bias-steps", type=int, default=40)
    parser.add_argument("--bias-batch", type=int, default=16, help="prompts per step on the one simulated server")
    parser.add_argument("--only", choices=("projection", "bias"))
    parser.add_argument(
        "--step-overhead-ms", type=float, default=0.0, help="what-if fixed cost per engine step (0 = the model)"
    )
    args = parser.parse_args()
    started = time.time()
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    if args.only != "bias":
        report["projection"] = projection(args.steps, args.step_overhead_ms / 1e3)
    if args.only != "projection":
        report[f"bias_batch{args.bias_batch}"] = bias_sweep(args.bias_steps, args.bias_batch)
    report["cpu_seconds"] = time.time() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
