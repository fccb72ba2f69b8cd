"""The staleness floor (``verl_partial.sim.bound``): exact on a hand-worked case, and never above what the real
scheduler achieves on the simulated engine, window by window, in every mode."""

from __future__ import annotations

import numpy as np
import pytest

from verl_partial.sim.bound import StepCostFloor, attended_tokens, phase_floor, tail_floor, work_floor
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import H100_SXM, QWEN25_7B, GpuSpec
from verl_partial.sim.run import mode_configs, simulate
from verl_partial.sim.workload import Workload


def test_attended_tokens_count_the_prompt_and_earlier_tokens_of_each_decode_step():
    # L = 4 after a 10-token prompt: decode steps 1..3 read 11, 12, 13 tokens.
    assert attended_tokens(np.array([4, 1]), 10).tolist() == [36.0, 0.0]


def test_floors_are_exact_for_schedules_that_meet_them():
    cost = StepCostFloor(fixed_s=1.0, per_request_s=0.5)
    # Answers of 3 and 1 tokens on one server: steps of 2, 1, 1 requests cost 2 + 1.5 + 1.5 = 5 s.
    assert phase_floor([np.array([3, 1])], 0, [cost], servers=1, max_staleness=0) == 5.0
    # Two servers: the 1-token answer runs elsewhere; the longest answer alone sets the phase (3 x 1.5 s).
    assert tail_floor(np.array([3, 1]), 0, cost) == 4.5
    assert phase_floor([np.array([3, 1])], 0, [cost], servers=2, max_staleness=0) == 4.5


def test_staleness_spreads_the_tail_but_not_the_work():
    cost = StepCostFloor(fixed_s=1.0, per_request_s=0.01)
    steps = [np.array([100, 10]), np.array([50])]
    # Tail: windows of 101 s and 50.5 s; at staleness 1 each phase is in two windows.
    assert phase_floor(steps, 0, [cost], 4, max_staleness=0) == pytest.approx(75.75)
    assert phase_floor(steps, 0, [cost], 4, max_staleness=1) == pytest.approx(37.875)
    # Work: 1,000 answers of 10 tokens, at most 100 decoded per step, on one server: 100 steps + 100 s of tokens.
    heavy = [np.full(1000, 10)]
    limited = StepCostFloor(fixed_s=1.0, per_request_s=0.01, max_requests=100)
    assert phase_floor(heavy, 0, [limited], 1, max_staleness=0) == pytest.approx(200.0)
    assert phase_floor(heavy, 0, [limited], 1, max_staleness=5) == pytest.approx(200.0)
    with pytest.raises(ValueError, match="max_staleness"):
        phase_floor(steps, 0, [cost], 1, max_staleness=-1)


def test_the_kv_cache_forces_steps_when_the_context_does_not_fit_in_one():
    # 1000 answers attend 45 tokens each over their steps: 45,000 / a 1,500-token cache = 30 steps at least.
    lengths = [np.full(1000, 10)]
    assert phase_floor(lengths, 0, [StepCostFloor(fixed_s=1.0)], 1, 0) == 10.0
    assert phase_floor(lengths, 0, [StepCostFloor(fixed_s=1.0, kv_capacity=1_500)], 1, 0) == 30.0


def test_floors_under_measured_step_times_stay_under_every_point():
    measured = {1: 0.008, 8: 0.010, 64: 0.0215}
    floors = StepCostFloor.under_measured_steps([(n, 0, t) for n, t in measured.items()], max_requests=64)
    assert floors
    for floor in floors:
        for n, seconds in measured.items():
            assert floor.fixed_s + floor.per_request_s * n <= seconds * (1 + 1e-9)
    lines = [(f.fixed_s, f.per_request_s) for f in floors]
    # Concave here: the chord from 1 to 64 requests stays under the middle point and is kept; the line through
    # 1 and 8 would pass above the 64-request point and is dropped.
    assert (pytest.approx(0.008 - 0.0135 / 63), pytest.approx(0.0135 / 63)) in lines
    assert not any(b == pytest.approx(0.002 / 7) for _, b in lines)
    with pytest.raises(ValueError, match="batch sizes"):
        StepCostFloor.under_measured_steps([], max_requests=64)


