"""A floor on balancing efficiency over every whole-group layout, so a result can be judged against the optimum.

``BalanceStats.efficiency_bound`` fixes the mini-batches and bounds only the rank step; this bound
also lets mini-batch membership vary, so benchmarks can say how far any planner is from the best
possible layout without solving the (NP-hard) problem.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence

import numpy as np

from verl_partial.core.balance.layout import BalanceInfeasibleError, as_costs, check_layout, factorize

__all__ = ["efficiency_lower_bound"]


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
    c = as_costs(costs)
    n = c.shape[0]
    codes, _ = factorize(group_keys, n)
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
