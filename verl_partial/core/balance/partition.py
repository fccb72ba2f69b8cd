"""Equal-count partition: split items into k bins holding the same number of items, minimising the heaviest bin.

Balancing needs it twice: inside a mini-batch, samples onto dp ranks with exactly m rows each (verl's
shard sizes are fixed), and across mini-batches, equal-size groups onto K mini-batches. Three cheap
constructions run (Karmarkar-Karp, round-based and count-capped largest-first), the best is kept, then a
vectorised swap polish runs over many partitions at once.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

__all__ = [
    "REFINE_MAX_PASSES",
    "REFINE_RTOL",
    "bin_floor",
    "equal_count_candidates",
    "equal_count_partition",
    "lpt_rounds_batched",
    "refine_swaps",
    "slots_of",
]

# The swap polish stops once the heaviest bin is within this fraction of the mean: 2e-4 is far below
# step-time noise, and chasing the last digits costs milliseconds.
REFINE_RTOL = 2e-4
# Each pairwise-swap pass is O(m log m); cap the passes per mini-batch so runtime stays bounded.
REFINE_MAX_PASSES = 64


def _lpt_rounds(costs: np.ndarray, k: int) -> np.ndarray:
    """Round-based largest-first: each round hands the k largest remaining items, largest to lightest bin."""
    return lpt_rounds_batched(costs[None, :], k)[0][0]


def lpt_rounds_batched(costs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_lpt_rounds` on every row of ``costs`` at once: (labels per row, bin loads per row)."""
    n_rows, n = costs.shape
    order = np.argsort(-costs, axis=1, kind="stable")
    desc = np.take_along_axis(costs, order, axis=1)
    labels = np.empty((n_rows, n), dtype=np.int64)
    loads = np.zeros((n_rows, k), dtype=np.float64)
    rows = np.arange(n_rows)[:, None]
    for start in range(0, n, k):
        bins = np.argsort(loads, axis=1, kind="stable")
        loads[rows, bins] += desc[:, start : start + k]
        labels[rows, order[:, start : start + k]] = bins
    return labels, loads


def _kk_equal(costs: np.ndarray, k: int) -> np.ndarray:
    """Karmarkar-Karp with equal counts, set membership tracked by parent pointers (numpy, O(n log n))."""
    n = costs.shape[0]
    order = np.argsort(costs, kind="stable")
    parent = np.arange(n, dtype=np.int64)
    heap: list[tuple[float, float, int, np.ndarray, np.ndarray]] = []
    tie = itertools.count()
    for start in range(0, n, k):
        ids = order[start : start + k][::-1].copy()  # descending cost
        sums = costs[ids]
        heap.append((-(sums[0] - sums[-1]), -sums[0], next(tie), sums, ids))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, _, sums0, ids0 = heapq.heappop(heap)
        _, _, _, sums1, ids1 = heapq.heappop(heap)
        # Largest set of one state joins the smallest of the other: the differencing step.
        merged = sums0 + sums1[::-1]
        parent[ids1[::-1]] = ids0
        o = np.argsort(-merged, kind="stable")
        sums, ids = merged[o], ids0[o]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], next(tie), sums, ids))
    final_ids = heap[0][4]
    root = parent
    while True:
        nxt = root[root]
        if np.array_equal(nxt, root):
            break
        root = nxt
    label_of_root = np.full(n, -1, dtype=np.int64)
    label_of_root[final_ids] = np.arange(k)
    return label_of_root[root]


def refine_swaps(
    slots: np.ndarray,
    costs: np.ndarray,
    floor: np.ndarray,
    max_passes: int = REFINE_MAX_PASSES,
) -> None:
    """Swap polish of many equal-count partitions at once (in place).

    ``slots[p, b, :]`` are the item indices (into ``costs``) of bin b of partition p. Each pass, in every
    partition still above its target, one item of the heaviest bin swaps with a cheaper item of one of the
    four lightest bins, chosen so the moved difference is as close as possible to half their gap (which
    minimises the new max of the two). A swap keeps every bin's item count. A partition stops when its
    heaviest bin is within ``REFINE_RTOL`` of max(mean, ``floor[p]``) (a lower bound the caller knows) or
    no swap helps. All partitions advance together in numpy, so the cost is per pass, not per partition.
    """
    n_parts, k, per_bin = slots.shape
    if k == 1 or per_bin == 0:
        return
    vals = costs[slots]  # [P, k, per_bin], kept in step with slots
    loads = vals.sum(axis=2)
    mean = loads.mean(axis=1)
    tol = REFINE_RTOL * np.maximum(mean, 1e-12)
    target = np.maximum(mean, floor)
    n_lo = min(16, k - 1)
    active = np.ones(n_parts, dtype=bool)
    for _ in range(max_passes):
        hi = loads.argmax(axis=1)
        parts = np.arange(n_parts)
        active &= loads[parts, hi] - target > tol
        ps = np.flatnonzero(active)
        if ps.size == 0:
            return
        hi = hi[ps]
        lo = np.argsort(loads[ps], axis=1, kind="stable")[:, :n_lo]  # [A, L]
        gap = loads[ps, hi][:, None] - loads[ps[:, None], lo]  # [A, L]
        a = vals[ps, hi]  # [A, per_bin]
        # Rows (partition, light bin) sorted by cost, laid end to end with offsets so that one global
        # searchsorted finds, for every heavy item, the light item closest to (heavy item - gap / 2).
        b_order = np.argsort(vals[ps[:, None], lo], axis=2, kind="stable")  # [A, L, per_bin]
        b_sorted = np.take_along_axis(vals[ps[:, None], lo], b_order, axis=2)
        span = 2.0 * float(max(vals.max(), gap.max(), 1.0)) + 1.0
        row_off = np.arange(ps.size * n_lo, dtype=np.float64).reshape(ps.size, n_lo) * span
        flat = (b_sorted + row_off[:, :, None]).ravel()
        want = a[:, None, :] - gap[:, :, None] / 2.0  # [A, L, per_bin]
        pos = np.searchsorted(flat, (want + row_off[:, :, None]).ravel()).reshape(want.shape)
        pos -= (np.arange(ps.size * n_lo) * per_bin).reshape(ps.size, n_lo, 1)
        best_err = np.full(ps.size, np.inf)
        best = np.zeros((ps.size, 3), dtype=np.int64)  # (light-bin column, heavy slot, light sorted slot)
        for cand in (np.clip(pos - 1, 0, per_bin - 1), np.clip(pos, 0, per_bin - 1)):
            delta = a[:, None, :] - np.take_along_axis(b_sorted, cand, axis=2)
            g = gap[:, :, None]
            t = tol[ps][:, None, None]
            err = np.where((delta > t) & (delta < g - t), np.abs(delta - g / 2.0), np.inf).reshape(ps.size, -1)
            idx = err.argmin(axis=1)
            e = err[np.arange(ps.size), idx]
            better = e < best_err
            col, slot = np.divmod(idx, per_bin)
            best_err = np.where(better, e, best_err)
            best[better] = np.stack([col, slot, cand.reshape(ps.size, -1)[np.arange(ps.size), idx]], axis=1)[better]
        moved = np.isfinite(best_err)
        active[ps[~moved]] = False
        if not moved.any():
            return
        ps, hi, lo, best = ps[moved], hi[moved], lo[moved], best[moved]
        lb = lo[np.arange(ps.size), best[:, 0]]
        ia = best[:, 1]
        jb = b_order[moved][np.arange(ps.size), best[:, 0], best[:, 2]]
        va, vb = vals[ps, hi, ia].copy(), vals[ps, lb, jb].copy()
        sa, sb = slots[ps, hi, ia].copy(), slots[ps, lb, jb].copy()
        vals[ps, hi, ia], vals[ps, lb, jb] = vb, va
        slots[ps, hi, ia], slots[ps, lb, jb] = sb, sa
        loads[ps, hi] -= va - vb
        loads[ps, lb] += va - vb


