"""benchmarks/gpu_engine_curve.py on CPU: the script the GPU run uses, end to end on its tiny ``--smoke`` plan.

The GPU run happens once, on a lent machine with PyTorch and transformers only; everything it does is checked here
first: it imports nothing of verl, Ray or vLLM, every line it writes is whole JSON with the provenance the published
figures need, the scheduler's modes run over the real engine, and the budget stops new measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
PROVENANCE = ("label", "run_id", "date", "commit", "device_name", "torch", "dtype", "model_params", "elapsed_s")


@pytest.fixture
def curve(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("gpu_engine_curve")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_imports_neither_verl_nor_ray_nor_vllm() -> None:
    """The GPU machine has no verl, Ray or vLLM: importing the script must not pull any of them in."""
    probe = (
        "import sys, benchmarks.gpu_engine_curve\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'verl', 'ray', 'vllm', 'sglang'})\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_smoke_run_writes_whole_lines_of_every_measurement(curve: ModuleType, tmp_path: Path) -> None:
    png = tmp_path / "curve.png"
    out = curve.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "curve.jsonl"), "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000  # drawn, not empty
    lines = _lines(out)
    for line in lines:
        assert set(PROVENANCE) <= set(line), line["kind"]
        assert line["label"] == "measured, our PyTorch engine, not vLLM"
    kinds = [line["kind"] for line in lines]
    assert kinds[0] == "run" and kinds[-1] == "done" and "skipped" not in kinds
    plan = curve.SMOKE
    steps = [line for line in lines if line["kind"] == "decode_step"]
    assert [(s["running"], s["context"]) for s in steps] == [(n, c) for c in plan.contexts for n in plan.batch_sizes]
    assert all(s["step_ms"] > 0 and s["roofline_ms"] > 0 and s["sim_vllm_ms"] > s["roofline_ms"] for s in steps)
    check = next(line for line in lines if line["kind"] == "check")
    assert check["max_abs_logprob_diff"] < 1e-3 and check["same_argmax"]  # float32 on CPU: the same forward
    assert sum(line["kind"] == "prefill" for line in lines) == len(plan.prefill_shapes)
    rollout = [line for line in lines if line["kind"] == "rollout_step"]
    assert len(rollout) == len(curve.MODES) * plan.rollout_steps * len(plan.in_flight)
    modes = {line["mode"]: line for line in lines if line["kind"] == "rollout_mode"}
    assert set(modes) == set(curve.MODES)
    assert modes["sync"]["vs_sync_per_trained_token"] == 1.0 and modes["sync"]["staleness_max"] == 0
    for row in modes.values():
        assert row["steps"] == plan.rollout_steps and row["trained_tokens"] > 0
        assert row["discarded_tokens"] == 0 and row["staleness_max"] <= 1  # sync, default, tail: nothing thrown away
        expected = row["trained_tokens"] / (row["max_num_seqs"] * row["rollout_s"] / (row["full_step_ms"] / 1e3))
        assert row["slot_occupancy"] == pytest.approx(expected)
    assert "| in flight | mode |" in curve.table(out)


def test_budget_stops_new_measurements_and_still_closes_the_file(curve: ModuleType, tmp_path: Path) -> None:
    out = curve.main(["--smoke", "--device", "cpu", "--budget-s", "0", "--out", str(tmp_path / "curve.jsonl")])
    kinds = [line["kind"] for line in _lines(out)]
    assert kinds[0] == "run" and kinds[-1] == "done"
    assert not {"decode_step", "prefill", "rollout_step", "rollout_mode"} & set(kinds)
    assert "skipped" in kinds


def test_imposed_lengths_follow_the_simulators_workload(curve: ModuleType) -> None:
    """The answer lengths the real engine is given are the simulator's (prompt difficulty kept across epochs),
    capped at the response length, so the GPU run and the simulator see the same law."""
    workload = curve.Workload(batch=4, n=8, p50=64.0, p99_over_p50=8.0, response_length=512, prompts=64)
    lengths = curve.ImposedLengths(workload)
    assert curve.prompt_of("p17@e3") == 17
    assert lengths.target_length("p5@e0", 3) == min(512, workload.length(5, "p5@e0", 3, 0))
    assert max(lengths.target_length(f"p{p}@e0", i) for p in range(64) for i in range(8)) == 512
