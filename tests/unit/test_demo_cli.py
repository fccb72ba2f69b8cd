"""``verl-partial demo``: one output folder per run, fresh unless resumed, and a summary read from verl's metrics."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from verl_partial import cli
from verl_partial.demo.summary import Summary, metrics_file, read_steps, run_metric_files


def _args(tmp_path: Path, **kwargs) -> argparse.Namespace:
    values = {"cache_dir": str(tmp_path / "cache"), "output": None, "resume": False}
    return argparse.Namespace(**{**values, **kwargs})


def test_default_runs_are_fresh_folders_beside_the_assets(tmp_path: Path) -> None:
    first = cli._run_dir(_args(tmp_path))
    assert first.parent == (tmp_path / "cache" / "runs").resolve()
    (first / "checkpoints").mkdir(parents=True)
    assert cli._run_dir(_args(tmp_path, resume=True)) == first  # --resume picks the latest run


def test_an_output_holding_a_run_is_resumed_only_when_asked(tmp_path: Path) -> None:
    output = tmp_path / "mine"
    assert cli._run_dir(_args(tmp_path, output=str(output))) == output.resolve()
    with pytest.raises(SystemExit, match="holds no demo run"):
        cli._run_dir(_args(tmp_path, output=str(output), resume=True))
    (output / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit, match="already holds a demo run: pass --resume"):
        cli._run_dir(_args(tmp_path, output=str(output)))
    assert cli._run_dir(_args(tmp_path, output=str(output), resume=True)) == output.resolve()


def test_resume_without_any_previous_run_fails(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no previous demo run"):
        cli._run_dir(_args(tmp_path, resume=True))


def _write(path: Path, records: list[tuple[int, dict[str, float]]]) -> None:
    path.write_text("".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in records))


def test_summary_reads_every_metrics_file_of_the_run(tmp_path: Path) -> None:
    step = {
        "timing_s/step": 10.0,
        "timing_s/gen": 4.0,
        "partial/resumed_fraction": 0.25,
        "partial/staleness/mean": 0.5,
        "partial/staleness/max": 1.0,
        "partial/tokens_generated": 1000.0,
        "partial/tokens_trained": 800.0,
        "partial/tokens_discarded": 50.0,
    }
    first = metrics_file(tmp_path)
    _write(first, [(1, step), (2, {**step, "partial/staleness/max": 2.0})])
    second = metrics_file(tmp_path)  # a resumed invocation writes its own file
    assert second != first
    last = {**step, "partial/untrained_groups_at_end": 3.0, "val-core/countdown/reward/mean@1": 0.375}
    _write(second, [(3, last)])
    summary = Summary.from_steps(read_steps(run_metric_files(tmp_path)))
    assert [line.step for line in summary.steps] == [1, 2, 3]
    assert summary.steps[0].training_s == 6.0
    assert summary.staleness_max == 2.0
    assert summary.untrained_groups_at_end == 3.0
    assert summary.validation == {"val-core/countdown/reward/mean@1": 0.375}
    text = summary.render(run_dir=tmp_path, log_path=tmp_path / "verl.log", checkpoint=None)
    assert "3,000 tokens generated, 2,400 trained, 150 discarded" in text
    assert "25 % of trained samples resumed" in text
    assert "val-core/countdown/reward/mean@1 = 0.375" in text
    assert str(tmp_path / "verl.log") in text


def test_summary_without_partial_rollout_omits_its_columns(tmp_path: Path) -> None:
    _write(metrics_file(tmp_path), [(1, {"timing_s/step": 5.0, "timing_s/gen": 2.0})])
    summary = Summary.from_steps(read_steps(run_metric_files(tmp_path)))
    text = summary.render(run_dir=tmp_path, log_path=tmp_path / "verl.log", checkpoint=tmp_path / "ck")
    assert not summary.partial and "partial rollout" not in text and "validation: none logged" in text


def test_summary_suggests_the_twin_run_and_says_what_its_numbers_mean(tmp_path: Path) -> None:
    _write(metrics_file(tmp_path), [(1, {"timing_s/step": 5.0, "timing_s/gen": 2.0, "partial/tokens_generated": 9.0})])
    args = argparse.Namespace(no_partial=False, steps=4, overrides=["+rollout_correction=seq_is_rs"])
    text = Summary.from_steps(read_steps(run_metric_files(tmp_path))).render(
        run_dir=tmp_path, log_path=tmp_path / "verl.log", checkpoint=None, twin=cli._twin_command(args)
    )
    assert "compare: verl-partial demo --no-partial --steps 4 +rollout_correction=seq_is_rs" in text
    assert "what the numbers mean: " in text and "not GPU speed" in text and "staleness = policy versions" in text
    back = cli._twin_command(argparse.Namespace(no_partial=True, steps=4, overrides=[]))
    assert back.startswith("verl-partial demo --partial default --steps 4   (the same run with partial rollout)")
