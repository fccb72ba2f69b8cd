"""Learning curves: synchronous vs partial rollout through verl's real GRPO trainer, and the run-level length bias.

    python -m benchmarks.learning_curves                                       # the documented matrix (~30 min)
    python -m benchmarks.learning_curves --report-only                         # tables + plot from saved results

Method. Every run is ``python -m verl.trainer.main_ppo`` built by :func:`verl_partial.cli.demo_command` (the demo:
countdown task, tiny Qwen2, our CPU engine, 8 prompts x 4 samples per step), one run at a time, each through
benchmarks/harness.py (its one lock, the same environment and threads in every mode, the machine record) with a pause
between runs so other jobs on a shared machine can take the lock. Runs are
interleaved seed-major (seed 0: every mode, then seed 1: every mode, ...) so machine noise falls on all modes
alike. The modes:

* ``sync``: no ``+partial`` (verl's own synchronous rollout);
* ``restart``: the previous ``+partial=default`` (``staleness_policy=restart``, ``extra_groups=4``, no refill);
* ``keep``: ``+partial=default`` with ``partial.staleness_policy=keep``, ``partial.refill=false`` and
  ``partial.extra_groups=<--keep-extra-groups>``;
* ``kimi``: ``+partial=kimi``;
* ``on_policy``: ``+partial=on_policy``;
* ``stream``: today's ``+partial=default`` (``staleness_policy=wait``, ``refill=true``, no extra groups);
* ``tail``, ``tail_on_policy``: ``+partial=tail`` / ``+partial=tail_on_policy`` (length-aware windows of 4 steps).

What varies with the seed: ``data.seed`` (verl's shuffle of the training prompts; the same order for every mode at
one seed, though partial modes draw extra prompts, so their orders drift apart) and the CPU engine's sampling,
which is unseeded (fresh OS entropy every run). The model's initial weights are the demo's pretrained model (fixed;
asset seed 0). Every other setting is the same for every mode (``--override`` applies to all).

Everything per step is read from what the trainer itself logged: verl's file logger (``VERL_FILE_LOGGER_PATH``:
``critic/score/mean``, ``timing_s/step``, ``timing_s/gen``, ``response_length/mean``, validation reward, every
``partial/*`` metric) and verl's rollout dump (``trainer.rollout_data_dir``: the decoded response of every trained
sample). Wall time per step is ``timing_s/step`` minus ``timing_s/testing`` (verl times validation inside the
step). Trained response lengths for the length-bias check are the dumped responses re-tokenised with the demo
tokenizer; verl decodes with ``skip_special_tokens``, so the end-of-turn token is lost and added back for every
response shorter than ``data.max_response_length``. The re-tokenised mean is checked against the exact
``response_length/mean`` of the same step and the largest gap is reported (``length_proxy_max_gap``).

Length bias at run level: the two-sample Kolmogorov-Smirnov distance between the trained lengths of a partial mode
and those of ``sync``, each pooled over all steps and seeds (goal <= 0.05), with two references: the KS distance
between ``sync``'s own seeds (seed 0 against the others: the noise floor at this run length) and the asymptotic 5 %
critical value ``1.358 * sqrt((n + m) / (n m))`` (which assumes independent samples; the 4 samples of a group are
not, so it is optimistic). How long groups wait: ``partial/group_wait_steps/max`` over every step and seed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._machine import cpu_name, git_commit
from benchmarks.harness import RunSettings, ray_overrides, run_env, run_trainer
from verl_partial.cli import DEFAULT_CACHE, demo_command
from verl_partial.demo.assets import DemoAssets, build_assets, hydra_overrides
from verl_partial.sim.stats import ks_distance

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results" / "learning_curves.json"
PLOT = ROOT / "docs" / "img" / "learning_curves.png"
RUN_TIMEOUT_S = 1800
DEFAULT_ASSET_TRAIN_STEPS = 1500  # build_assets' default: the demo's own model
SCORE = "critic/score/mean"
# Per-step metrics kept in the results (all those present; partial/* only exist in partial modes).
KEPT_METRICS = (
    SCORE,
    "timing_s/step",
    "timing_s/gen",
    "timing_s/testing",
    "response_length/mean",
    "partial/resumed_fraction",
    "partial/staleness/mean",
    "partial/staleness/max",
    "partial/tokens_generated",
    "partial/tokens_trained",
    "partial/tokens_discarded",
    "partial/restarted_samples",
    "partial/length/trained_mean",
    "partial/length/finished_mean",
    "partial/group_wait_steps/mean",
    "partial/group_wait_steps/max",
)
VAL_PREFIX = "val-core/"
# The default preset before streaming admission (restart, 4 extra groups); every curve in the docs was run this way.
MODE_ORDER = ("sync", "restart", "keep", "kimi", "on_policy", "stream", "tail", "tail_on_policy")
KS_CRITICAL_C = 1.358  # two-sample KS, alpha = 0.05


@dataclass(frozen=True)
class Mode:
    """One column of the comparison: the ``+partial`` preset (None: synchronous) and overrides on top of it."""

    name: str
    preset: str | None
    overrides: tuple[str, ...] = ()


def modes(keep_extra_groups: int) -> dict[str, Mode]:
    return {
        "sync": Mode("sync", None),
        "restart": Mode("restart", "restart"),
        "keep": Mode(
            "keep",
            "default",
            ("partial.staleness_policy=keep", "partial.refill=false", f"partial.extra_groups={keep_extra_groups}"),
        ),
        "kimi": Mode("kimi", "kimi"),
        "on_policy": Mode("on_policy", "on_policy"),
        "stream": Mode("stream", "default"),
        "tail": Mode("tail", "tail"),
        "tail_on_policy": Mode("tail_on_policy", "tail_on_policy"),
    }


# ------------------------------------------------------------------------------------------------------ running


def run_one(
    mode: Mode,
    seed: int,
    *,
    assets: DemoAssets,
    steps: int,
    val_every: int,
    overrides: list[str],
    work_dir: Path,
) -> dict[str, Any]:
    """One trainer run; returns its per-step metrics, trained lengths and scores, exit status and wall time."""
    output_dir = work_dir / f"{mode.name}_seed{seed}"
    output_dir.mkdir(parents=True, exist_ok=False)
    extra = [
        "trainer.logger=[console,file]",
        f"trainer.test_freq={val_every}",
        f"trainer.val_before_train={str(val_every > 0).lower()}",
        "trainer.save_freq=-1",
        f"trainer.rollout_data_dir={output_dir / 'rollouts'}",
        f"data.seed={seed}",
        *overrides,
        *mode.overrides,
        *ray_overrides(),
    ]
    command = demo_command(
        hydra_overrides(assets), steps=steps, output_dir=output_dir, partial=mode.preset, extra=extra
    )
    settings = RunSettings(timeout_s=RUN_TIMEOUT_S)
    start = time.monotonic()
    run = run_trainer(command, output_dir, run_env(settings, output_dir, {"RAY_DEDUP_LOGS": "0"}), settings)
    wall = time.monotonic() - start
    log = (output_dir / "verl.log").read_text()
    records = read_run(output_dir, assets)
    return {
        "mode": mode.name,
        "seed": seed,
        "returncode": run["returncode"],
        "wall_s": wall,
        "machine": run["machine"],
        "rejected": run["rejected"],
        "error_tail": "" if run["returncode"] == 0 else log[-4000:],
        "steps": records,
    }


def read_run(output_dir: Path, assets: DemoAssets) -> list[dict[str, Any]]:
    """Per step: the kept metrics verl's file logger wrote, plus trained lengths and scores from its rollout dump."""
    from transformers import AutoTokenizer

    logged: dict[int, dict[str, Any]] = {}
    metrics_file = output_dir / "metrics.jsonl"
    if metrics_file.exists():
        for line in metrics_file.read_text().splitlines():
            record = json.loads(line)
            logged.setdefault(int(record["step"]), {}).update(record["data"])
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    records = []
    for step in sorted(logged):
        data = logged[step]
        record: dict[str, Any] = {"step": step}
        record.update({key: float(data[key]) for key in KEPT_METRICS if key in data})
        record.update({key: float(value) for key, value in data.items() if key.startswith(VAL_PREFIX)})
        dump = output_dir / "rollouts" / f"{step}.jsonl"
        if dump.exists():
            rows = [json.loads(line) for line in dump.read_text().splitlines()]
            record["trained_lengths"] = [
                _token_length(tokenizer, row["output"], assets.max_response_length) for row in rows
            ]
            record["trained_scores"] = [float(row["score"]) for row in rows]
        records.append(record)
    return records


