"""The vLLM trainer benchmark's reading of recorded engine steps (benchmarks/bench_vllm_trainer.py): the ceiling
on vLLM's CPU build rests on it, so an output that is not a step, or a step stamped late, must not lower the
floor."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture
def bench(bench_module):
    return bench_module("bench_vllm_trainer")


def test_recorded_steps_split_into_phases_and_no_token_outputs_join_the_step_before(bench, tmp_path):
    # [engine-core stamp, decoded, prefilled, output-loop stamp]; the output loop reaches the third step 8 ms late.
    records = [
        [100.0, 1, 31, 900.0],  # a phase's first step: it began before anything was recorded
        [100.5, 64, 1917, 900.5],
        [100.524, 64, 0, 900.532],
        [100.5244, 0, 0, 900.5324],  # an abort notice stamped right after the step before: not a step
        [100.534, 10, 0, 900.534],
        [130.0, 2, 60, 930.0],  # 30 s later: the next rollout phase
        [130.01, 2, 0, 930.01],
    ]
    (tmp_path / "1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    phases = bench.engine_step_phases(tmp_path)
    assert [len(phase) for phase in phases] == [5, 2]
    assert phases[0][0][0] is None and phases[1][0][0] is None
    steps = bench._timed_steps(phases[0])
    np.testing.assert_allclose(steps, [[0.5, 64, 1917], [0.0244, 64, 0], [0.0096, 10, 0]], atol=1e-9)
    late = bench._timed_steps(bench.engine_step_phases(tmp_path, stamp=3)[0])
    np.testing.assert_allclose(late[:, 0], [0.5, 0.0324, 0.0016], atol=1e-9)  # the late stamp's next step "fast"


@pytest.mark.parametrize("stretch", [1, 2, 4, 16])
def test_a_late_stamp_moves_the_floor_by_its_delay_over_the_stretch(bench, stretch):
    # Steady 10 ms steps at 8 requests, except one stamped 5 ms late: it reads 15 ms, the next one 5 ms. The
    # fastest stretch starts at that 5 ms step: 5 ms too fast over `stretch` steps.
    seconds = [0.010] * 40
    seconds[10], seconds[11] = 0.015, 0.005
    runs = [{"engine_steps": [[[None, 8, 0], *([s, 8, 0] for s in seconds)]]}]
    floors = bench.trainer_floors(runs, stretch)
    assert max(f.fixed_s + 8 * f.per_request_s for f in floors) == pytest.approx(0.010 - 0.005 / stretch)


def test_a_stretch_of_prefill_alone_prices_no_decode_step(bench):
    assert bench.stretch_points([{"engine_steps": [[[None, 0, 0], [0.3, 0, 900], [0.3, 0, 900]]]}], 2) == []


def test_the_ceiling_refuses_prompts_that_could_share_cached_blocks(bench):
    wl = bench.Workload(max_prompt_length=bench.VLLM_CPU_BLOCK)
    with pytest.raises(ValueError, match="share cached blocks"):
        bench.ceiling({}, {}, wl, [], 1)
