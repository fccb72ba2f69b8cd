"""Group-preserving batch balancing: the pure algorithm (no verl, no torch).

Why this exists
---------------
verl's ``RayPPOTrainer._balance_batch`` reorders the batch so that each data-parallel rank gets a similar
total workload, balancing single samples over the *whole* batch. The actor later cuts each rank's
contiguous shard into mini-batches in order (one optimizer step each), so the samples of one group (a
prompt's ``rollout.n`` responses, or one multi-turn rollout's transitions) end up in different optimizer
steps. (verl's per-rank small-large-small re-sort also makes its mini-batches length-stratified: the first
and last hold the short samples, the middle ones the long samples.)

Layout contract (what verl does after ``batch.reorder(perm)``)::

    N rows, dp ranks, global mini-batch M samples, K = N / M mini-batches, m = M / dp rows per rank each
    rank r gets rows [r*N/dp, (r+1)*N/dp)  (contiguous equal chunks, verl's dispatch)
    mini-batch j on rank r = rows [r*N/dp + j*m, r*N/dp + (j+1)*m)  (actor, shuffle=False)

Algorithm
---------
1. Pack groups into K mini-batches of exactly M samples, two ways, and keep the better:
   * heavy together (:func:`_pack_by_heaviness`): with few rows per rank (small m) a mini-batch's slowest
     rank is set by its longest sample, so mini-batches are led by groups in order of their longest
     sample and topped up, heaviest first, where the heavy rank still stands alone;
   * spread (:func:`_pack_exact`): expensive groups spread evenly (largest cost first onto the lightest
     mini-batch with room), a representative mix of lengths per step. Equal group sizes dividing M take
     an equal-count fast path; unequal sizes get an exact-fill repair (subset-sum DP) when the greedy
     strands groups, then a complete backtracking search for the hard few-large-groups cases.
   The choice goes by the rank floor of each membership, close calls by a cheap rank step, ties to
   spread. If nothing fits: error, or with ``on_infeasible="split"`` the fewest groups the packer needs
   are cut (counted).
2. Inside each mini-batch, assign samples to dp ranks with exactly m each, minimising the largest rank
   cost (:func:`assign_ranks`): equal-count Karmarkar-Karp, round-based and count-capped largest-first all
   run (KK tends to win with many samples per rank, largest-first on heavy tails with few), the best is
   kept, then one swap polish runs over all mini-batches at once. With ``keep_group_on_rank`` whole
   groups are packed into rank slots of exactly m samples instead (same exact packer); where whole groups
   cannot fill the slots, or only with a >5% worse max rank cost, a few groups are cut across ranks
   inside that mini-batch and the mini-batch is counted.
3. Emit the permutation: rank-major, then mini-batch, then group (a group's rows stay adjacent).

Everything that is reported is recomputed from the final permutation by :func:`evaluate_permutation`,
which also measures any other permutation (e.g. verl's default) under the same rules.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from verl_partial.core.balance_config import ON_INFEASIBLE_MODES

__all__ = [
    "BalanceInfeasibleError",
    "BalanceResult",
    "BalanceStats",
    "balance_groups",
    "assign_ranks",
    "check_layout",
    "efficiency_lower_bound",
    "evaluate_permutation",
]

# The swap polish stops once the heaviest bin is within this fraction of the mean: 2e-4 is far below
# step-time noise, and chasing the last digits costs milliseconds.
_REFINE_RTOL = 2e-4
# Each pairwise-swap pass is O(m log m); cap the passes per mini-batch so runtime stays bounded.
_REFINE_MAX_PASSES = 64
# Largest (units in heavy bin) x (units in light bin) matrix the mixed-size swap polish will build.
_MAX_SWAP_MATRIX = 250_000
# keep_group_on_rank: a whole-group rank layout is kept unless cutting a few groups across ranks gives a
# max rank cost more than 5% lower (cutting only loses some prefix sharing; imbalance costs every step).
_KEEP_WHOLE_SLACK = 0.05
# Heap entries a unit may skip for lack of room before the heaviness packer scans all bins instead.
_HEAP_TRIES = 4
# Two candidate memberships whose rank floors differ by more than this fraction: keep the lower floor
# (the rank step lands within about 1 % of it at small m); closer calls are settled by a cheap rank step.
_CHOICE_MARGIN = 0.01
# Node budget of the exact backtracking search (hard cases with few, large groups); ~0.5 s worst case.
_SEARCH_BUDGET = 200_000
# ... and only for instances with at most this many groups (the recursion goes one level per group; the
# heuristics handle many small groups well, the search is for few large ones).
_SEARCH_MAX_UNITS = 300


class BalanceInfeasibleError(ValueError):
    """No arrangement satisfies the mini-batch rules for these sizes (message names the sizes)."""


@dataclass(frozen=True)
class BalanceStats:
    """How a permutation behaves under verl's dp-shard + mini-batch split.

    Attributes:
        num_samples: N.
        num_groups: Distinct group keys.
        dp_size: Data-parallel ranks.
        mini_batch_size: Global mini-batch size in samples (M).
        num_minibatches: K = N / M optimizer steps per epoch.
        groups_split: Groups whose samples fall into more than one mini-batch index, i.e. whose samples
            are spread over several optimizer steps. 0 is the goal.
        groups_split_across_ranks: Groups whose samples sit on more than one rank (only matters for
            ``keep_group_on_rank``/prefix sharing).
        minibatch_max_rank_cost: Per mini-batch, the largest rank cost (what the step waits for).
        minibatch_mean_rank_cost: Per mini-batch, the mean rank cost (the perfectly balanced time).
        efficiency: sum_j max_rank_cost_j / (total_cost / dp). 1.0 means no rank ever waits.
        efficiency_bound: Same sum with each max replaced by the rank floor of that mini-batch
            (:func:`_rank_floor`: the r heaviest samples with the cheapest rows their ranks must also hold):
            no rank assignment of the same mini-batches can do better, so efficiency - efficiency_bound is
            what the rank step leaves. It says nothing about membership: see :func:`efficiency_lower_bound`.
        fallback_groups_split: Groups deliberately cut by ``on_infeasible="split"``.
        rank_fallback_minibatches: Mini-batches where ``keep_group_on_rank`` could not be honoured.
    """

    num_samples: int
    num_groups: int
    dp_size: int
    mini_batch_size: int
    num_minibatches: int
    groups_split: int
    groups_split_across_ranks: int
    minibatch_max_rank_cost: tuple[float, ...]
    minibatch_mean_rank_cost: tuple[float, ...]
    efficiency: float
    efficiency_bound: float
    fallback_groups_split: int = 0
    rank_fallback_minibatches: int = 0

    def to_metrics(self, prefix: str = "balance/") -> dict[str, float]:
        """Flatten into scalar metrics for the trainer's logger."""
        mx = np.asarray(self.minibatch_max_rank_cost, dtype=np.float64)
        mean = np.asarray(self.minibatch_mean_rank_cost, dtype=np.float64)
        return {
            f"{prefix}groups_split": float(self.groups_split),
            f"{prefix}groups_split_across_ranks": float(self.groups_split_across_ranks),
            f"{prefix}num_groups": float(self.num_groups),
            f"{prefix}num_minibatches": float(self.num_minibatches),
            f"{prefix}efficiency": float(self.efficiency),
            f"{prefix}efficiency_bound": float(self.efficiency_bound),
            f"{prefix}minibatch_max_rank_cost_mean": float(mx.mean()) if mx.size else 0.0,
            f"{prefix}minibatch_max_rank_cost_max": float(mx.max()) if mx.size else 0.0,
            f"{prefix}minibatch_mean_rank_cost_mean": float(mean.mean()) if mean.size else 0.0,
            f"{prefix}fallback_groups_split": float(self.fallback_groups_split),
            f"{prefix}rank_fallback_minibatches": float(self.rank_fallback_minibatches),
        }


