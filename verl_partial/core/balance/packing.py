"""Exact-size packing: units (groups or group pieces) into bins of exactly ``capacity`` samples, balancing cost.

Groups must land whole in mini-batches of exactly M samples (and, with ``keep_group_on_rank``, in rank
slots of exactly m): a bin-packing problem with an equality constraint, where a greedy can strand units.
Two memberships are built here -- heavy groups together (:func:`pack_minibatches`) and cost spread
evenly (:func:`pack_exact`) -- with an exact repair (subset-sum DP), a complete backtracking search for
the hard few-large-groups cases and, when allowed, the fewest cuts that make the sizes fit.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verl_partial.core.balance.partition import REFINE_MAX_PASSES, REFINE_RTOL, equal_count_partition

__all__ = ["Packing", "SearchBudgetExceeded", "exact_search", "pack_exact", "pack_minibatches"]

# Largest (units in heavy bin) x (units in light bin) matrix the mixed-size swap polish will build.
_MAX_SWAP_MATRIX = 250_000
# Heap entries a unit may skip for lack of room before the heaviness packer scans all bins instead.
_HEAP_TRIES = 4
# Node budget of the exact backtracking search (hard cases with few, large groups); ~0.5 s worst case.
_SEARCH_BUDGET = 200_000
# ... and only for instances with at most this many groups (the recursion goes one level per group; the
# heuristics handle many small groups well, the search is for few large ones).
_SEARCH_MAX_UNITS = 300


@dataclass
class Packing:
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


def _cut_pack(sizes: np.ndarray, costs: np.ndarray, n_bins: int, capacity: int) -> Packing:
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
    return Packing(out, origin, piece, res[1])


def _refine_equal_size(labels: np.ndarray, sizes: np.ndarray, costs: np.ndarray, k: int) -> None:
    """Swap polish for units of mixed sizes: only equal-size units swap, so bin sample counts stay exact."""
    loads = np.bincount(labels, weights=costs, minlength=k)
    tol = REFINE_RTOL * max(float(loads.mean()), 1e-12)
    for _ in range(REFINE_MAX_PASSES):
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


class SearchBudgetExceeded(Exception):
    pass


def exact_search(sizes: np.ndarray, n_bins: int, capacity: int, budget: int = _SEARCH_BUDGET) -> np.ndarray | None:
    """Complete backtracking search for an exact packing (cost-blind), for the hard cases the heuristics miss:
    few, large units. Works on the multiset of sizes; each new bin takes the largest remaining unit first
    and sizes inside a bin are non-increasing (symmetry breaking); failed remainders are memoised.

    Returns labels, or None if no packing exists. Raises SearchBudgetExceeded when the budget runs out.
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
        raise SearchBudgetExceeded
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
            raise SearchBudgetExceeded
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


def _max_load(p: Packing, costs: np.ndarray, sizes: np.ndarray, n_bins: int) -> float:
    share = costs[p.origin] * p.piece_size / sizes[p.origin]
    return float(np.bincount(p.labels, weights=share, minlength=n_bins).max())


def pack_exact(
    sizes: np.ndarray,
    costs: np.ndarray,
    n_bins: int,
    capacity: int,
    allow_split: bool = False,
    whole_slack: float | None = None,
) -> Packing | None:
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
        return Packing(np.zeros(n_units, dtype=np.int64), ident, sizes.copy(), 0)
    s0 = int(sizes[0])
    if np.all(sizes == s0) and capacity % s0 == 0:
        # Equal sizes: exactly capacity/s0 units per bin, a pure equal-count cost partition.
        return Packing(equal_count_partition(costs, n_bins), ident, sizes.copy(), 0)

    whole: Packing | None = None
    for order in (np.lexsort((-sizes, -costs)), np.lexsort((-costs, -sizes))):
        labels, room = _greedy_fill(sizes, costs, n_bins, capacity, order)
        if (labels < 0).any():
            labels = _repair(labels, room, sizes, costs, capacity)
        if labels is not None:
            whole = Packing(labels, ident, sizes.copy(), 0)
            break
    if whole is None and whole_slack is None:
        # Cost-blind, so only worth it when a whole packing is required (it rarely beats cutting on balance).
        res = _fill_gaps(sizes.tolist(), costs.tolist(), dict.fromkeys(range(n_bins), capacity), allow_split=False)
        if res is not None:
            labels = np.empty(n_units, dtype=np.int64)
            for u, b, _cnt in res[0]:
                labels[u] = b
            whole = Packing(labels, ident, sizes.copy(), 0)
    if whole is None and whole_slack is None:
        try:
            labels = exact_search(sizes, n_bins, capacity)
        except SearchBudgetExceeded:
            labels = None
        if labels is not None:
            whole = Packing(labels, ident, sizes.copy(), 0)
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
       j-th largest head of any layout is at least this leader's, see ``balance_bound.efficiency_lower_bound``).
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


def pack_minibatches(
    sizes: np.ndarray,
    costs: np.ndarray,
    max_sample: np.ndarray,
    n_bins: int,
    dp_size: int,
    capacity: int,
    keep_group_on_rank: bool,
) -> Packing | None:
    """Step 1 of ``balance.balance_groups``: :func:`_pack_by_heaviness`, then the exact repair for stranded
    units; None when that fails (the caller falls back to :func:`pack_exact`'s search and cutting)."""
    ident = np.arange(sizes.shape[0], dtype=np.int64)
    if n_bins == 1:
        return Packing(np.zeros(sizes.shape[0], dtype=np.int64), ident, sizes.copy(), 0)
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
    return Packing(labels, ident, sizes.copy(), 0)