def _token_length(tokenizer: Any, text: str, max_response_length: int) -> int:
    """Response tokens of a decoded response: the text re-tokenised, plus the end-of-turn token verl's decode
    dropped (absent only when the response hit ``max_response_length``)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return min(max_response_length, len(ids) + 1)


# ----------------------------------------------------------------------------------------------------- analysis


def ks_critical(n: int, m: int) -> float:
    return KS_CRITICAL_C * math.sqrt((n + m) / (n * m))


def _train_records(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The training steps (``val_before_train`` logs a step 0 holding validation only)."""
    return [record for record in run["steps"] if "timing_s/step" in record]


def _series(run: dict[str, Any], key: str) -> np.ndarray:
    """``key`` at every training step, NaN where it was not logged."""
    return np.array([record.get(key, np.nan) for record in _train_records(run)], dtype=np.float64)


def _val_series(run: dict[str, Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a validation metric, including step 0 (before training)."""
    records = [record for record in run["steps"] if key in record]
    return np.array([r["step"] for r in records]), np.array([r[key] for r in records], dtype=np.float64)


def step_seconds(run: dict[str, Any]) -> np.ndarray:
    """Training wall time per step: verl's ``timing_s/step`` without the validation it times inside the step."""
    testing = np.nan_to_num(_series(run, "timing_s/testing"))
    return _series(run, "timing_s/step") - testing


def ms_per_trained_token(run: dict[str, Any]) -> float:
    """Whole-step milliseconds per trained token over steps >= 2: a mode that trains shorter answers in shorter
    steps is not faster by this measure (issue 20's review of the step-time comparison)."""
    records = _train_records(run)[1:]
    tokens = sum(r["response_length/mean"] * len(r.get("trained_lengths", [])) for r in records)
    return 1e3 * float(np.nansum(step_seconds(run)[1:])) / tokens if tokens else float("nan")


def final_reward(run: dict[str, Any], window: int) -> float:
    """Training reward averaged over the run's last ``window`` steps."""
    return float(np.nanmean(_series(run, SCORE)[-window:]))


def _lengths(runs: list[dict[str, Any]]) -> np.ndarray:
    return np.array([n for run in runs for record in run["steps"] for n in record.get("trained_lengths", [])])


def _val_key(runs: list[dict[str, Any]]) -> str | None:
    keys = sorted({key for run in runs for record in run["steps"] for key in record if key.startswith(VAL_PREFIX)})
    rewards = [key for key in keys if key.endswith("/reward/mean@1")] or [key for key in keys if "mean@" in key]
    return rewards[0] if rewards else None


def _mean_sd(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Per-mode figures from the saved runs (only runs that exited 0)."""
    ok = [run for run in results["runs"] if run["returncode"] == 0 and run["steps"]]
    by_mode = {name: [run for run in ok if run["mode"] == name] for name in MODE_ORDER}
    by_mode = {name: runs for name, runs in by_mode.items() if runs}
    window = results["config"]["final_window"]
    val_key = _val_key(ok)
    sync_lengths = _lengths(by_mode.get("sync", []))
    summary: dict[str, Any] = {"val_key": val_key, "final_window": window, "modes": {}}
    sync_runs = by_mode.get("sync", [])
    if len(sync_runs) >= 2:
        first, rest = _lengths(sync_runs[:1]), _lengths(sync_runs[1:])
        summary["sync_seed_split_ks"] = ks_distance(first, rest)
        summary["sync_seed_split_critical"] = ks_critical(len(first), len(rest))
    proxy_gaps = []
    for run in ok:
        for record in run["steps"]:
            if record.get("trained_lengths") and "response_length/mean" in record:
                proxy_gaps.append(abs(float(np.mean(record["trained_lengths"])) - record["response_length/mean"]))
    summary["length_proxy_max_gap"] = max(proxy_gaps, default=float("nan"))
    for name, runs in by_mode.items():
        finals = [final_reward(run, window) for run in runs]
        seconds = [float(np.nanmean(step_seconds(run)[1:])) for run in runs]  # step 1 carries warm-up
        gen = [float(np.nanmean(_series(run, "timing_s/gen")[1:])) for run in runs]
        lengths = _lengths(runs)
        row: dict[str, Any] = {
            "seeds": [run["seed"] for run in runs],
            "steps": min(len(_train_records(run)) for run in runs),
            "final_reward": _mean_sd(finals),
            "s_per_step": _mean_sd(seconds),
            "gen_s_per_step": _mean_sd(gen),
            "ms_per_trained_token": _mean_sd([ms_per_trained_token(run) for run in runs]),
            "total_train_s": _mean_sd([float(np.nansum(step_seconds(run))) for run in runs]),
            "mean_trained_length": float(lengths.mean()) if len(lengths) else float("nan"),
            "trained_samples": len(lengths),
        }
        if val_key:
            row["final_val_reward"] = _mean_sd([float(_val_series(run, val_key)[1][-1]) for run in runs])
        if name != "sync" and len(sync_lengths) and len(lengths):
            row["ks_vs_sync"] = ks_distance(lengths, sync_lengths)
            row["ks_critical"] = ks_critical(len(lengths), len(sync_lengths))
        if name != "sync":
            generated = sum(float(np.nansum(_series(run, "partial/tokens_generated"))) for run in runs)
            discarded = sum(float(np.nansum(_series(run, "partial/tokens_discarded"))) for run in runs)
            waits = np.concatenate([_series(run, "partial/group_wait_steps/max") for run in runs])
            row.update(
                resumed_fraction=float(
                    np.nanmean(np.concatenate([_series(r, "partial/resumed_fraction") for r in runs]))
                ),
                staleness_mean=float(np.nanmean(np.concatenate([_series(r, "partial/staleness/mean") for r in runs]))),
                staleness_max=float(np.nanmax(np.concatenate([_series(r, "partial/staleness/max") for r in runs]))),
                tokens_generated=generated / len(runs),
                tokens_discarded=discarded / len(runs),
                discarded_fraction=discarded / generated if generated else float("nan"),
                max_group_wait=float(np.nanmax(waits)),
                # Step level: lengths trained vs lengths of every sample that finished in the same step.
                trained_mean_length_step=float(
                    np.nanmean(np.concatenate([_series(r, "partial/length/trained_mean") for r in runs]))
                ),
                finished_mean_length_step=float(
                    np.nanmean(np.concatenate([_series(r, "partial/length/finished_mean") for r in runs]))
                ),
                mean_group_wait=float(
                    np.nanmean(np.concatenate([_series(r, "partial/group_wait_steps/mean") for r in runs]))
                ),
                # Where in the run the waits peak: bounded means the late half is no worse than the early half.
                max_group_wait_first_half=float(
                    np.nanmax(
                        [
                            np.nanmax(_series(r, "partial/group_wait_steps/max")[: len(_train_records(r)) // 2])
                            for r in runs
                        ]
                    )
                ),
                max_group_wait_second_half=float(
                    np.nanmax(
                        [
                            np.nanmax(_series(r, "partial/group_wait_steps/max")[len(_train_records(r)) // 2 :])
                            for r in runs
                        ]
                    )
                ),
            )
        summary["modes"][name] = row
    return summary


def table(summary: dict[str, Any]) -> str:
    header = (
        "| mode | final reward (last {w} steps) | final val reward | steps | s/step | gen s/step | "
        "whole step ms / trained token | resumed fraction | "
        "staleness mean / max | tokens discarded per run | mean trained length | KS vs sync | max group wait |"
    ).format(w=summary["final_window"])
    lines = [header, "|---|" + "---:|" * (header.count("|") - 2)]
    for name, row in summary["modes"].items():

        def pm(key: str, digits: int = 3, row: dict[str, Any] = row) -> str:
            if key not in row:
                return "-"
            mean, sd = row[key]
            return f"{mean:.{digits}f} ± {sd:.{digits}f}"

        partial = name != "sync"
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    pm("final_reward"),
                    pm("final_val_reward"),
                    str(row["steps"]),
                    pm("s_per_step", 2),
                    pm("gen_s_per_step", 2),
                    pm("ms_per_trained_token", 2),
                    f"{row['resumed_fraction']:.3f}" if partial else "-",
                    f"{row['staleness_mean']:.2f} / {row['staleness_max']:.0f}" if partial else "-",
                    f"{row['tokens_discarded']:.0f} ({100 * row['discarded_fraction']:.1f} %)" if partial else "-",
                    f"{row['mean_trained_length']:.1f}",
                    f"{row['ks_vs_sync']:.3f} (crit {row['ks_critical']:.3f})" if "ks_vs_sync" in row else "-",
                    f"{row['max_group_wait']:.0f}" if partial else "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- probe


def probe(assets: DemoAssets, prompts: int, samples: int, seed: int) -> dict[str, Any]:
    """Reward and response length of a demo model before any RL, by answer length (n): is there anything to learn?

    ``samples`` answers per prompt for the first ``prompts`` training prompts, sampled with ``transformers`` at
    temperature 1 (the rollout's setting), scored with the task's own reward. GRPO learns only from groups whose
    rewards differ, so the within-bucket spread matters as much as the mean.
    """
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_partial.demo.task import compute_score

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a light probe beside other jobs; one thread is also how the demo assets are built
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir).eval()
    rows = []
    for _, example in pd.read_parquet(assets.train_parquet).head(prompts).iterrows():
        ids = tokenizer.apply_chat_template(list(example["prompt"]), add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids.repeat(samples, 1),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=assets.max_response_length,
                pad_token_id=tokenizer.pad_token_id,
            )
        truth = example["reward_model"]["ground_truth"]
        for answer in out[:, ids.shape[1] :]:
            text = tokenizer.decode(answer, skip_special_tokens=True)
            length = int((answer != tokenizer.pad_token_id).sum())
            rows.append((len(truth.split()), compute_score("", text, truth), length))
    table = np.array(rows, dtype=np.float64)
    buckets = {}
    for low, high in ((1, 5), (5, 10), (10, 20), (20, 97)):
        mask = (table[:, 0] >= low) & (table[:, 0] < high)
        if mask.any():
            buckets[f"n {low}-{high - 1}"] = {
                "answers": int(mask.sum()),
                "reward_mean": float(table[mask, 1].mean()),
                "reward_sd": float(table[mask, 1].std()),
            }
    return {"reward_mean": float(table[:, 1].mean()), "length_mean": float(table[:, 2].mean()), "by_n": buckets}


# --------------------------------------------------------------------------------------------------------- plot


def _smooth(values: np.ndarray, width: int) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far), NaN-free input assumed."""
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    index = np.arange(1, len(values) + 1)
    start = np.maximum(0, index - width)
    return (cumulative[index] - cumulative[start]) / (index - start)


def plot(results: dict[str, Any], summary: dict[str, Any], path: Path, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [run for run in results["runs"] if run["returncode"] == 0 and run["steps"]]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_step, ax_wall), (ax_val, ax_cdf) = axes
    val_key = summary["val_key"]
    for index, name in enumerate(MODE_ORDER):
        runs = [run for run in ok if run["mode"] == name]
        if not runs:
            continue
        color = f"C{index}"
        n = min(len(_train_records(run)) for run in runs)
        curves = np.array([_smooth(np.nan_to_num(_series(run, SCORE)[:n]), smooth) for run in runs])
        steps = np.arange(1, n + 1)
        mean, sd = curves.mean(0), curves.std(0)
        ax_step.plot(steps, mean, color=color, label=f"{name} (n={len(runs)})")
        ax_step.fill_between(steps, mean - sd, mean + sd, color=color, alpha=0.15)
        clocks = [np.cumsum(np.nan_to_num(step_seconds(run)[:n])) for run in runs]
        grid = np.linspace(max(c[0] for c in clocks), min(c[-1] for c in clocks), 200)
        on_grid = np.array([np.interp(grid, clock, curve) for clock, curve in zip(clocks, curves, strict=True)])
        ax_wall.plot(grid, on_grid.mean(0), color=color, label=name)
        ax_wall.fill_between(
            grid, on_grid.mean(0) - on_grid.std(0), on_grid.mean(0) + on_grid.std(0), color=color, alpha=0.15
        )
        if val_key:
            val_steps = [r["step"] for r in runs[0]["steps"] if val_key in r]
            vals = np.array([[r[val_key] for r in run["steps"] if val_key in r][: len(val_steps)] for run in runs])
            ax_val.errorbar(
                np.array(val_steps) + 0.4 * (index - 2),
                vals.mean(0),
                yerr=vals.std(0),
                color=color,
                marker="o",
                capsize=3,
                label=name,
            )
        lengths = np.sort(_lengths(runs))
        ax_cdf.step(lengths, np.arange(1, len(lengths) + 1) / len(lengths), where="post", color=color, label=name)
    ax_step.set(
        xlabel="training step",
        ylabel=f"{SCORE} ({smooth}-step moving mean)",
        title="reward vs step (mean ± sd over seeds)",
    )
    ax_wall.set(xlabel="training wall time, s (sum of timing_s/step)", ylabel=SCORE, title="reward vs wall time")
    ax_val.set(xlabel="training step", ylabel=val_key or "-", title="validation reward (same 16 prompts for every run)")
    ax_cdf.set(
        xscale="log",
        xlabel="trained response length, tokens",
        ylabel="CDF",
        title="trained lengths, pooled over steps and seeds",
    )
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------------------- main


def _asset_cache(train_steps: int) -> Path:
    """The demo's cache for its own model; a folder beside it for any other (never rebuild the demo's in place)."""
    if train_steps == DEFAULT_ASSET_TRAIN_STEPS:
        return DEFAULT_CACHE
    return DEFAULT_CACHE.with_name(f"demo_train_steps_{train_steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODE_ORDER), choices=MODE_ORDER)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--val-every", type=int, default=16, help="trainer.test_freq (0: no validation)")
    parser.add_argument("--keep-extra-groups", type=int, default=2, help="partial.extra_groups of the keep mode")
    parser.add_argument(
        "--assets-train-steps",
        type=int,
        default=DEFAULT_ASSET_TRAIN_STEPS,
        help="pretraining steps of the demo model (build_assets train_steps); other values build beside the demo cache",
    )
    parser.add_argument("--override", nargs="*", default=[], help="Hydra overrides applied to every mode")
    parser.add_argument("--final-window", type=int, default=16, help="steps averaged for the final reward")
    parser.add_argument("--smooth", type=int, default=8, help="moving-mean width of the plotted reward")
    parser.add_argument("--pause", type=float, default=10.0, help="seconds between runs (lets others take the lock)")
    parser.add_argument("--work-dir", type=Path, default=None, help="run folders (default: a new folder in /tmp)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--report-only", action="store_true", help="summarise and plot --out without running")
    parser.add_argument(
        "--resume", action="store_true", help="add to the runs in --out: skip (mode, seed) pairs that finished there"
    )
    parser.add_argument(
        "--probe",
        type=int,
        nargs="+",
        metavar="TRAIN_STEPS",
        help="no runs: sample demo models pretrained for these many steps and print their reward by n",
    )
    args = parser.parse_args()

    if args.probe:
        for train_steps in args.probe:
            assets = build_assets(_asset_cache(train_steps), train_steps=train_steps)
            print(f"pretraining steps {train_steps}:", json.dumps(probe(assets, prompts=48, samples=4, seed=0)))
        return
    if args.report_only:
        results = json.loads(args.out.read_text())
    else:
        work_dir = args.work_dir or Path(f"/tmp/learning_curves_{_dt.datetime.now(_dt.timezone.utc):%Y%m%d-%H%M%S}")
        table_modes = modes(args.keep_extra_groups)
        assets = build_assets(_asset_cache(args.assets_train_steps), train_steps=args.assets_train_steps)
        results: dict[str, Any] = {
            "config": {
                "command": " ".join(sys.argv),
                "commit": git_commit(),
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "cpu": cpu_name(),
                "steps": args.steps,
                "seeds": args.seeds,
                "val_every": args.val_every,
                "assets_train_steps": args.assets_train_steps,
                "overrides": args.override,
                "modes": {name: [table_modes[name].preset, *table_modes[name].overrides] for name in args.modes},
                "final_window": args.final_window,
            },
            "runs": [],
        }
        if args.resume and args.out.exists():
            previous = json.loads(args.out.read_text())
            results["config"] = {**previous["config"], "resumed_with": results["config"]}
            results["runs"] = [run for run in previous["runs"] if run["returncode"] == 0]
        done = {(run["mode"], run["seed"]) for run in results["runs"]}
        for seed in args.seeds:  # seed-major, modes round-robin: machine noise hits every mode alike
            for name in args.modes:
                if (name, seed) in done:
                    continue
                if results["runs"]:
                    time.sleep(args.pause)
                run = run_one(
                    table_modes[name],
                    seed,
                    assets=assets,
                    steps=args.steps,
                    val_every=args.val_every,
                    overrides=args.override,
                    work_dir=work_dir,
                )
                results["runs"].append(run)
                print(
                    f"{name} seed {seed}: exit {run['returncode']}, {run['wall_s']:.0f} s, {len(run['steps'])} steps",
                    flush=True,
                )
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results) + "\n")  # after every run: a crash keeps what finished
    summary = summarise(results)
    results["summary"] = summary
    args.out.write_text(json.dumps(results) + "\n")
    plot(results, summary, args.plot, args.smooth)
    print(table(summary))
    extras = {key: value for key, value in summary.items() if key not in ("modes",)}
    print(json.dumps(extras, indent=1))


if __name__ == "__main__":
    main()