@dataclass(frozen=True)
class BalanceResult:
    """A permutation for ``DataProto.reorder`` and its measured stats."""

    perm: list[int]
    stats: BalanceStats


# ----------------------------------------------------------------------------------------------------------
# input handling
# ----------------------------------------------------------------------------------------------------------


def check_layout(num_samples: int, dp_size: int, mini_batch_size: int) -> int:
    """Validate the sizes verl needs and return the number of mini-batches K.

    These are hard errors whatever ``on_infeasible`` says: verl's dispatch and the actor's mini-batch
    iterator assert the same divisibility, so no reordering can make such a batch trainable.
    """
    if dp_size < 1:
        raise BalanceInfeasibleError(f"dp_size must be >= 1, got {dp_size}")
    if mini_batch_size < 1:
        raise BalanceInfeasibleError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
    if mini_batch_size % dp_size:
        raise BalanceInfeasibleError(
            f"mini_batch_size={mini_batch_size} samples is not divisible by dp_size={dp_size}: "
            "ranks would get unequal mini-batch shares"
        )
    if num_samples == 0 or num_samples % mini_batch_size:
        raise BalanceInfeasibleError(
            f"batch of N={num_samples} samples is not a positive multiple of mini_batch_size={mini_batch_size} "
            f"(ppo_mini_batch_size x rollout.n)"
        )
    return num_samples // mini_batch_size


