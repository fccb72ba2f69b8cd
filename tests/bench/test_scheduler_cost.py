"""benchmarks/bench_scheduler_cost.py at a tiny size: its counts add up (its launch rule is the glue's LaunchWindow)."""

from __future__ import annotations

import time


def test_counts_are_consistent_at_a_tiny_size(bench_module) -> None:
    bench = bench_module("bench_scheduler_cost")
    started = time.monotonic()
    results = bench.measure(prompts=8, n=4, steps=2, servers=2, workers=3)
    assert time.monotonic() - started < 10
    assert results["verl_ray_calls_per_step"] == 3
    for step in results["steps"]:
        ray = step["ray_calls"]
        assert step["trained_groups"] == 8
        assert step["launched"] == step["answered"] > 0 and step["outstanding_after"] == 0
        assert step["wakeups"] > 0
        assert 1 <= ray["run_segments"] <= step["waves"] * 3  # one per worker touched per launch window
        assert ray["abort"] == ray["resume"] == 2  # every server aborted and reopened at the step end
        assert 1 <= ray["score"] <= 2 * step["trained_groups"]  # finished groups scored while generating, batched
        assert step["ray_calls_total"] == sum(ray.values())
