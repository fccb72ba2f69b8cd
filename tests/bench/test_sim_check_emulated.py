"""benchmarks/sim_check_emulated.py: the simulator runs each peer mode as the trainer ran it, parameters frozen."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import pytest

from verl_partial.config.partial import PRESETS


@pytest.fixture
def check(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("sim_check_emulated")


def test_each_mode_is_the_config_the_trainer_ran(check: ModuleType) -> None:
    modes = check.sim_configs(16)
    same = {"request_timeout_s": 1e9}  # the simulated engine never hangs: stall checks off, nothing else changed
    assert modes["default"] == dataclasses.replace(PRESETS["default"], **same)
    assert modes["default_by_groups"] == dataclasses.replace(PRESETS["default"], fill_engine=False, **same)
    assert modes["default_extra"] == dataclasses.replace(PRESETS["default"], refill=False, extra_groups=16, **same)
    # verl's sync: a step waits for its slowest sample, nothing admitted ahead or parked
    sync = modes["v0_sync"]
    assert (sync.extra_groups, sync.refill, sync.fill_engine) == (0, False, False)


def test_the_busy_share_reads_every_step_of_usable_runs_that_fit(check: ModuleType) -> None:
    steps = {str(i): {"timing_s/gen": 2.0} for i in range(1, 4)}
    run = {"engine": "cpu", "mode": "default", "returncode": 0, "steps": steps,
           "engine_stats": [{"steps": 1000, "overruns": 0, "modelled_s": 4.5}]}  # fmt: skip
    overran = {**run, "engine_stats": [{"steps": 1000, "overruns": 50, "modelled_s": 6.0}]}
    assert check.busy_share({"runs": [run, overran]}, "cpu", "default") == pytest.approx([0.75])