def slots_of(labels: np.ndarray, k: int) -> np.ndarray:
    """[k, per_bin] item indices of an equal-count labelling (bin b's items in row b)."""
    return np.argsort(labels, kind="stable").reshape(k, -1)


def _labels_of(slots: np.ndarray) -> np.ndarray:
    """Inverse of :func:`slots_of`."""
    k, per_bin = slots.shape
    labels = np.empty(k * per_bin, dtype=np.int64)
    labels[slots.ravel()] = np.repeat(np.arange(k), per_bin)
    return labels


def _lpt_cardinality(costs: np.ndarray, k: int) -> np.ndarray:
    """Largest-first with a count cap: the k largest items open the k bins, then each item, largest first,
    goes to the lightest bin that still has a free slot.

    Unlike the round-based variant, a bin holding a very large item is not forced to take an item every
    round: it waits while the others catch up and ends up with the smallest leftovers, which is what few
    items per bin with a heavy tail need.
    """
    n = costs.shape[0]
    per_bin = n // k
    order = np.argsort(-costs, kind="stable")
    labels = np.empty(n, dtype=np.int64)
    labels[order[:k]] = np.arange(k)
    if per_bin == 1:
        return labels
    costs_l = costs.tolist()
    heap = [(costs_l[i], b) for b, i in enumerate(order[:k].tolist())]
    heapq.heapify(heap)
    count = [1] * k
    out = labels.tolist()
    for i in order[k:].tolist():
        load, b = heap[0]
        out[i] = b
        count[b] += 1
        if count[b] < per_bin:
            heapq.heapreplace(heap, (load + costs_l[i], b))
        else:
            heapq.heappop(heap)
    return np.asarray(out, dtype=np.int64)


def equal_count_candidates(costs: np.ndarray, k: int) -> np.ndarray:
    """Best of KK, round-based and count-capped largest-first (unpolished), for ``len(costs)`` divisible by k.

    KK is usually best with many items per bin; largest-first can win on heavy tails with few items per
    bin. All three are cheap, so run them and keep the best. Round-based largest-first also bounds the
    result: max bin <= mean bin + largest item (each round adds at most the spread it removes).
    """
    n = costs.shape[0]
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    if n == k:
        return np.argsort(np.argsort(-costs, kind="stable"), kind="stable").astype(np.int64)
    best, best_max = None, np.inf
    for fn in (_kk_equal, _lpt_rounds, _lpt_cardinality):
        lab = fn(costs, k)
        mx = np.bincount(lab, weights=costs, minlength=k).max()
        if mx < best_max:
            best, best_max = lab, mx
    assert best is not None
    return best


def bin_floor(costs: np.ndarray, k: int) -> float:
    """No equal-count split into k bins beats max(mean, largest + the per_bin - 1 smallest)."""
    per_bin = costs.shape[0] // k
    head = float(np.sort(costs)[: per_bin - 1].sum() + costs.max()) if costs.size else 0.0
    return max(float(costs.sum()) / k, head)


def equal_count_partition(costs: np.ndarray, k: int) -> np.ndarray:
    """Split ``len(costs)`` (a multiple of k) items into k bins of equal count, minimising the max bin cost:
    :func:`equal_count_candidates`, then the swap polish."""
    labels = equal_count_candidates(costs, k)
    if k == 1:
        return labels
    slots = slots_of(labels, k)[None]
    refine_swaps(slots, costs, np.array([bin_floor(costs, k)]))
    return _labels_of(slots[0])