def _as_costs(costs: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(costs, dtype=np.float64).reshape(-1)
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError("costs must be finite and non-negative")
    return arr


def _factorize(keys: Sequence[Hashable] | np.ndarray, n: int) -> tuple[np.ndarray, list[Hashable]]:
    """Integer codes in first-appearance order (keys only need to be hashable, not orderable)."""
    if len(keys) != n:
        raise ValueError(f"got {len(keys)} group keys for {n} costs")
    # dict.fromkeys keeps first-appearance order and runs the hashing loop in C.
    mapping = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    codes = np.fromiter(map(mapping.__getitem__, keys), dtype=np.int64, count=n)
    return codes, list(mapping)


# ----------------------------------------------------------------------------------------------------------
# equal-count partition (k bins, same number of items each)
# ----------------------------------------------------------------------------------------------------------


def _lpt_rounds(costs: np.ndarray, k: int) -> np.ndarray:
    """Round-based largest-first: each round hands the k largest remaining items, largest to lightest bin."""
    return _lpt_rounds_batched(costs[None, :], k)[0][0]


def _lpt_rounds_batched(costs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
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


def _refine_swaps(
    slots: np.ndarray,
    costs: np.ndarray,
    floor: np.ndarray,
    max_passes: int = _REFINE_MAX_PASSES,
) -> None:
    """Swap polish of many equal-count partitions at once (in place).

    ``slots[p, b, :]`` are the item indices (into ``costs``) of bin b of partition p. Each pass, in every
    partition still above its target, one item of the heaviest bin swaps with a cheaper item of one of the
    four lightest bins, chosen so the moved difference is as close as possible to half their gap (which
    minimises the new max of the two). A swap keeps every bin's item count. A partition stops when its
    heaviest bin is within ``_REFINE_RTOL`` of max(mean, ``floor[p]``) (a lower bound the caller knows) or
    no swap helps. All partitions advance together in numpy, so the cost is per pass, not per partition.
    """
    n_parts, k, per_bin = slots.shape
    if k == 1 or per_bin == 0:
        return
    vals = costs[slots]  # [P, k, per_bin], kept in step with slots
    loads = vals.sum(axis=2)
    mean = loads.mean(axis=1)
    tol = _REFINE_RTOL * np.maximum(mean, 1e-12)
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


def _slots_of(labels: np.ndarray, k: int) -> np.ndarray:
    """[k, per_bin] item indices of an equal-count labelling (bin b's items in row b)."""
    return np.argsort(labels, kind="stable").reshape(k, -1)


def _labels_of(slots: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_slots_of`."""
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


def _equal_count_candidates(costs: np.ndarray, k: int) -> np.ndarray:
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


def _bin_floor(costs: np.ndarray, k: int) -> float:
    """No equal-count split into k bins beats max(mean, largest + the per_bin - 1 smallest)."""
    per_bin = costs.shape[0] // k
    head = float(np.sort(costs)[: per_bin - 1].sum() + costs.max()) if costs.size else 0.0
    return max(float(costs.sum()) / k, head)


def _equal_count_partition(costs: np.ndarray, k: int) -> np.ndarray:
    """Split ``len(costs)`` (a multiple of k) items into k bins of equal count, minimising the max bin cost:
    :func:`_equal_count_candidates`, then the swap polish."""
    labels = _equal_count_candidates(costs, k)
    if k == 1:
        return labels
    slots = _slots_of(labels, k)[None]
    _refine_swaps(slots, costs, np.array([_bin_floor(costs, k)]))
    return _labels_of(slots[0])


# ----------------------------------------------------------------------------------------------------------
# exact-size packing (n_bins bins, each exactly `capacity` samples), units are groups or group pieces
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Packing:
    """Result of exact packing: unit i (a piece of original unit origin[i], piece_size[i] samples) -> bin."""

    labels: np.ndarray
    origin: np.ndarray
    piece_size: np.ndarray
    cut_units: int  # original units cut into pieces by the split fallback


def _subset_exact(sizes: Sequence[int], target: int) -> tuple[list[int], int]:
    """Subset-sum by bitset DP: indices of a subset summing to ``target`` (or to the largest reachable
    sum below it), preferring earlier items. Returns (indices, reached_sum)."""
    mask = (1 << (target + 1)) - 1
    reach = [1]
    for s in sizes:
        r = reach[-1]
        reach.append((r | (r << int(s))) & mask)
    final = reach[-1]
    got = target
    while got > 0 and not (final >> got) & 1:
        got -= 1
    chosen: list[int] = []
    g = got
    for i in range(len(sizes) - 1, -1, -1):
        if g == 0:
            break
        if (reach[i] >> g) & 1:
            continue  # reachable without item i: skip it, so earlier items are preferred
        chosen.append(i)
        g -= int(sizes[i])
    return chosen, got


def _fill_gaps(
    sizes: Sequence[int],
    costs: Sequence[float],
    gaps: dict[int, int],
    allow_split: bool,
    bin_order: Sequence[int] | None = None,
) -> tuple[list[tuple[int, int, int]], int] | None:
    """Fill bin gaps exactly from a pool of units (sum of sizes == sum of gaps), one bin at a time.

    Feasibility mode (``bin_order`` None): smallest gaps first (most constrained), large units preferred
    (small ones keep later gaps fillable). Cost mode (``bin_order`` = lightest bin first, used with
    cutting): expensive units preferred, so the lightest bins take the expensive leftovers. Returns
    (unit, bin, count) placements -- count < size means the unit was cut -- and the number of units cut;
    None if a gap cannot be filled exactly and cutting is not allowed.
    """
    remaining = {i: int(s) for i, s in enumerate(sizes)}
    placements: list[tuple[int, int, int]] = []
    cut: set[int] = set()
    if bin_order is None:
        bins = sorted(gaps, key=lambda x: (gaps[x], x))

        def pool_key(i: int) -> tuple[float, float, int]:
            return (-remaining[i], -costs[i], i)
    else:
        bins = list(bin_order)

        def pool_key(i: int) -> tuple[float, float, int]:
            return (-costs[i], -remaining[i], i)

    for b in bins:
        gap = gaps[b]
        if gap == 0:
            continue
        pool = sorted(remaining, key=pool_key)
        chosen, got = _subset_exact([remaining[i] for i in pool], gap)
        if got != gap and not allow_split:
            return None
        for ci in chosen:
            u = pool[ci]
            placements.append((u, b, remaining.pop(u)))
        rest = gap - got
        if rest:
            # Cut the smallest unit larger than the hole; one exists, else the DP would have reached `gap`.
            u = min((i for i in remaining if remaining[i] > rest), key=lambda i: (remaining[i], i))
            placements.append((u, b, rest))
            remaining[u] -= rest
            cut.add(u)
    if remaining:
        return None
    return placements, len(cut)


def _greedy_fill(
    sizes: np.ndarray, costs: np.ndarray, n_bins: int, capacity: int, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Units in ``order`` onto the lightest bin that still has room; stranded units get label -1."""
    labels = np.full(sizes.shape[0], -1, dtype=np.int64)
    heap = [(0.0, b) for b in range(n_bins)]
    sizes_l, costs_l = sizes.tolist(), costs.tolist()
    room_l = [capacity] * n_bins
    for u in order.tolist():
        s = sizes_l[u]
        skipped = []
        while heap:
            load, b = heapq.heappop(heap)
            if room_l[b] >= s:
                labels[u] = b
                room_l[b] -= s
                if room_l[b] > 0:
                    heapq.heappush(heap, (load + costs_l[u], b))
                break
            skipped.append((load, b))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return labels, np.asarray(room_l, dtype=np.int64)


def _repair(
    labels: np.ndarray, room: np.ndarray, sizes: np.ndarray, costs: np.ndarray, capacity: int
) -> np.ndarray | None:
    """Fill the gaps the greedy left without cutting, releasing the open bins' cheapest units ever wider.

    Only open bins change, and only their cheapest units move, so the greedy's cost balance survives for
    almost everything. Returns complete labels or None.
    """
    open_bins = [int(b) for b in np.flatnonzero(room > 0)]
    max_size = int(sizes.max())
    for release in (2 * max_size, 8 * max_size, capacity):
        trial = labels.copy()
        gaps = {b: int(room[b]) for b in open_bins}
        for b in open_bins:
            members = np.flatnonzero(trial == b)
            freed = 0
            for u in members[np.argsort(costs[members], kind="stable")].tolist():
                if freed >= release:
                    break
                trial[u] = -1
                gaps[b] += int(sizes[u])
                freed += int(sizes[u])
        pool = np.flatnonzero(trial < 0)
        res = _fill_gaps(sizes[pool].tolist(), costs[pool].tolist(), gaps, allow_split=False)
        if res is not None:
            for u, b, _cnt in res[0]:
                trial[pool[u]] = b
            return trial
        if release >= capacity:
            break
    return None


def _cut_pack(sizes: np.ndarray, costs: np.ndarray, n_bins: int, capacity: int) -> _Packing:
    """Cost-first greedy, then close each open bin (lightest first) with the stranded units, cutting one
    where no exact fill exists. At most one cut per open bin; everything else keeps the greedy's balance."""
    labels, room = _greedy_fill(sizes, costs, n_bins, capacity, np.lexsort((-sizes, -costs)))
    keep = np.flatnonzero(labels >= 0)
    pool = np.flatnonzero(labels < 0)
    loads = np.bincount(labels[keep], weights=costs[keep], minlength=n_bins)
    gaps = {int(b): int(room[b]) for b in np.flatnonzero(room > 0)}
    order = sorted(gaps, key=lambda b: (loads[b], b))
    res = _fill_gaps(sizes[pool].tolist(), costs[pool].tolist(), gaps, allow_split=True, bin_order=order)
    assert res is not None  # cutting always closes a gap: the pool has exactly the missing samples
    extra = np.asarray(res[0], dtype=np.int64).reshape(-1, 3)
    origin = np.concatenate([keep, pool[extra[:, 0]]])
    piece = np.concatenate([sizes[keep], extra[:, 2]])
    out = np.concatenate([labels[keep], extra[:, 1]])
    # Pieces carry a pro-rata share of their unit's cost; polish with same-size swaps.
    piece_cost = costs[origin] * piece / sizes[origin]
    _refine_equal_size(out, piece, piece_cost, n_bins)
    return _Packing(out, origin, piece, res[1])


def _refine_equal_size(labels: np.ndarray, sizes: np.ndarray, costs: np.ndarray, k: int) -> None:
    """Swap polish for units of mixed sizes: only equal-size units swap, so bin sample counts stay exact."""
    loads = np.bincount(labels, weights=costs, minlength=k)
    tol = _REFINE_RTOL * max(float(loads.mean()), 1e-12)
    for _ in range(_REFINE_MAX_PASSES):
        hi = int(np.argmax(loads))
        a_idx = np.flatnonzero(labels == hi)
        moved = False
        for lo in np.argsort(loads, kind="stable")[:8].tolist():
            gap = loads[hi] - loads[lo]
            if gap <= tol:
                break
            b_idx = np.flatnonzero(labels == lo)
            if a_idx.size * b_idx.size == 0 or a_idx.size * b_idx.size > _MAX_SWAP_MATRIX:
                continue
            delta = costs[a_idx][:, None] - costs[b_idx][None, :]
            ok = (sizes[a_idx][:, None] == sizes[b_idx][None, :]) & (delta > tol) & (delta < gap - tol)
            if not ok.any():
                continue
            err = np.where(ok, np.abs(delta - gap / 2.0), np.inf)
            i, j = np.unravel_index(int(np.argmin(err)), err.shape)
            labels[a_idx[i]], labels[b_idx[j]] = lo, hi
            loads[hi] -= delta[i, j]
            loads[lo] += delta[i, j]
            moved = True
            break
        if not moved:
            return


class _SearchBudgetExceeded(Exception):
    pass


def _exact_search(sizes: np.ndarray, n_bins: int, capacity: int, budget: int = _SEARCH_BUDGET) -> np.ndarray | None:
    """Complete backtracking search for an exact packing (cost-blind), for the hard cases the heuristics miss:
    few, large units. Works on the multiset of sizes; each new bin takes the largest remaining unit first
    and sizes inside a bin are non-increasing (symmetry breaking); failed remainders are memoised.

    Returns labels, or None if no packing exists. Raises _SearchBudgetExceeded when the budget runs out.
    """
    distinct = sorted({int(s) for s in sizes.tolist()}, reverse=True)
    index = {s: i for i, s in enumerate(distinct)}
    counts = [0] * len(distinct)
    for s in sizes.tolist():
        counts[index[int(s)]] += 1
    # Cheap necessary condition first: some subset must sum to one bin (e.g. all sizes even, capacity odd).
    if _subset_exact(sizes.tolist(), capacity)[1] != capacity:
        return None
    if sizes.shape[0] > _SEARCH_MAX_UNITS:  # recursion depth ~ number of units
        raise _SearchBudgetExceeded
    bins: list[list[int]] = []
    failed: set[tuple[int, ...]] = set()
    nodes = 0

    def smallest_left() -> int:
        for i in range(len(distinct) - 1, -1, -1):
            if counts[i]:
                return distinct[i]
        return 0

    def open_bin() -> bool:
        key = tuple(counts)
        if not any(counts):
            return True
        if key in failed:
            return False
        first = next(i for i, k in enumerate(counts) if k)
        counts[first] -= 1
        bins.append([first])
        if fill(capacity - distinct[first], first):
            return True
        bins.pop()
        counts[first] += 1
        failed.add(key)
        return False

    def fill(room: int, start: int) -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > budget:
            raise _SearchBudgetExceeded
        if room == 0:
            return open_bin()
        if room < smallest_left():
            return False
        for i in range(start, len(distinct)):
            if counts[i] == 0 or distinct[i] > room:
                continue
            counts[i] -= 1
            bins[-1].append(i)
            if fill(room - distinct[i], i):
                return True
            bins[-1].pop()
            counts[i] += 1
        return False

    if not open_bin():
        return None
    assert len(bins) == n_bins
    pools: dict[int, list[int]] = {}
    for u in np.argsort(sizes, kind="stable").tolist():
        pools.setdefault(int(sizes[u]), []).append(u)
    labels = np.empty(sizes.shape[0], dtype=np.int64)
    for b, members in enumerate(bins):
        for i in members:
            labels[pools[distinct[i]].pop()] = b
    return labels


def _max_load(p: _Packing, costs: np.ndarray, sizes: np.ndarray, n_bins: int) -> float:
    share = costs[p.origin] * p.piece_size / sizes[p.origin]
    return float(np.bincount(p.labels, weights=share, minlength=n_bins).max())


def _pack_exact(
    sizes: np.ndarray,
    costs: np.ndarray,
    n_bins: int,
    capacity: int,
    allow_split: bool = False,
    whole_slack: float | None = None,
) -> _Packing | None:
    """Pack units (sizes, costs) into n_bins bins of exactly ``capacity`` samples, balancing bin cost.

    Requires sum(sizes) == n_bins * capacity and every size <= capacity. Whole-unit attempts, in order:
    the equal-size fast path; cost-first greedy + exact repair; size-first greedy + repair; a cost-blind
    exact fill of all bins. If none works and ``allow_split``, units are cut (:func:`_cut_pack`).

    ``whole_slack`` (only with ``allow_split``): when set, a whole-unit packing is kept only if its max bin
    cost is within (1 + whole_slack) of the cutting packing's; used where cutting costs little (groups
    across ranks) but imbalance costs every step. With None a whole packing always wins (mini-batches,
    where cutting a group is a correctness issue).
    """
    n_units = sizes.shape[0]
    ident = np.arange(n_units, dtype=np.int64)
    if n_bins == 1:
        return _Packing(np.zeros(n_units, dtype=np.int64), ident, sizes.copy(), 0)
    s0 = int(sizes[0])
    if np.all(sizes == s0) and capacity % s0 == 0:
        # Equal sizes: exactly capacity/s0 units per bin, a pure equal-count cost partition.
        return _Packing(_equal_count_partition(costs, n_bins), ident, sizes.copy(), 0)

    whole: _Packing | None = None
    for order in (np.lexsort((-sizes, -costs)), np.lexsort((-costs, -sizes))):
        labels, room = _greedy_fill(sizes, costs, n_bins, capacity, order)
        if (labels < 0).any():
            labels = _repair(labels, room, sizes, costs, capacity)
        if labels is not None:
            whole = _Packing(labels, ident, sizes.copy(), 0)
            break
    if whole is None and whole_slack is None:
        # Cost-blind, so only worth it when a whole packing is required (it rarely beats cutting on balance).
        res = _fill_gaps(sizes.tolist(), costs.tolist(), dict.fromkeys(range(n_bins), capacity), allow_split=False)
        if res is not None:
            labels = np.empty(n_units, dtype=np.int64)
            for u, b, _cnt in res[0]:
                labels[u] = b
            whole = _Packing(labels, ident, sizes.copy(), 0)
    if whole is None and whole_slack is None:
        try:
            labels = _exact_search(sizes, n_bins, capacity)
        except _SearchBudgetExceeded:
            labels = None
        if labels is not None:
            whole = _Packing(labels, ident, sizes.copy(), 0)
    if whole is not None:
        _refine_equal_size(whole.labels, sizes, costs, n_bins)
        if not allow_split or whole_slack is None:
            return whole
    if not allow_split:
        return None
    cut = _cut_pack(sizes, costs, n_bins, capacity)
    if whole is not None and _max_load(whole, costs, sizes, n_bins) <= (1.0 + whole_slack) * _max_load(
        cut, costs, sizes, n_bins
    ):
        return whole
    return cut


def _pack_by_heaviness(
    sizes: np.ndarray,
    costs: np.ndarray,
    heads: np.ndarray,
    n_bins: int,
    capacity: int,
    dp_size: int,
) -> np.ndarray:
    """Units -> mini-batches of exactly ``capacity`` samples, heavy units together (whole units only).

    A mini-batch's slowest rank costs at least max(total / dp, head): ``head`` is its heaviest atom (a
    sample, or a group with ``keep_group_on_rank``), which one rank must carry whole. The first term is
    fixed in sum over mini-batches; the second is waste whenever it exceeds the first. So:

    1. Leaders: sort units by head (heaviest first); mini-batch j is led by the unit holding sample
       position j * capacity of that order. This makes the sum of the K heads as small as it can be (the
       j-th largest head of any layout is at least this leader's, see :func:`efficiency_lower_bound`).
    2. Every other unit, heaviest head first, joins the mini-batch with the largest deficit
       head - total / dp among those whose leader is at least as heavy (so no head rises) and that have
       room: heavy mini-batches are topped up until their heavy rank is no longer alone in setting the
       step time; once none has a deficit, units go where the surplus is smallest, spreading the rest
       evenly.

    A unit that finds no room there (unequal sizes fragment it) takes the heaviest-led bin beyond with
    room. Returns labels, with -1 for units stranded even so (the caller repairs). Requires every
    size <= capacity (then the leaders are distinct units).
    """
    n_units = sizes.shape[0]
    order = np.lexsort((-costs, -heads))
    cum = np.cumsum(sizes[order])
    leaders = order[np.searchsorted(cum, np.arange(n_bins) * capacity, side="right")]
    labels = np.full(n_units, -1, dtype=np.int64)
    labels[leaders] = np.arange(n_bins)
    head_of_bin = heads[leaders].astype(np.float64)  # non-increasing in j
    room = (capacity - sizes[leaders]).astype(np.int64)
    load = costs[leaders].astype(np.float64)
    # Python mirrors of the three arrays for the scalar hot path; numpy copies for the rare scans.
    head_l, room_l, load_l = head_of_bin.tolist(), room.tolist(), load.tolist()
    stamp = [0] * n_bins  # bumped on every change; heap entries with an old stamp are stale
    inv_dp = 1.0 / dp_size
    is_leader = np.zeros(n_units, dtype=bool)
    is_leader[leaders] = True
    rest = order[~is_leader[order]]
    # bins whose leader head >= the unit's head: a prefix 0..reach-1, growing as heads fall
    reach_of = np.searchsorted(-head_of_bin, -heads[rest], side="right").tolist()
    out = labels.tolist()
    heap: list[tuple[float, int, int]] = []
    eligible = 0
    for u, reach, s, cost, head in zip(
        rest.tolist(), reach_of, sizes[rest].tolist(), costs[rest].tolist(), heads[rest].tolist(), strict=True
    ):
        while eligible < reach:
            if room_l[eligible] > 0:
                heapq.heappush(heap, (load_l[eligible] * inv_dp - head_l[eligible], eligible, stamp[eligible]))
            eligible += 1
        b = -1
        skipped = []
        while heap and len(skipped) < _HEAP_TRIES:
            entry = heapq.heappop(heap)
            if entry[2] != stamp[entry[1]]:
                continue
            if room_l[entry[1]] < s:
                skipped.append(entry)
                continue
            b = entry[1]
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if b < 0:
            # Room is fragmented (unequal sizes): scan the eligible bins for the largest deficit that fits,
            # else take the heaviest-led bin beyond them that fits, raising its head as little as possible.
            fits = np.flatnonzero(room[:reach] >= s)
            if fits.size:
                b = int(fits[np.argmax(head_of_bin[fits] - load[fits] * inv_dp)])
            else:
                beyond = np.flatnonzero(room[reach:] >= s)
                if beyond.size == 0:
                    continue  # stranded: the caller repairs
                b = reach + int(beyond[0])
                head_l[b] = head_of_bin[b] = max(head_l[b], head)
        out[u] = b
        room_l[b] -= s
        load_l[b] += cost
        room[b], load[b] = room_l[b], load_l[b]
        stamp[b] += 1
        if room_l[b] > 0 and b < eligible:
            heapq.heappush(heap, (load_l[b] * inv_dp - head_l[b], b, stamp[b]))
    return np.asarray(out, dtype=np.int64)


def _pack_minibatches(
    sizes: np.ndarray,
    costs: np.ndarray,
    max_sample: np.ndarray,
    n_bins: int,
    dp_size: int,
    capacity: int,
    keep_group_on_rank: bool,
) -> _Packing | None:
    """Step 1 of :func:`balance_groups`: :func:`_pack_by_heaviness`, then the exact repair for stranded
    units; None when that fails (the caller falls back to :func:`_pack_exact`'s search and cutting)."""
    ident = np.arange(sizes.shape[0], dtype=np.int64)
    if n_bins == 1:
        return _Packing(np.zeros(sizes.shape[0], dtype=np.int64), ident, sizes.copy(), 0)
    # The rank atom: a sample, or with keep_group_on_rank a group (its rank-slot-sized share if larger).
    heads = costs * np.minimum(1.0, (capacity // dp_size) / sizes) if keep_group_on_rank else max_sample
    labels = _pack_by_heaviness(sizes, costs, heads, n_bins, capacity, dp_size)
    if (labels < 0).any():
        placed = labels >= 0
        room = capacity - np.bincount(labels[placed], weights=sizes[placed], minlength=n_bins).astype(np.int64)
        repaired = _repair(labels, room, sizes, costs, capacity)
        if repaired is None:
            return None
        labels = repaired
    return _Packing(labels, ident, sizes.copy(), 0)


# ----------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------


def _describe_sizes(sizes: np.ndarray) -> str:
    hist = Counter(sizes.tolist())
    return "{" + ", ".join(f"{s}: {c}" for s, c in sorted(hist.items(), reverse=True)) + "}"


def balance_groups(
    costs: Sequence[float] | np.ndarray,
    group_keys: Sequence[Hashable] | np.ndarray,
    *,
    dp_size: int,
    mini_batch_size: int,
    keep_group_on_rank: bool = False,
    on_infeasible: str = "error",
) -> BalanceResult:
    """Plan a permutation that keeps every group inside one mini-batch and balances ranks per mini-batch.

    Args:
        costs: Per-sample cost (any non-negative unit; only ratios matter).
        group_keys: Per-sample hashable group id (e.g. the ``uid`` column).
        dp_size: Data-parallel ranks the actor's batch is chunked over.
        mini_batch_size: The actor's global mini-batch in samples (``ppo_mini_batch_size * rollout.n``).
        keep_group_on_rank: Also keep each group on one rank where sizes allow (see module docs).
        on_infeasible: ``"error"`` raises :class:`BalanceInfeasibleError`; ``"split"`` cuts groups as
            needed and counts them in ``stats.fallback_groups_split``.

    Returns:
        A :class:`BalanceResult` whose ``perm`` is for ``DataProto.reorder`` (row i of the result is row
        ``perm[i]`` of the input).

    Raises:
        BalanceInfeasibleError: sizes are incompatible (always for divisibility), or groups cannot be packed
            into whole mini-batches and ``on_infeasible == "error"``.
    """
    if on_infeasible not in ON_INFEASIBLE_MODES:
        raise ValueError(f"on_infeasible must be one of {list(ON_INFEASIBLE_MODES)}, got {on_infeasible!r}")
    dp_size, mini_batch_size = operator.index(dp_size), operator.index(mini_batch_size)  # numpy ints -> int
    c = _as_costs(costs)
    n = c.shape[0]
    codes, _ = _factorize(group_keys, n)
    n_mb = check_layout(n, dp_size, mini_batch_size)
    per_rank = mini_batch_size // dp_size
    allow_split = on_infeasible == "split"

    # Units = groups, laid out CSR-style: samples of group g are by_group[starts[g]:starts[g+1]].
    by_group = np.argsort(codes, kind="stable")
    g_sizes = np.bincount(codes)
    g_costs = np.bincount(codes, weights=c)
    starts = np.concatenate(([0], np.cumsum(g_sizes)))

    # --- step 1: groups -> mini-batches ------------------------------------------------------------------
    unit_samples: list[np.ndarray] | None = None
    u_sizes, u_costs = g_sizes, g_costs
    presplit: set[int] = set()
    too_big = np.flatnonzero(g_sizes > mini_batch_size)
    if too_big.size:
        if not allow_split:
            raise BalanceInfeasibleError(
                f"{too_big.size} group(s) are larger than a mini-batch: sizes {sorted(g_sizes[too_big].tolist())[:8]} "
                f"> mini_batch_size={mini_batch_size}; a group cannot stay in one optimizer step "
                "(set balance.on_infeasible=split to cut them)"
            )
        # Cut oversized groups into mini-batch-sized chunks (+ remainder); each chunk is its own unit.
        unit_samples = []
        for g in range(g_sizes.shape[0]):
            rows = by_group[starts[g] : starts[g + 1]]
            if rows.size > mini_batch_size:
                presplit.add(g)
                unit_samples.extend(rows[i : i + mini_batch_size] for i in range(0, rows.size, mini_batch_size))
            else:
                unit_samples.append(rows)
        u_sizes = np.array([u.size for u in unit_samples], dtype=np.int64)
        u_costs = np.array([c[u].sum() for u in unit_samples], dtype=np.float64)
        u_max = np.array([c[u].max() for u in unit_samples], dtype=np.float64)
        unit_group = np.array([codes[u[0]] for u in unit_samples], dtype=np.int64)
    else:
        u_max = np.maximum.reduceat(c[by_group], starts[:-1])
        unit_group = np.arange(g_sizes.shape[0], dtype=np.int64)

    # Two memberships: heavy groups together (what few rows per rank need) and expensive groups spread
    # evenly (a representative mix per step; as good or better when heavy groups bring many heavy rows).
    spread = _pack_exact(u_sizes, u_costs, n_mb, mini_batch_size, allow_split=allow_split)
    clustered = _pack_minibatches(u_sizes, u_costs, u_max, n_mb, dp_size, mini_batch_size, keep_group_on_rank)
    packings = [p for p in (spread, clustered) if p is not None]
    if not packings:
        try:
            proven = _exact_search(u_sizes, n_mb, mini_batch_size) is None
        except _SearchBudgetExceeded:
            proven = False
        verdict = "no arrangement exists" if proven else "no arrangement found within the search budget"
        raise BalanceInfeasibleError(
            f"cannot pack group sizes {_describe_sizes(u_sizes)} (size: count) into {n_mb} mini-batch(es) of "
            f"exactly {mini_batch_size} samples each (N={n}, dp_size={dp_size}): {verdict}; "
            "set balance.on_infeasible=split to cut groups"
        )
    packings = [p for p in packings if p.cut_units == 0] or packings

    def membership(packing: _Packing) -> tuple[np.ndarray, set[int]]:
        """Mini-batch per sample, and the groups the packing cut across mini-batches."""
        if unit_samples is None and packing.origin.shape[0] == g_sizes.shape[0]:  # each group whole, once
            group_mb = np.empty(g_sizes.shape[0], dtype=np.int64)
            group_mb[packing.origin] = packing.labels
            return group_mb[codes], set()
        sample_mb = np.empty(n, dtype=np.int64)
        cut_groups = set(presplit)
        consumed: dict[int, int] = {}
        for unit, b, count in zip(
            packing.origin.tolist(), packing.labels.tolist(), packing.piece_size.tolist(), strict=True
        ):
            rows = unit_samples[unit] if unit_samples is not None else by_group[starts[unit] : starts[unit + 1]]
            off = consumed.get(unit, 0)
            sample_mb[rows[off : off + count]] = b
            consumed[unit] = off + count
            if count != rows.size:
                cut_groups.add(int(unit_group[unit]))
        # A cut group whose pieces ended up in one mini-batch after all (the polish may reunite them) is whole.
        return sample_mb, {g for g in cut_groups if np.unique(sample_mb[by_group[starts[g] : starts[g + 1]]]).size > 1}

    def ranks(sample_mb: np.ndarray) -> tuple[np.ndarray, int]:
        """Step 2, inside each mini-batch: samples (or groups) -> ranks; and the degraded mini-batches."""
        if not (keep_group_on_rank and dp_size > 1):
            return _assign_ranks(c, sample_mb, n_mb, dp_size), 0
        sample_rank = np.empty(n, dtype=np.int64)
        mb_order = np.argsort(sample_mb, kind="stable")
        degraded = 0
        for j in range(n_mb):
            rows = mb_order[j * mini_batch_size : (j + 1) * mini_batch_size]
            labels, cut = _ranks_keeping_groups(rows, codes, c, dp_size, per_rank)
            degraded += int(cut)
            sample_rank[rows] = labels
        return sample_rank, degraded

    def step_time(sample_mb: np.ndarray, sample_rank: np.ndarray) -> float:
        return float(np.bincount(sample_mb * dp_size + sample_rank, weights=c).reshape(n_mb, dp_size).max(1).sum())

    layouts = [membership(p) for p in packings]
    if len(layouts) == 2 and keep_group_on_rank:
        # The rank atom is a group, which sample-level floors do not see: run both rank steps, keep the faster.
        tried = [(mb, cut, *ranks(mb)) for mb, cut in layouts]
        sample_mb, cut_groups, sample_rank, rank_fallbacks = min(tried, key=lambda t: step_time(t[0], t[2]))
    else:
        if len(layouts) == 2:
            # The membership with the clearly lower rank floor wins; close calls go to the one whose slowest
            # ranks are lighter under round-based largest-first (cheap, all mini-batches at once), ties to
            # the spread membership.
            by_mb = [np.sort(c[np.argsort(mb, kind="stable")].reshape(n_mb, -1), axis=1) for mb, _ in layouts]
            score = [float(_rank_floor(x, dp_size).sum()) for x in by_mb]
            if min(score) >= (1.0 - _CHOICE_MARGIN) * max(score):
                score = [_rounds_step_time(x, dp_size) for x in by_mb]
            layouts = [layouts[int(np.argmin(score))]]
        sample_mb, cut_groups = layouts[0]
        sample_rank, rank_fallbacks = ranks(sample_mb)

    perm = np.lexsort((np.arange(n), codes, sample_mb, sample_rank))
    stats = _evaluate(
        perm,
        c,
        codes,
        dp_size,
        mini_batch_size,
        fallback_groups_split=len(cut_groups),
        rank_fallback_minibatches=rank_fallbacks,
    )
    return BalanceResult(perm=perm.tolist(), stats=stats)


def assign_ranks(
    costs: Sequence[float] | np.ndarray, minibatch: Sequence[int] | np.ndarray, *, dp_size: int
) -> np.ndarray:
    """Step 2 alone: given each sample's mini-batch (0..K-1, every one holding the same multiple of
    ``dp_size`` samples), the rank of each sample, balancing each mini-batch's ranks with equal counts.

    :func:`balance_groups` uses it after packing groups; benchmarks use it to score other mini-batch
    memberships (e.g. random whole-group assignment) with the same rank step.
    """
    c = _as_costs(costs)
    mb = np.asarray(minibatch, dtype=np.int64).reshape(-1)
    if mb.shape[0] != c.shape[0] or (mb.size and mb.min() < 0):
        raise ValueError("minibatch must give a non-negative mini-batch index per cost")
    counts = np.bincount(mb)
    if mb.size and (np.any(counts != counts[0]) or counts[0] % dp_size):
        raise ValueError(f"every mini-batch must hold the same multiple of dp_size={dp_size} samples, got {counts}")
    return _assign_ranks(c, mb, counts.shape[0], operator.index(dp_size))


def _assign_ranks(c: np.ndarray, sample_mb: np.ndarray, n_mb: int, dp_size: int) -> np.ndarray:
    """Per mini-batch the best of three equal-count heuristics, then one swap polish over all of them."""
    n = c.shape[0]
    if dp_size == 1:
        return np.zeros(n, dtype=np.int64)
    rows = np.argsort(sample_mb, kind="stable").reshape(n_mb, -1)  # [K, M] sample indices
    slots = np.empty((n_mb, dp_size, rows.shape[1] // dp_size), dtype=np.int64)
    floor = np.empty(n_mb)
    for j in range(n_mb):
        x = c[rows[j]]
        slots[j] = rows[j][_slots_of(_equal_count_candidates(x, dp_size), dp_size)]
        floor[j] = _bin_floor(x, dp_size)
    _refine_swaps(slots, c, floor)
    sample_rank = np.empty(n, dtype=np.int64)
    sample_rank[slots.reshape(n_mb, -1)] = np.repeat(np.arange(dp_size), slots.shape[2])[None, :]
    return sample_rank


def _ranks_keeping_groups(
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
    packing = _pack_exact(ch_sizes, ch_costs, dp_size, per_rank, allow_split=True, whole_slack=_KEEP_WHOLE_SLACK)
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


def evaluate_permutation(
    perm: Sequence[int] | np.ndarray,
    costs: Sequence[float] | np.ndarray,
    group_keys: Sequence[Hashable] | np.ndarray,
    *,
    dp_size: int,
    mini_batch_size: int,
) -> BalanceStats:
    """Measure any permutation (ours, verl's default, identity) under verl's shard + mini-batch split.

    ``perm`` has ``DataProto.reorder`` semantics: new row i is old row ``perm[i]``. ``costs`` and
    ``group_keys`` are in the original (pre-permutation) order.
    """
    dp_size, mini_batch_size = operator.index(dp_size), operator.index(mini_batch_size)
    c = _as_costs(costs)
    n = c.shape[0]
    codes, _ = _factorize(group_keys, n)
    p = np.asarray(perm, dtype=np.int64).reshape(-1)
    if p.shape[0] != n or not np.array_equal(np.sort(p), np.arange(n)):
        raise ValueError(f"perm is not a permutation of range({n})")
    check_layout(n, dp_size, mini_batch_size)
    return _evaluate(p, c, codes, dp_size, mini_batch_size)


def efficiency_lower_bound(
    costs: Sequence[float] | np.ndarray,
    group_keys: Sequence[Hashable] | np.ndarray,
    *,
    dp_size: int,
    mini_batch_size: int,
) -> float:
    """A floor on ``efficiency`` for *every* layout that keeps groups whole in mini-batches of equal size.

    Unlike ``BalanceStats.efficiency_bound`` (which fixes the mini-batches and bounds only the rank step),
    this bound lets mini-batch membership vary. With S the total cost, m = mini_batch_size / dp_size,
    e the sum of the m - 1 cheapest samples of the batch, and for any layout y_j the heaviest sample of
    mini-batch j and S_j its total:

    * The slowest rank of mini-batch j costs at least max(S_j / dp, y_j + e) (it holds the heaviest
      sample and m - 1 others).
    * Sort groups by their heaviest sample (``head``), heaviest first, and let t_j be the head of the
      group covering sample position j * M (0-based, j = 0..K-1). Ordering mini-batches by y, the j-th
      has y >= t_j: otherwise every group with head >= t_j -- more than j * M samples -- would have to
      fit into the j mini-batches before it.
    * A mini-batch whose heaviest sample is y holds only groups with head <= y, so S_j <= C(y), the most
      cost M samples of such groups can carry (fractional knapsack by cost per sample, an over-estimate).

    Summing: sum_j max(S_j/dp, y_j + e) = S/dp + sum_j max(0, y_j + e - S_j/dp)
    >= S/dp + sum_j min_{y >= t_j} max(0, y + e - C(y)/dp), and also >= sum_j (t_j + e). The larger of
    the two, divided by S/dp, is returned (1.0 for an all-zero batch). It ignores that the rank holding
    the heaviest sample may need more than the cheapest companions, so it can be loose where many
    heavy samples share a mini-batch; it is never above the optimum.
    """
    dp_size, mini_batch_size = operator.index(dp_size), operator.index(mini_batch_size)
    c = _as_costs(costs)
    n = c.shape[0]
    codes, _ = _factorize(group_keys, n)
    n_mb = check_layout(n, dp_size, mini_batch_size)
    total = float(c.sum())
    if total <= 0:
        return 1.0
    per_rank = mini_batch_size // dp_size
    sizes = np.bincount(codes)
    if sizes.max() > mini_batch_size:
        raise BalanceInfeasibleError(f"a group has {sizes.max()} samples > mini_batch_size={mini_batch_size}")
    g_cost = np.bincount(codes, weights=c)
    by_group = np.argsort(codes, kind="stable")
    heads = np.maximum.reduceat(c[by_group], np.concatenate(([0], np.cumsum(sizes)[:-1])))
    extra = float(np.sort(c)[: per_rank - 1].sum())

    order = np.argsort(-heads, kind="stable")
    t = heads[order][np.searchsorted(np.cumsum(sizes[order]), np.arange(n_mb) * mini_batch_size, side="right")]

    # C(y) at every distinct head y, groups added in ascending head order into a Fenwick tree indexed by
    # cost-per-sample rank; the densest M samples are found by binary descent.
    n_groups = sizes.shape[0]
    density = g_cost / sizes
    dens_order = np.argsort(-density, kind="stable")
    slot = np.empty(n_groups, dtype=np.int64)
    slot[dens_order] = np.arange(n_groups)
    dens_sorted = density[dens_order].tolist()
    fen_size = [0] * (n_groups + 1)
    fen_cost = [0.0] * (n_groups + 1)
    top_bit = 1 << (n_groups.bit_length() - 1)
    distinct = np.unique(heads)
    psi = np.empty(distinct.shape[0])
    asc = np.argsort(heads, kind="stable")
    asc_heads = heads[asc].tolist()
    i = 0
    for d, y in enumerate(distinct.tolist()):
        while i < n_groups and asc_heads[i] <= y:
            g = int(asc[i])
            k = int(slot[g]) + 1
            while k <= n_groups:
                fen_size[k] += int(sizes[g])
                fen_cost[k] += float(g_cost[g])
                k += k & -k
            i += 1
        pos, got, cap, step = 0, 0, 0.0, top_bit
        while step:  # largest prefix (in density order) holding fewer than M samples
            nxt = pos + step
            if nxt <= n_groups and got + fen_size[nxt] < mini_batch_size:
                pos, got, cap = nxt, got + fen_size[nxt], cap + fen_cost[nxt]
            step >>= 1
        if pos < n_groups:  # slot pos + 1 holds the group that crosses M: take the fraction that fits
            cap += (mini_batch_size - got) * dens_sorted[pos]
        psi[d] = max(0.0, y + extra - cap / dp_size)
    suffix_min = np.minimum.accumulate(psi[::-1])[::-1]
    lb_fill = total / dp_size + float(suffix_min[np.searchsorted(distinct, t)].sum())
    lb_heads = float((t + extra).sum())
    return max(lb_fill, lb_heads) / (total / dp_size)


def _evaluate(
    perm: np.ndarray,
    c: np.ndarray,
    codes: np.ndarray,
    dp_size: int,
    mini_batch_size: int,
    fallback_groups_split: int = 0,
    rank_fallback_minibatches: int = 0,
) -> BalanceStats:
    n = c.shape[0]
    n_mb = n // mini_batch_size
    per_rank = mini_batch_size // dp_size
    new_cost = c[perm].reshape(dp_size, n_mb, per_rank)  # [rank, mini-batch, slot]
    rank_cost = new_cost.sum(axis=2)  # [rank, mini-batch]
    mb_max = rank_cost.max(axis=0)
    mb_mean = rank_cost.mean(axis=0)
    total = float(c.sum())
    ideal = total / dp_size
    floor = _rank_floor(np.sort(new_cost.transpose(1, 0, 2).reshape(n_mb, -1), axis=1), dp_size)
    if ideal > 0:
        efficiency = float(mb_max.sum() / ideal)
        bound = float(np.maximum(mb_mean, floor).sum() / ideal)
    else:
        efficiency = bound = 1.0

    pos = np.empty(n, dtype=np.int64)
    pos[perm] = np.arange(n)
    rank_of = pos // (n // dp_size)
    mb_of = (pos % (n // dp_size)) // per_rank
    n_groups = int(codes.max()) + 1 if n else 0
    groups_split = _count_multi(codes, mb_of, n_mb, n_groups)
    groups_split_ranks = _count_multi(codes, rank_of, dp_size, n_groups)
    return BalanceStats(
        num_samples=n,
        num_groups=n_groups,
        dp_size=dp_size,
        mini_batch_size=mini_batch_size,
        num_minibatches=n_mb,
        groups_split=groups_split,
        groups_split_across_ranks=groups_split_ranks,
        minibatch_max_rank_cost=tuple(mb_max.tolist()),
        minibatch_mean_rank_cost=tuple(mb_mean.tolist()),
        efficiency=efficiency,
        efficiency_bound=bound,
        fallback_groups_split=fallback_groups_split,
        rank_fallback_minibatches=rank_fallback_minibatches,
    )


def _rounds_step_time(by_minibatch: np.ndarray, dp_size: int) -> float:
    """Sum over mini-batches (rows) of the slowest rank under round-based largest-first, all mini-batches at
    once: a cheap stand-in for the rank step when comparing two memberships."""
    return float(_lpt_rounds_batched(by_minibatch, dp_size)[1].max(axis=1).sum())


# r in the rank floor goes up to this many heaviest samples ([K, r, q] table stays small; any r is valid).
_FLOOR_MAX_R = 64


def _rank_floor(sorted_costs: np.ndarray, dp_size: int) -> np.ndarray:
    """Per mini-batch (rows of ascending costs), a floor no equal-count rank assignment can beat.

    Take the r heaviest samples; say they sit on q ranks (ceil(r/m) <= q <= r). Those q ranks hold q*m
    samples: the r heavy ones and q*m - r others costing at least the q*m - r cheapest, so the heaviest
    of them costs at least (top_r + cheapest_{q*m-r}) / q. Every q is possible, so the minimum over q is
    a floor; every r gives one, so the maximum over r is too (r = 1 is the heaviest sample plus the m - 1
    cheapest). It is at least the mean, which is r = q = dp.
    """
    n_mb, size = sorted_costs.shape
    m = size // dp_size
    r_max = min(dp_size, _FLOOR_MAX_R)
    cheap = np.concatenate((np.zeros((n_mb, 1)), np.cumsum(sorted_costs, axis=1)), axis=1)  # [K, M+1]
    top = np.concatenate((np.zeros((n_mb, 1)), np.cumsum(sorted_costs[:, ::-1][:, :r_max], axis=1)), axis=1)
    r = np.arange(1, r_max + 1)[:, None]
    q = np.arange(1, r_max + 1)[None, :]
    valid = (q <= r) & (q * m >= r)
    rest = np.clip(q * m - r, 0, size)
    table = (top[:, r[:, 0]][:, :, None] + cheap[:, rest]) / q  # [K, r, q]
    table = np.where(valid[None], table, np.inf)
    return np.maximum(table.min(axis=2).max(axis=1), cheap[:, -1] / dp_size)


def _count_multi(codes: np.ndarray, where: np.ndarray, n_where: int, n_groups: int) -> int:
    """Number of groups whose samples occupy more than one value of ``where``."""
    pairs = np.unique(codes * n_where + where)
    per_group = np.bincount(pairs // n_where, minlength=n_groups)
    return int((per_group > 1).sum())
