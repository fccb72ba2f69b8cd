"""benchmarks/sim_fill_engine.py: the summary pairs seeds and names the uncapped figure only where the cache binds."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def _rows(shape: str, preemptions: int) -> list[dict]:
    per_token = {
        "sync": [2.0, 3.0],
        "default": [1.0, 2.0],
        "default_by_groups": [1.0, 3.0],
        "default_kv_off": [1.0, 1.5],
    }
    return [{"shape": shape, "mode": mode, "ms_per_trained_token": values, "preemptions": [preemptions, 0]}
            for mode, values in per_token.items()]  # fmt: skip


def test_the_summary_names_the_kv_figure_where_the_cache_binds(bench_module: Callable[[str], ModuleType]) -> None:
    fill = bench_module("sim_fill_engine")
    text = fill.summary(_rows("roomy", 0) + _rows("KV-bound", 5))
    roomy, bound = text.split("; ")
    # seed by seed: sync 2/1 and 3/2, by groups 1/1 and 3/2, not capped by the cache 2/1 and 3/1.5
    assert roomy == "roomy: 1.25x (1.00-1.50) over fill_engine off, 1.75x (1.50-2.00) over sync"
    assert bound.endswith("over sync, KV cap off 2.00x (2.00-2.00)")
