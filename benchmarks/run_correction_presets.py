"""Run every rollout-correction preset for one real GRPO step on the CPU backend and tabulate what it logged.

    python -m benchmarks.run_correction_presets                          # all presets, table on stdout
    python -m benchmarks.run_correction_presets --presets pure_is geo_rs --out /tmp/correction_matrix.md

Each preset runs ``python -m verl.trainer.main_ppo +backend=cpu +partial=default +rollout_correction=<name>``
(the demo command of ``verl_partial.cli.demo_command``, one step unless ``--steps``, no validation) in a fresh temporary
directory, one run at a time. Everything in the table is read from the metrics verl's own file logger wrote
for the last step (``VERL_FILE_LOGGER_PATH``); nothing is recomputed here. A run that fails is listed with the
last lines of its error instead of being skipped.

Reading the table:

* mode: ``decoupled`` if ``timing_s/old_log_prob`` was logged (the old-log-prob pass ran), ``bypass`` if not;
  "expected" is the preset's ``bypass_mode``.
* correction values come from ``rollout_corr/`` (driver, decoupled: pi_old vs pi_rollout) or, marked ``a:``,
  from ``actor/rollout_corr/`` (inside the loss, bypass: pi_theta vs pi_rollout).
* lags: the ``rollout_corr/lag_<k>/`` splits present. The first training step has no stale tokens, so only
  ``lag_0`` can appear there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from verl_partial.cli import demo_command
from verl_partial.config.correction import PRESET_NAMES, preset
from verl_partial.demo.assets import build_assets, hydra_overrides

RUN_TIMEOUT_S = 420

# (column, metric suffix under rollout_corr/ or actor/rollout_corr/)
VALUE_COLUMNS = (
    ("IS mean", "rollout_is_mean"),
    ("ESS", "rollout_is_eff_sample_size"),
    ("RS tok masked", "rollout_rs_masked_fraction"),
    ("RS seq masked", "rollout_rs_seq_masked_fraction"),
    ("k3_kl", "k3_kl"),
    ("chi2_token", "chi2_token"),
    ("ppl_ratio", "ppl_ratio"),
    ("all-rejected mb", "all_rejected_microbatches"),
)
_FAMILY = re.compile(r"^(rollout_is|rollout_rs_(?:token|seq_sum|seq_mean|seq_max)_k\d)_.+$")
_ERROR_LINE = re.compile(r"\w(Error|Exception)\b|^In '.*': |Could not |TIMEOUT")
LOSS_KEY = re.compile(r"^actor/(pg_\w+|ppo_kl|\w*loss\w*)$")


def run_preset(name: str, cache_dir: Path, keep: bool, steps: int = 1) -> dict[str, Any]:
    """``steps`` GRPO steps with ``+rollout_correction=<name>``; returns the last step's metrics, status, wall time."""
    assets = build_assets(cache_dir)
    output_dir = Path(tempfile.mkdtemp(prefix=f"vp_corr_{name}_"))
    metrics_file = output_dir / "metrics.jsonl"
    command = demo_command(
        hydra_overrides(assets),
        steps=steps,
        output_dir=output_dir,
        partial="default",
        extra=["trainer.logger=[console,file]", "trainer.test_freq=0", f"+rollout_correction={name}"],
    )
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_file), "RAY_DEDUP_LOGS": "0"}
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=output_dir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        returncode, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = None
        log = _text(exc.stdout) + _text(exc.stderr) + f"\nTIMEOUT after {RUN_TIMEOUT_S} s"
    wall = time.monotonic() - start
    metrics: dict[str, Any] = {}
    if metrics_file.exists():
        for line in metrics_file.read_text().splitlines():
            record = json.loads(line)
            if record.get("step") == steps:
                metrics.update(record["data"])
    (output_dir / "run.log").write_text(log)
    if not keep and returncode == 0:
        shutil.rmtree(output_dir, ignore_errors=True)
    headline, tail = error_summary(log) if returncode != 0 else ("", "")
    return {
        "name": name,
        "returncode": returncode,
        "wall_s": wall,
        "metrics": metrics,
        "error": headline,
        "error_tail": tail,
        "log_file": str(output_dir / "run.log"),
    }


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def expected_bypass(name: str) -> bool | None:
    """The preset's ``bypass_mode`` as the config code defines it; None for a name a stored dump holds but no preset
    has any more (``--from-json``)."""
    return preset(name).bypass_mode if name in PRESET_NAMES else None


