"""The benchmark's model of verl fully_async (benchmarks/fully_async_model.py) keeps fully_async's own rules.

The simulator's validation against fully_async's published staleness ablation (benchmarks/sim_validate_fully_async.py)
is only as good as this model of its rollouter and trainer: admission per parameter version, prompts in flight per
server, answers resumed across a weight sync.
"""

from __future__ import annotations

import numpy as np
import pytest

from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import H100_SXM, QWEN25_7B
from verl_partial.sim.workload import Workload


@pytest.fixture
def model(bench_module):
    return bench_module("fully_async_model")


def _fully_async(model, staleness: float, servers: int = 2, required: int = 4, versions: int = 5):
    setup = model.FullyAsyncSetup(
        required_groups=required,
        trigger_parameter_sync_step=2,
        staleness_threshold=staleness,
        partial_rollout=True,
        train_seconds_per_update=5.0,
    )
    load = Workload(batch=8, n=4, p50=400, p99_over_p50=20, response_length=16_384, prompts=64)
    return model.simulate_fully_async(setup, load, ServerSpec(H100_SXM, QWEN25_7B), servers, versions)


def test_fully_async_at_staleness_zero_admits_one_version_of_prompts_and_resumes_nothing(model):
    run = _fully_async(model, 0.0)
    # staleness_threshold 0: required x trigger_parameter_sync_step prompts per version, all finished before the sync
    assert run.admitted == [8] * 5
    assert run.resumed_answers == 0
    assert all(gen > 0 for gen in run.gen_seconds)


def test_fully_async_staleness_bounds_admission_and_partial_rollout_resumes_across_syncs(model):
    run = _fully_async(model, 0.5)
    # at most (1 + 0.5) x 8 new prompts per version; answers aborted at a sync continue on the new weights
    assert max(run.admitted) <= 12 and sum(run.admitted) > 8 * 5
    assert run.resumed_answers > 0
    assert run.max_groups_in_flight <= 12


def test_fully_async_keeps_at_most_16_prompts_in_flight_per_server(model):
    run = _fully_async(model, 1.0, servers=1, required=16, versions=2)
    assert run.max_groups_in_flight == 16  # fully_async_rollouter: max_concurrent_samples = servers x 16


def test_fully_async_staleness_shortens_the_trainers_wait_on_a_heavy_tail(model):
    # The trainer waits for the slowest prompt of each version at staleness 0; streaming past the sync hides it.
    assert np.mean(_fully_async(model, 0.5).gen_seconds[1:]) < 0.7 * np.mean(_fully_async(model, 0.0).gen_seconds[1:])
