"""Every ``examples/*.sh`` composes with verl's trainer and passes our checks, as shipped.

The script itself runs under bash with a ``python3`` on PATH that records its arguments instead of training:
bash expands the script's defaults and quoting, so what is checked is the command line a user's run would get.
The recorded overrides then go through ``python -m verl.trainer.main_ppo ... --cfg job`` (verl composes them) and
``verl-partial check`` (our validation of every block, as the driver runs it at start-up).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_partial import cli

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.sh"))
RECORDER = '#!/bin/sh\nfor arg in "$@"; do printf "%s\\0" "$arg"; done > "$RECORDED_ARGS"\n'


def shipped_overrides(script: Path, tmp_path: Path) -> list[str]:
    """The Hydra overrides ``script`` hands to ``python3 -m verl.trainer.main_ppo``, its defaults expanded."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(RECORDER)
    (fake_bin / "python3").chmod(0o755)
    recorded = tmp_path / "args"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "HOME": str(tmp_path), "RECORDED_ARGS": str(recorded)}
    subprocess.run(["bash", str(script)], env=env, check=True)
    args = recorded.read_text().split("\0")[:-1]
    assert args[:2] == ["-m", "verl.trainer.main_ppo"], args
    return args[2:]


def test_there_are_examples_for_each_gpu_engine() -> None:
    assert {path.name for path in EXAMPLES} >= {"grpo_vllm.sh", "grpo_sglang.sh"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.name)
def test_example_composes_and_passes_our_checks(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = script.read_text().split("\nset ")[0]
    assert "composed on CPU in CI only" in header and "NEVER been run on" in header
    overrides = shipped_overrides(script, tmp_path)
    assert {"+partial=default", "+balance=group"} <= set(overrides)
    assert any(item.startswith("+rollout_correction=") for item in overrides)
    engine = script.stem.removeprefix("grpo_") if script.stem != "grpo" else "vllm"  # grpo.sh defaults to vLLM
    assert f"actor_rollout_ref.rollout.name={engine}" in overrides
    composed = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *overrides, "--cfg", "job", "--resolve"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert composed.returncode == 0, composed.stderr[-3000:]
    assert "use_v1: false" in composed.stdout  # implied by +partial, the legacy trainer our hooks run in
    assert cli.main(["check", *overrides]) == 0, capsys.readouterr().err
