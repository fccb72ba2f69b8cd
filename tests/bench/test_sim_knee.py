"""benchmarks/sim_knee.py: the caps are each server's compute knee and half of it, and the summary pairs seeds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PRESETS
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import H20, QWEN25_7B


def test_the_capped_modes_sit_at_the_knee_and_half_of_it(bench_module: Callable[[str], ModuleType]) -> None:
    knee = bench_module("sim_knee")
    spec = ServerSpec(H20, QWEN25_7B)
    configs = knee.knee_configs(knee.SHAPES[1], spec)
    # at the knee: the shipped default, whose ``auto`` the simulated server's GPU (an H20) sets to its knee
    assert configs["default_knee"].max_calls_per_server == PRESETS["default"].max_calls_per_server == "auto"
    assert spec.compute_knee == 26 and configs["default_half_knee"].max_calls_per_server == 13
    # uncapped: the default before ``auto``; the cap is the only difference measured
    uncapped = configs["default"]
    assert uncapped.max_calls_per_server == CALLS_PER_SERVER_CEILING
    assert dataclasses.replace(configs["default_knee"], max_calls_per_server=CALLS_PER_SERVER_CEILING) == uncapped


def test_the_summary_pairs_seeds(bench_module: Callable[[str], ModuleType]) -> None:
    knee = bench_module("sim_knee")
    per_token = {"sync": [2.0, 3.0], "default": [2.0, 2.0], "default_knee": [1.0, 2.0], "default_half_knee": [4.0, 4.0]}
    rows = [{"shape": "H20", "mode": mode, "ms_per_trained_token": values} for mode, values in per_token.items()]
    # seed by seed: uncapped over knee 2/1 and 2/2, over half 2/4 twice; sync over uncapped 2/2, 3/2; over knee 2/1, 3/2
    assert knee.summary(rows, {"H20": 26}) == (
        "H20 (knee 26): over uncapped, at the knee 1.50x (1.00-2.00), at half 0.50x (0.50-0.50); over sync, uncapped "
        "1.25x (1.00-1.50), at the knee 1.75x (1.50-2.00)"
    )
