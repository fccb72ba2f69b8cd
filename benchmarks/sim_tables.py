"""Markdown tables of docs/method/gpu-simulator.md from benchmarks/results/sim_projection.json (no simulation here).

Results written before the modes took the preset names label ``restart`` as ``partial`` and ``default`` as
``stream``; they are read under today's names (``RENAMED_MODES``), so stored and fresh results give the same tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verl_partial.sim.run import RENAMED_MODES

MODE_NAMES = {
    "sync": "sync",
    "restart": "`restart`, extra 4 (the previous `default`)",
    "keep": "`keep` (default + keep)",
    "kimi": "`kimi` (budget 1024, extra 8, keep)",
    "on_policy": "`on_policy` (staleness 0, longest first)",
    "on_policy_over": "on_policy + 32 extra groups (restart)",
    "keep_quarter": "`keep` + 32 extra groups (a quarter of the batch)",
    "default": "**`default`** (wait + refill, staleness 1)",
}


def _mode(row: dict) -> str:
    return RENAMED_MODES.get(row["mode"], row["mode"])


def projection_table(rows: list[dict]) -> str:
    lines = [
        "| model | p99/p50 | mode | rollout s/step (mean ± std) | speed-up vs sync | % of ref. "
        "| staleness mean / max | tokens thrown away | KS vs unbiased | max group wait (steps) "
        "| bound for its own batches at its staleness |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['tail']:.0f} | {MODE_NAMES[_mode(row)]} | {row['rollout_s']:.1f} ± "
            f"{row['rollout_s_std']:.1f} | {row['speedup']:.2f}x | {row['share_of_limit']:.0%} | "
            f"{row['staleness_mean']:.2f} / {row['staleness_max']:.0f} | {row['discarded_fraction']:.1%} | "
            f"{row['ks_vs_sync']:.3f} | {row['max_group_wait']:.0f} | {row['ceiling_at_its_staleness']:.2f}x |"
        )
    return "\n".join(lines)


def bound_table(rows: list[dict]) -> str:
    """Per shape: how far sync runs above its floor, the staleness-1 bound for sync's (unbiased) batch composition
    (schedules that regroup samples into other batches are not covered), the share of the reference rate at that
    bound, and where the default preset stands."""
    lines = [
        "| model | p99/p50 | sync / its floor | bound at staleness <= 1 | % of ref. at the bound "
        "| `default` speed-up | `default` / bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_shape: dict[tuple[str, float], dict[str, dict]] = {}
    for row in rows:
        by_shape.setdefault((row["model"], row["tail"]), {})[_mode(row)] = row
    for (model, tail), modes in by_shape.items():
        sync, default = modes["sync"], modes["default"]
        bound = sync["ceiling_at_staleness_1"]
        lines.append(
            f"| {model} | {tail:.0f} | {sync['ceiling_at_its_staleness']:.2f} | {bound:.2f}x | "
            f"{min(1.0, sync['share_of_limit'] * bound):.0%} | {default['speedup']:.2f}x | "
            f"{default['speedup'] / bound:.0%} |"
        )
    return "\n".join(lines)


def reference_rate_table(rows: list[dict]) -> str:
    seen: dict[tuple[str, float], float] = {}
    for row in rows:
        seen[(row["model"], row["tail"])] = row["limit_tokens_per_s"]
    lines = ["| model | p99/p50 | reference rate, tokens/s (8 GPUs) |", "|---|---:|---:|"]
    lines += [f"| {model} | {tail:.0f} | {limit:,.0f} |" for (model, tail), limit in seen.items()]
    return "\n".join(lines)


def bias_table(rows: list[dict]) -> str:
    lines = [
        "| staleness policy | extra_groups | speed-up vs sync | KS vs unbiased | mean trained length "
        "| tokens thrown away | staleness mean / max | max group wait (steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['policy']} | {row['extra_groups']} | {row['speedup']:.2f}x | {row['ks_vs_sync']:.3f} | "
            f"{row['mean_trained_length']:.0f} | {row['discarded_fraction']:.1%} | "
            f"{row['staleness_mean']:.2f} / {row['staleness_max']:.0f} | {row['max_group_wait']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default="benchmarks/results/sim_projection.json")
    args = parser.parse_args()
    report = json.loads(Path(args.results).read_text())
    if "projection" in report:
        print(reference_rate_table(report["projection"]), end="\n\n")
        print(projection_table(report["projection"]), end="\n\n")
        print(bound_table(report["projection"]), end="\n\n")
    for key in sorted(k for k in report if k.startswith("bias")):
        print(key, bias_table(report[key]), sep="\n", end="\n\n")


if __name__ == "__main__":
    main()
