"""Run every rollout-correction preset for one real GRPO step on the CPU backend and tabulate what it logged.

    python benchmarks/run_correction_presets.py                          # all presets, table on stdout
    python benchmarks/run_correction_presets.py --presets pure_is geo_rs --out /tmp/correction_matrix.md

Each preset runs ``python -m verl.trainer.main_ppo +backend=cpu +partial=default +rollout_correction=<name>``
(the demo command of ``verl_partial.cli.demo_command``, one step, no validation) in a fresh temporary
directory, one run at a time. Everything in the table is read from the metrics verl's own file logger wrote
for that step (``VERL_FILE_LOGGER_PATH``); nothing is recomputed here. A run that fails is listed with the
last lines of its error instead of being skipped.

Reading the table:

* mode: ``decoupled`` if ``timing_s/old_log_prob`` was logged (the old-log-prob pass ran), ``bypass`` if not;
  "expected" is the preset's ``bypass_mode``.
* correction values come from ``rollout_corr/`` (driver, decoupled: pi_old vs pi_rollout) or, marked ``a:``,
  from ``actor/rollout_corr/`` (inside the loss, bypass: pi_theta vs pi_rollout).
* lags: the ``rollout_corr/lag_<k>/`` splits present. A first training step has no stale tokens, so only
  ``lag_0`` can appear there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from verl_partial.cli import demo_command  # noqa: E402
from verl_partial.core.correction import PRESET_NAMES  # noqa: E402
from verl_partial.demo.assets import build_assets, hydra_overrides  # noqa: E402

RUN_TIMEOUT_S = 420
PRESET_DIR = ROOT / "hydra_configs" / "rollout_correction"

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
LOSS_KEY = re.compile(r"^actor/(pg_\w+|ppo_kl|\w*loss\w*)$")


def run_preset(name: str, cache_dir: Path, keep: bool) -> dict[str, Any]:
    """One GRPO step with ``+rollout_correction=<name>``; returns the step's metrics, status and wall time."""
    assets = build_assets(cache_dir)
    output_dir = Path(tempfile.mkdtemp(prefix=f"vp_corr_{name}_"))
    metrics_file = output_dir / "metrics.jsonl"
    command = demo_command(
        hydra_overrides(assets),
        steps=1,
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
            if record.get("step") == 1:
                metrics.update(record["data"])
    (output_dir / "run.log").write_text(log)
    if not keep and returncode == 0:
        _rmtree(output_dir)
    return {"name": name, "returncode": returncode, "wall_s": wall, "metrics": metrics, "log": log, "dir": output_dir}


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def expected_bypass(name: str) -> bool | None:
    try:
        return bool(yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())["rollout_correction"]["bypass_mode"])
    except (OSError, KeyError, TypeError):
        return None


def error_summary(log: str, lines: int = 12) -> tuple[str, str]:
    """(one line for the table, the last relevant lines for the details section)."""
    all_lines = [line for line in log.splitlines() if line.strip()]
    errors = [line.strip() for line in all_lines if re.search(r"(Error|Exception|TIMEOUT)\b", line)]
    headline = errors[-1] if errors else (all_lines[-1].strip() if all_lines else "no output")
    # the tail of the last traceback, if there is one, else the log's tail
    tb = max((i for i, line in enumerate(all_lines) if "Traceback" in line), default=None)
    tail = all_lines[tb:][-40:] if tb is not None else all_lines[-lines:]
    return headline[:200], "\n".join(tail)


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
        headline, _ = error_summary(result["log"])
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


def render(results: list[dict[str, Any]], command: str) -> str:
    header = (
        ["preset", "expected", "observed", "status", "wall s"]
        + [label for label, _ in VALUE_COLUMNS]
        + ["lag splits", "#rollout_corr/", "#actor/rollout_corr/", "actor loss keys"]
    )
    out = [
        f"Run {_dt.date.today().isoformat()}, verl-partial CPU backend, 1 GRPO step per preset "
        "(8 prompts x 4 samples, `+partial=default`, `trainer.test_freq=0`).",
        f"Reproduce: `{command}`",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    out += ["| " + " | ".join(row(result)) + " |" for result in results]
    out += [
        "",
        "`a:` = value from `actor/rollout_corr/` (bypass: pi_theta vs pi_rollout, inside the loss); otherwise from "
        "`rollout_corr/` (driver: pi_old vs pi_rollout). `–` = not logged. The first training step has no stale "
        "tokens, so the lag split can only show `lag_0`.",
    ]
    metric_names: dict[tuple[str, ...], list[str]] = {}
    for result in results:
        if result["returncode"] == 0:
            names = tuple(sorted(k for k in result["metrics"] if "rollout_corr/" in k))
            metric_names.setdefault(names, []).append(result["name"])
    if metric_names:
        out += ["", "<details><summary>correction metric names logged, grouped by preset</summary>", ""]
        for names, presets in metric_names.items():
            out.append(f"* {', '.join(f'`{p}`' for p in presets)}: " + (", ".join(f"`{n}`" for n in names) or "none"))
        out += ["", "</details>"]
    failures = [result for result in results if result["returncode"] != 0]
    for result in failures:
        _, tail = error_summary(result["log"])
        out += ["", f"Failure `{result['name']}` (log: {result['dir'] / 'run.log'}):", "", "```", tail, "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(PRESET_NAMES), help="subset of preset names")
    parser.add_argument("--cache-dir", default="/tmp/vp_demo_cache", help="demo assets (built if missing)")
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("--json", help="also dump every run's metrics here")
    parser.add_argument("--keep", action="store_true", help="keep the run directories of successful runs")
    args = parser.parse_args(argv)
    unknown = [name for name in args.presets if name not in PRESET_NAMES]
    if unknown:
        parser.error(f"unknown presets {unknown}; known: {', '.join(PRESET_NAMES)}")
    command = "python benchmarks/run_correction_presets.py" + (
        "" if args.presets == list(PRESET_NAMES) else " --presets " + " ".join(args.presets)
    )
    results = []
    for index, name in enumerate(args.presets, 1):
        print(f"[{index}/{len(args.presets)}] {name} ...", file=sys.stderr, flush=True)
        result = run_preset(name, Path(args.cache_dir), args.keep)
        print(f"    rc={result['returncode']} {result['wall_s']:.0f} s", file=sys.stderr, flush=True)
        results.append(result)
        if args.out:  # partial table after every run, so a long sweep can be followed
            Path(args.out).write_text(render(results, command))
        if args.json:
            dump = [{k: v for k, v in r.items() if k not in ("log", "dir")} for r in results]
            Path(args.json).write_text(json.dumps(dump, indent=1))
    table = render(results, command)
    print(table)
    return 0 if all(result["returncode"] == 0 for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