def test_floors_under_many_stretch_means_never_pass_above_a_point_and_price_prefill_only_when_measured():
    rng = np.random.default_rng(3)
    decoded = rng.uniform(1, 64, 2_000)
    prefilled = np.where(rng.random(decoded.size) < 0.1, rng.uniform(0, 500, decoded.size), 0.0)
    seconds = 0.004 + 0.0003 * decoded + 0.00025 * prefilled + rng.exponential(0.003, decoded.size)
    points = [*zip(decoded, prefilled, seconds, strict=True)]
    points += [(1.0, 0.0, 0.0041), (1.0, 0.0, 0.02), (64.0, 0.0, 0.0233)]  # one batch size measured twice
    floors = StepCostFloor.under_measured_steps(points, max_requests=64)
    for floor in floors:
        slack = [s - floor.fixed_s - floor.per_request_s * n - floor.per_prefill_s * p for n, p, s in points]
        assert min(slack) >= -1e-12
        # Each line touches the points (a hull edge, or the flat line through the lowest): none lies loose below.
        assert min(slack) == pytest.approx(0, abs=1e-12)
    assert max(f.per_prefill_s for f in floors) > 0.0002  # the prefill the points carry is priced
    assert any(f.fixed_s + f.per_request_s == pytest.approx(0.0041) for f in floors)
    # Without a prefilling point nothing says what a prompt token costs: no floor may claim one.
    decode_only = StepCostFloor.under_measured_steps([(n, 0, s) for n, p, s in points if not p], max_requests=64)
    assert decode_only and all(f.per_prefill_s == 0 for f in decode_only)


def test_every_trained_prompt_is_prefilled_once_in_the_work_floor():
    # 2 steps of 4 samples (longest 3), 100 prompt tokens each: 400 prefilled per step at 0.01 s a token.
    steps = [np.array([3, 1, 1, 1])] * 2
    cost = StepCostFloor(fixed_s=1.0, per_request_s=0.5, per_prefill_s=0.01)
    assert phase_floor(steps, 0, [cost], servers=1, max_staleness=1) == pytest.approx(1.5 + 3.0)
    assert phase_floor(steps, 0, [cost], 1, max_staleness=1, prompt_tokens=400) == pytest.approx(1.5 + 3.0 + 4.0)
    assert work_floor(steps, 0, cost, 2, 1, prompt_tokens=400) == pytest.approx((1.5 + 3.0 + 4.0) / 2)


TINY_GPU = GpuSpec("tiny", hbm_bytes=20e9, hbm_bandwidth=1e12, bf16_flops=1e15)
SPECS = {
    "h100": ServerSpec(H100_SXM, QWEN25_7B),
    # A KV cache of 83k tokens: long answers preempt each other, so the cache limit binds.
    "kv_bound": ServerSpec(TINY_GPU, QWEN25_7B, gpu_memory_utilization=1.0, activation_reserve_bytes=0.0),
    "overhead": ServerSpec(H100_SXM, QWEN25_7B, step_overhead_s=0.003, max_num_seqs=16),
}


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_no_simulated_schedule_beats_the_floor(spec_name, servers):
    """Window by window (the tail) and over the whole run (the work), in every mode, on the real scheduler."""
    spec = SPECS[spec_name]
    load = Workload(batch=6, n=4, p50=300, p99_over_p50=20, response_length=12_000, prompts=60)
    costs = StepCostFloor.of_server(spec)
    tightest = 0.0
    for mode, config in mode_configs(load.batch).items():
        run = simulate(config, load, spec, servers, steps=8)
        for step, lengths in enumerate(run.trained_lengths):
            lag = int(run.staleness_max[step])
            window = sum(run.seconds[max(0, step - lag) : step + 1])
            tail = max(tail_floor(lengths, load.prompt_len, cost) for cost in costs)
            assert window >= tail * (1 - 1e-9), (mode, step, lag, window, tail)
            if mode == "sync":
                tightest = max(tightest, tail / window)
        staleness = int(max(run.staleness_max))
        work = max(work_floor(run.trained_lengths, load.prompt_len, c, servers, staleness) for c in costs)
        assert np.mean(run.seconds) >= work * (1 - 1e-9), (mode, np.mean(run.seconds), work)
        floor = phase_floor(run.trained_lengths, load.prompt_len, costs, servers, staleness)
        assert np.mean(run.seconds) >= floor * (1 - 1e-9), mode
    # The floor is tight: some synchronous phase comes within 10 % of it (its tail runs alone).
    assert tightest > 0.9
