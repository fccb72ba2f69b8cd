"""Rank assignment: inside each mini-batch, samples (or whole groups) onto dp ranks with exactly m rows each.

Once mini-batch membership is fixed, a step waits for its slowest rank; this is step 2 of
:func:`verl_partial.core.balance.groups.balance_groups`, and on its own (:func:`assign_ranks`) it lets
benchmarks score other memberships with the same rank step.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from verl_partial.core.balance.layout import as_costs
from verl_partial.core.balance.packing import pack_exact
from verl_partial.core.balance.partition import bin_floor, equal_count_candidates, refine_swaps, slots_of

__all__ = ["assign_ranks", "assign_ranks_per_minibatch", "ranks_keeping_groups"]

# keep_group_on_rank: a whole-group rank layout is kept unless cutting a few groups across ranks gives a
# max rank cost more than 5% lower (cutting only loses some prefix sharing; imbalance costs every step).
_KEEP_WHOLE_SLACK = 0.05


def assign_ranks(
    costs: Sequence[float] | np.ndarray, minibatch: Sequence[int] | np.ndarray, *, dp_size: int
) -> np.ndarray:
    """Step 2 alone: given each sample's mini-batch (0..K-1, every one holding the same multiple of
    ``dp_size`` samples), the rank of each sample, balancing each mini-batch's ranks with equal counts.

    ``balance.balance_groups`` uses it after packing groups; benchmarks use it to score other mini-batch
    memberships (e.g. random whole-group assignment) with the same rank step.
    """
    c = as_costs(costs)
    mb = np.asarray(minibatch, dtype=np.int64).reshape(-1)
    if mb.shape[0] != c.shape[0] or (mb.size and mb.min() < 0):
        raise ValueError("minibatch must give a non-negative mini-batch index per cost")
    counts = np.bincount(mb)
    if mb.size and (np.any(counts != counts[0]) or counts[0] % dp_size):
        raise ValueError(f"every mini-batch must hold the same multiple of dp_size={dp_size} samples, got {counts}")
    return assign_ranks_per_minibatch(c, mb, counts.shape[0], operator.index(dp_size))


def assign_ranks_per_minibatch(c: np.ndarray, sample_mb: np.ndarray, n_mb: int, dp_size: int) -> np.ndarray:
    """Per mini-batch the best of three equal-count heuristics, then one swap polish over all of them."""
    n = c.shape[0]
    if dp_size == 1:
        return np.zeros(n, dtype=np.int64)
    rows = np.argsort(sample_mb, kind="stable").reshape(n_mb, -1)  # [K, M] sample indices
    slots = np.empty((n_mb, dp_size, rows.shape[1] // dp_size), dtype=np.int64)
    floor = np.empty(n_mb)
    for j in range(n_mb):
        x = c[rows[j]]
        slots[j] = rows[j][slots_of(equal_count_candidates(x, dp_size), dp_size)]
        floor[j] = bin_floor(x, dp_size)
    refine_swaps(slots, c, floor)
    sample_rank = np.empty(n, dtype=np.int64)
    sample_rank[slots.reshape(n_mb, -1)] = np.repeat(np.arange(dp_size), slots.shape[2])[None, :]
    return sample_rank


def ranks_keeping_groups(
    rows: np.ndarray, codes: np.ndarray, c: np.ndarray, dp_size: int, per_rank: int
) -> tuple[np.ndarray, bool]:
    """Assign one mini-batch's rows to ranks, whole groups into slots of exactly ``per_rank`` rows.

    Returns (rank per row, degraded). Groups larger than a slot are cut into slot-sized chunks; when whole
    groups cannot fill the slots exactly, or only with a clearly worse balance (more than
    ``_KEEP_WHOLE_SLACK``), a few groups are cut across ranks -- they still stay inside this mini-batch --
    and ``degraded`` is True.
    """
    _, inv = np.unique(codes[rows], return_inverse=True)
    sizes = np.bincount(inv)
    local = np.argsort(inv, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)))
    chunks: list[np.ndarray] = []
    for g in range(sizes.shape[0]):
        members = local[starts[g] : starts[g + 1]]
        chunks.extend(members[i : i + per_rank] for i in range(0, members.size, per_rank))
    ch_sizes = np.array([ch.size for ch in chunks], dtype=np.int64)
    ch_costs = np.array([c[rows[ch]].sum() for ch in chunks], dtype=np.float64)
    packing = pack_exact(ch_sizes, ch_costs, dp_size, per_rank, allow_split=True, whole_slack=_KEEP_WHOLE_SLACK)
    assert packing is not None  # cutting always succeeds once every unit fits a slot
    out = np.empty(rows.shape[0], dtype=np.int64)
    consumed: dict[int, int] = {}
    for unit, b, count in zip(
        packing.origin.tolist(), packing.labels.tolist(), packing.piece_size.tolist(), strict=True
    ):
        off = consumed.get(unit, 0)
        out[chunks[unit][off : off + count]] = b
        consumed[unit] = off + count
    return out, bool(packing.cut_units) or len(chunks) != sizes.shape[0]