def error_summary(log: str, lines: int = 25) -> tuple[str, str]:
    """(one line for the table, the relevant lines for the failure section).

    The headline is the last error-looking line (exception, Hydra's "Could not ...", timeout); the
    details are the last traceback, else the lines from the first error-looking line, else the log's tail.
    """
    all_lines = [line.rstrip() for line in log.splitlines() if line.strip()]
    error_like = [i for i, line in enumerate(all_lines) if _ERROR_LINE.search(line)]
    headline = all_lines[error_like[-1]] if error_like else (all_lines[-1] if all_lines else "no output")
    tracebacks = [i for i, line in enumerate(all_lines) if "Traceback" in line]
    if tracebacks:
        tail = all_lines[tracebacks[-1] :][-40:]
    elif error_like:
        tail = all_lines[error_like[0] :][:lines]
    else:
        tail = all_lines[-lines:]
    return headline.strip()[:200], "\n".join(tail)


def fmt(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def pick(metrics: dict[str, Any], suffix: str) -> str:
    if f"rollout_corr/{suffix}" in metrics:
        return fmt(metrics[f"rollout_corr/{suffix}"])
    if f"actor/rollout_corr/{suffix}" in metrics:
        return "a:" + fmt(metrics[f"actor/rollout_corr/{suffix}"])
    return "–"


def row(result: dict[str, Any]) -> list[str]:
    metrics, name = result["metrics"], result["name"]
    exp = expected_bypass(name)
    exp_s = "?" if exp is None else ("bypass" if exp else "decoupled")
    if result["returncode"] != 0:
        headline = result["error"]
        status = f"FAIL (rc={result['returncode']}): `{headline.replace('|', '/')}`"
        return [f"`{name}`", exp_s, "–", status, f"{result['wall_s']:.0f}"] + ["–"] * (len(VALUE_COLUMNS) + 4)
    mode = "decoupled" if "timing_s/old_log_prob" in metrics else "bypass"
    status = "ok" if mode == exp_s else f"ok, MODE MISMATCH (expected {exp_s})"
    loss = sorted(key.removeprefix("actor/") for key in metrics if LOSS_KEY.match(key))
    driver = [key for key in metrics if key.startswith("rollout_corr/")]
    actor = [key for key in metrics if key.startswith("actor/rollout_corr/")]
    lags = sorted({m.group(1) for key in driver if (m := re.match(r"rollout_corr/(lag_\d+)/", key))})
    nonfinite = [k for k in driver + actor if isinstance(metrics[k], float) and not math.isfinite(metrics[k])]
    if nonfinite:
        status += f", non-finite: {', '.join(sorted(nonfinite))}"
    return (
        [f"`{name}`", exp_s, mode, status, f"{result['wall_s']:.0f}"]
        + [pick(metrics, suffix) for _, suffix in VALUE_COLUMNS]
        + [", ".join(lags) or "–", str(len(driver)), str(len(actor)), ", ".join(loss) or "–"]
    )


def metric_families(metrics: dict[str, Any]) -> str:
    """The step's correction metric names, compactly: each name suffix once, with the prefixes it was logged under."""
    by_suffix: dict[str, set[str]] = {}
    for key in metrics:
        match = re.match(r"^((?:actor/)?rollout_corr(?:/lag_\d+)?)/(.+)$", key)
        if match:  # one entry per statistic family: rollout_is_*, rollout_rs_seq_mean_k1_*, ...
            suffix = re.sub(_FAMILY, r"\1_*", match.group(2))
            by_suffix.setdefault(suffix, set()).add(match.group(1))
    by_prefixes: dict[tuple[str, ...], list[str]] = {}
    for suffix, prefixes in by_suffix.items():
        by_prefixes.setdefault(tuple(sorted(prefixes)), []).append(suffix)
    parts = []
    for prefixes, suffixes in sorted(by_prefixes.items()):
        head = prefixes[0] if len(prefixes) == 1 else "{" + ",".join(prefixes) + "}"
        parts.append(f"`{head}/` " + " ".join(sorted(suffixes)))
    return "; ".join(parts) or "none"


def render(results: list[dict[str, Any]], command: str, steps: int = 1, date: str | None = None) -> str:
    header = (
        ["preset", "expected", "observed", "status", "wall s"]
        + [label for label, _ in VALUE_COLUMNS]
        + ["lag splits", "#rollout_corr/", "#actor/rollout_corr/", "actor loss keys"]
    )
    out = [
        f"Run {date or _dt.date.today().isoformat()}, verl-partial CPU backend, {steps} GRPO step(s) per preset, "
        f"metrics of step {steps} (8 prompts x 4 samples, `+partial=default`, `trainer.test_freq=0`).",
        f"Reproduce: `{command}`",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    out += ["| " + " | ".join(row(result)) + " |" for result in results]
    out += [
        "",
        "`a:` = value from `actor/rollout_corr/` (bypass: pi_theta vs pi_rollout, inside the loss); otherwise from "
        "`rollout_corr/` (driver: pi_old vs pi_rollout). `–` = not logged."
        + (" The first training step has no stale tokens, so the lag split shows `lag_0` only." if steps == 1 else ""),
    ]
    groups: dict[str, list[str]] = {}
    for result in results:
        if result["returncode"] == 0:
            groups.setdefault(metric_families(result["metrics"]), []).append(result["name"])
    if groups:
        out += ["", "Correction metrics logged (`{a,b}/x` = `a/x` and `b/x`; `_*` = a statistic's family):", ""]
        out += [f"* {', '.join(f'`{p}`' for p in presets)}: {families}" for families, presets in groups.items()]
    for result in results:
        if result["returncode"] != 0:
            out += ["", f"Failure `{result['name']}` (log: {result['log_file']}):", "", "```"]
            out += [result["error_tail"], "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(PRESET_NAMES), help="subset of preset names")
    parser.add_argument("--cache-dir", default="/tmp/vp_demo_cache", help="demo assets (built if missing)")
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("--json", help="also dump every run's metrics here")
    parser.add_argument("--steps", type=int, default=1, help="GRPO steps per run; the last one is tabulated")
    parser.add_argument("--from-json", help="re-render the table of a --json dump instead of running")
    parser.add_argument("--keep", action="store_true", help="keep the run directories of successful runs")
    args = parser.parse_args(argv)
    if args.from_json:
        dump = json.loads(Path(args.from_json).read_text())
        table = render(dump["runs"], dump["command"], dump["steps"], dump.get("date"))
        print(table, end="")
        if args.out:
            Path(args.out).write_text(table)
        return 0
    unknown = [name for name in args.presets if name not in PRESET_NAMES]
    if unknown:
        parser.error(f"unknown presets {unknown}; known: {', '.join(PRESET_NAMES)}")
    command = (
        "python -m benchmarks.run_correction_presets"
        + ("" if args.presets == list(PRESET_NAMES) else " --presets " + " ".join(args.presets))
        + ("" if args.steps == 1 else f" --steps {args.steps}")
    )
    today = _dt.date.today().isoformat()
    results = []
    for index, name in enumerate(args.presets, 1):
        print(f"[{index}/{len(args.presets)}] {name} ...", file=sys.stderr, flush=True)
        result = run_preset(name, Path(args.cache_dir), args.keep, args.steps)
        print(f"    rc={result['returncode']} {result['wall_s']:.0f} s", file=sys.stderr, flush=True)
        results.append(result)
        if args.out:  # partial table after every run, so a long sweep can be followed
            Path(args.out).write_text(render(results, command, args.steps, today))
        if args.json:
            dump = {"date": today, "command": command, "steps": args.steps, "runs": results}
            Path(args.json).write_text(json.dumps(dump, indent=1))
    table = render(results, command, args.steps, today)
    print(table, end="")
    return 0 if all(result["returncode"] == 0 for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
