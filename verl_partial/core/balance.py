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
1. Pack groups into K mini-batches of exactly M samples, spreading expensive groups evenly (largest cost
   first onto the lightest mini-batch with room), so every optimizer step sees a representative mix of
   lengths. Equal group sizes dividing M take an equal-count fast path; unequal sizes get an exact-fill
   repair (subset-sum DP) when the greedy strands groups, then a complete backtracking search for the
   hard few-large-groups cases. If nothing fits: error, or with ``on_infeasible="split"`` the fewest
   groups the packer needs are cut (counted).
2. Inside each mini-batch, assign samples to dp ranks with exactly m each, minimising the largest rank
   cost: equal-count Karmarkar-Karp and round-based largest-first both run (KK tends to win with many
   samples per rank, largest-first on heavy tails with few), the better is kept and polished with pairwise
   swaps. With ``keep_group_on_rank`` whole groups are packed into rank slots of exactly m samples instead
   (same packer as step 1); where whole groups cannot fill the slots, or only with a >5% worse max rank
   cost, a few groups are cut across ranks inside that mini-batch and the mini-batch is counted.
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
    "check_layout",
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
        efficiency_bound: Same sum with each max replaced by a lower bound for that mini-batch,
            max(mean rank cost, largest sample + the m-1 cheapest samples): no rank assignment of the same
            mini-batches can do better, so efficiency - efficiency_bound is what the rank step leaves.
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
    n = costs.shape[0]
    order = np.argsort(-costs, kind="stable")
    labels = np.empty(n, dtype=np.int64)
    loads = np.zeros(k, dtype=np.float64)
    for start in range(0, n, k):
        idx = order[start : start + k]
        bins = np.argsort(loads, kind="stable")
        loads[bins] += costs[idx]
        labels[idx] = bins
    return labels


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
    labels: np.ndarray,
    costs: np.ndarray,
    k: int,
    max_passes: int = _REFINE_MAX_PASSES,
) -> None:
    """Polish in place: swap one item of the heaviest bin with a cheaper item of a light bin.

    A swap keeps every bin's item count (and, when the items are same-size groups, its sample count). The
    pair is chosen so the moved difference is as close as possible to half the gap, which minimises the new
    max of the two bins. Stops when the heaviest bin is within ``_REFINE_RTOL`` of the mean or no swap
    helps.
    """
    loads = np.bincount(labels, weights=costs, minlength=k)
    tol = _REFINE_RTOL * max(float(loads.mean()), 1e-12)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(k + 1))
    members = [order[bounds[b] : bounds[b + 1]].copy() for b in range(k)]
    mean = float(loads.mean())
    for _ in range(max_passes):
        hi = int(np.argmax(loads))
        if loads[hi] - mean <= tol:
            return
        a_idx = members[hi]
        if a_idx.size == 0:
            return
        a = costs[a_idx]
        moved = False
        for lo in np.argsort(loads, kind="stable")[:4].tolist():
            gap = loads[hi] - loads[lo]
            if gap <= tol:
                break
            b_idx = members[lo]
            if b_idx.size == 0:
                continue
            b_cost = costs[b_idx]
            b_order = np.argsort(b_cost, kind="stable")
            b_sorted = b_cost[b_order]
            pos = np.searchsorted(b_sorted, a - gap / 2.0)
            last = b_sorted.size - 1
            best_err, best = np.inf, (0, 0)
            for cand in (np.maximum(pos - 1, 0), np.minimum(pos, last)):
                delta = a - b_sorted[cand]
                err = np.where((delta > tol) & (delta < gap - tol), np.abs(delta - gap / 2.0), np.inf)
                i = int(np.argmin(err))
                if err[i] < best_err:
                    best_err, best = float(err[i]), (i, int(b_order[cand[i]]))
            if best_err == np.inf:
                continue
            i, j = best
            ia, jb = a_idx[i], b_idx[j]
            delta = costs[ia] - costs[jb]
            labels[ia], labels[jb] = lo, hi
            a_idx[i], b_idx[j] = jb, ia
            loads[hi] -= delta
            loads[lo] += delta
            moved = True
            break
        if not moved:
            return


def _equal_count_partition(costs: np.ndarray, k: int) -> np.ndarray:
    """Split ``len(costs)`` (a multiple of k) items into k bins of equal count, minimising the max bin cost.

    KK is usually best with many items per bin; round-based largest-first can win on heavy tails with few
    items per bin. Both are cheap, so run both and keep the better. Round-based largest-first also bounds
    the result: max bin <= mean bin + largest item (each round adds at most the spread it removes).
    """
    n = costs.shape[0]
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    if n == k:
        return np.argsort(np.argsort(-costs, kind="stable"), kind="stable").astype(np.int64)
    best, best_max = None, np.inf
    for fn in (_kk_equal, _lpt_rounds):
        lab = fn(costs, k)
        mx = np.bincount(lab, weights=costs, minlength=k).max()
        if mx < best_max:
            best, best_max = lab, mx
    assert best is not None
    _refine_swaps(best, costs, k)
    return best


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
        unit_group = np.array([codes[u[0]] for u in unit_samples], dtype=np.int64)
    else:
        unit_group = np.arange(g_sizes.shape[0], dtype=np.int64)

    packing = _pack_exact(u_sizes, u_costs, n_mb, mini_batch_size, allow_split=allow_split)
    if packing is None:
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
    cut_groups = {g for g in cut_groups if np.unique(sample_mb[by_group[starts[g] : starts[g + 1]]]).size > 1}

    # --- step 2: inside each mini-batch, samples (or groups) -> ranks --------------------------------------
    sample_rank = np.empty(n, dtype=np.int64)
    mb_order = np.argsort(sample_mb, kind="stable")
    rank_fallbacks = 0
    for j in range(n_mb):
        rows = mb_order[j * mini_batch_size : (j + 1) * mini_batch_size]
        if keep_group_on_rank and dp_size > 1:
            labels, degraded = _ranks_keeping_groups(rows, codes, c, dp_size, per_rank)
            rank_fallbacks += int(degraded)
        else:
            labels = _equal_count_partition(c[rows], dp_size)
        sample_rank[rows] = labels

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
    # Lower bound for equal-count ranks: the rank holding a mini-batch's largest sample also holds at
    # least m-1 other samples, so it costs at least that sample plus the m-1 cheapest ones.
    mb_sorted = np.sort(new_cost.transpose(1, 0, 2).reshape(n_mb, -1), axis=1)
    floor = mb_sorted[:, -1] + mb_sorted[:, : per_rank - 1].sum(axis=1)
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


def _count_multi(codes: np.ndarray, where: np.ndarray, n_where: int, n_groups: int) -> int:
    """Number of groups whose samples occupy more than one value of ``where``."""
    pairs = np.unique(codes * n_where + where)
    per_group = np.bincount(pairs // n_where, minlength=n_groups)
    return int((per_group > 1).sum())
