"""Statistics shared by the simulator's tables and the benchmarks that compare trained answer lengths."""

from __future__ import annotations

import numpy as np


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs.

    Both CDFs are read at every observed value, right-continuous, so tied values (token counts tie often) count once
    on each side. Used as the length-bias measure: a schedule that trains short answers first shifts the trained
    length distribution away from the one synchronous rollout trains.
    """
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(
        np.max(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)))
    )
