"""The demo's closing summary, read from verl's file-logger metrics (``trainer.logger=[...,file]``).

verl's ``FileLogger`` writes one JSON line per logged step, ``{"step": N, "data": {metric: value}}``,
and truncates its file when opened, so every demo run (a resume included) writes its own
``metrics_<k>.jsonl``; the summary reads them all in order, a later value of a step replacing an earlier one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_GLOB = "metrics_*.jsonl"
PARTIAL_PREFIX = "partial/"
VALIDATION_PREFIX = "val-core/"


def metrics_file(run_dir: Path) -> Path:
    """A fresh metrics file for the next trainer invocation in ``run_dir``."""
    return run_dir / f"metrics_{len(list(run_dir.glob(METRICS_GLOB)))}.jsonl"


def read_steps(paths: Iterable[Path]) -> dict[int, dict[str, Any]]:
    """Metrics per step from verl's file-logger files, in the order given."""
    steps: dict[int, dict[str, Any]] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                steps.setdefault(int(record["step"]), {}).update(record["data"])
    return steps


def run_metric_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(METRICS_GLOB), key=lambda path: int(path.stem.rpartition("_")[2]))


@dataclass
class StepLine:
    step: int
    seconds: float | None
    generation_s: float | None
    resumed_fraction: float | None
    staleness_mean: float | None
    tokens_generated: float | None
    tokens_trained: float | None
    tokens_discarded: float | None

    @property
    def training_s(self) -> float | None:
        """Everything in the step but generation: old/ref log-probs, advantages, actor update."""
        if self.seconds is None or self.generation_s is None:
            return None
        return self.seconds - self.generation_s


@dataclass
class Summary:
    steps: list[StepLine]
    validation: dict[str, float] = field(default_factory=dict)
    staleness_max: float | None = None
    untrained_groups_at_end: float | None = None

    @classmethod
    def from_steps(cls, steps: dict[int, dict[str, Any]]) -> Summary:
        lines = []
        validation: dict[str, float] = {}
        staleness_max = untrained = None
        for step in sorted(steps):
            data = steps[step]
            validation.update({key: value for key, value in data.items() if key.startswith(VALIDATION_PREFIX)})
            if "timing_s/step" not in data:
                continue  # a validation-only record (e.g. before training)
            lines.append(
                StepLine(
                    step=step,
                    seconds=data.get("timing_s/step"),
                    generation_s=data.get("timing_s/gen"),
                    resumed_fraction=data.get("partial/resumed_fraction"),
                    staleness_mean=data.get("partial/staleness/mean"),
                    tokens_generated=data.get("partial/tokens_generated"),
                    tokens_trained=data.get("partial/tokens_trained"),
                    tokens_discarded=data.get("partial/tokens_discarded"),
                )
            )
            if data.get("partial/staleness/max") is not None:
                staleness_max = max(staleness_max or 0.0, data["partial/staleness/max"])
            untrained = data.get("partial/untrained_groups_at_end", untrained)
        return cls(lines, validation, staleness_max, untrained)

    @property
    def partial(self) -> bool:
        return any(line.tokens_generated is not None for line in self.steps)

    def render(self, *, run_dir: Path, log_path: Path, checkpoint: Path | None, twin: str | None = None) -> str:
        """``twin`` is the command of the same run with partial rollout switched the other way, to compare."""
        out = [f"verl-partial demo: {len(self.steps)} training step(s) in {run_dir}"]
        if self.steps:
            header = "  step   total s   generation s   training s"
            if self.partial:
                header += "   resumed   staleness   tokens generated / trained / discarded"
            out.append(header)
            for line in self.steps:
                row = f"  {line.step:>4}   {_num(line.seconds):>7}   {_num(line.generation_s):>12}   "
                row += f"{_num(line.training_s):>10}"
                if self.partial:
                    row += (
                        f"   {_pct(line.resumed_fraction):>7}   {_num(line.staleness_mean, 2):>9}   "
                        f"{_int(line.tokens_generated)} / {_int(line.tokens_trained)} / {_int(line.tokens_discarded)}"
                    )
                out.append(row)
        if self.partial:
            generated = sum(line.tokens_generated or 0 for line in self.steps)
            trained = sum(line.tokens_trained or 0 for line in self.steps)
            discarded = sum(line.tokens_discarded or 0 for line in self.steps)
            resumed = [line.resumed_fraction for line in self.steps if line.resumed_fraction is not None]
            out.append(
                f"  partial rollout: {_int(generated)} tokens generated, {_int(trained)} trained, {_int(discarded)} "
                f"discarded; {_pct(sum(resumed) / len(resumed) if resumed else None)} of trained samples resumed "
                f"across steps; staleness max {_num(self.staleness_max, 0)} policy version(s)"
            )
            if self.untrained_groups_at_end is not None:
                out.append(f"  groups still in flight when training ended: {_int(self.untrained_groups_at_end)}")
        if self.validation:
            out.append(
                "  validation: " + ", ".join(f"{key} = {value:.3f}" for key, value in sorted(self.validation.items()))
            )
        else:
            out.append("  validation: none logged")
        out.append(f"  checkpoint: {checkpoint if checkpoint is not None else 'none written'}")
        out.append(f"  logs: {log_path} (verl's output), metrics: {run_dir}/{METRICS_GLOB}")
        out.append(
            "  what the numbers mean: seconds of a tiny model on this CPU show that the run works, not GPU speed; "
            "generation s is the rollout phase, the part +partial shortens"
            + (
                "; resumed = trained samples continued from an earlier step, staleness = policy versions their "
                "oldest tokens lag, discarded = tokens generated and thrown away"
                if self.partial
                else ""
            )
        )
        if twin is not None:
            out.append(f"  compare: {twin}")
        return "\n".join(out)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _int(value: float | None) -> str:
    return "-" if value is None else f"{int(round(value)):,}"
