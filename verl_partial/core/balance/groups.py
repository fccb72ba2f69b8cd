"""Group-preserving batch balancing: planning the permutation (no verl, no torch).

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
1. Pack groups into K mini-batches of exactly M samples, two ways, and keep the better
   (:mod:`~verl_partial.core.balance.packing`):
   * heavy together (``pack_minibatches``): with few rows per rank (small m) a mini-batch's slowest
     rank is set by its longest sample, so mini-batches are led by groups in order of their longest
     sample and topped up, heaviest first, where the heavy rank still stands alone;
   * spread (``pack_exact``): expensive groups spread evenly (largest cost first onto the lightest
     mini-batch with room), a representative mix of lengths per step. Equal group sizes dividing M take
     an equal-count fast path (:mod:`~verl_partial.core.balance.partition`); unequal sizes get an
     exact-fill repair (subset-sum DP) when the greedy strands groups, then a complete backtracking
     search for the hard few-large-groups cases.
   The choice goes by the rank floor of each membership, close calls by a cheap rank step, ties to
   spread. If nothing fits: error, or with ``on_infeasible="split"`` the fewest groups the packer needs
   are cut (counted).
2. Inside each mini-batch, assign samples to dp ranks with exactly m each, minimising the largest rank
   cost (:mod:`~verl_partial.core.balance.ranks`): equal-count Karmarkar-Karp, round-based and
   count-capped largest-first all run (KK tends to win with many samples per rank, largest-first on heavy
   tails with few), the best is kept, then one swap polish runs over all mini-batches at once. With
   ``keep_group_on_rank`` whole groups are packed into rank slots of exactly m samples instead (same
   exact packer); where whole groups cannot fill the slots, or only with a >5% worse max rank cost, a few
   groups are cut across ranks inside that mini-batch and the mini-batch is counted.
3. Emit the permutation: rank-major, then mini-batch, then group (a group's rows stay adjacent).

Everything that is reported is recomputed from the final permutation by
:func:`~verl_partial.core.balance.eval.evaluate_permutation`, which also measures any other permutation
(e.g. verl's default) under the same rules; :mod:`~verl_partial.core.balance.bound` gives a floor over
every whole-group layout.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from verl_partial.config.balance import ON_INFEASIBLE_MODES
from verl_partial.core.balance.eval import BalanceStats, permutation_stats, rank_floor
from verl_partial.core.balance.layout import BalanceInfeasibleError, as_costs, check_layout, factorize
from verl_partial.core.balance.packing import Packing, SearchBudgetExceeded, exact_search, pack_exact, pack_minibatches
from verl_partial.core.balance.partition import lpt_rounds_batched
from verl_partial.core.balance.ranks import assign_ranks_per_minibatch, ranks_keeping_groups

__all__ = ["BalanceResult", "balance_groups"]

# Two candidate memberships whose rank floors differ by more than this fraction: keep the lower floor
# (the rank step lands within about 1 % of it at small m); closer calls are settled by a cheap rank step.
_CHOICE_MARGIN = 0.01


@dataclass(frozen=True)
class BalanceResult:
    """A permutation for ``DataProto.reorder`` and its measured stats."""

    perm: list[int]
    stats: BalanceStats


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
    c = as_costs(costs)
    n = c.shape[0]
    codes, _ = factorize(group_keys, n)
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
    spread = pack_exact(u_sizes, u_costs, n_mb, mini_batch_size, allow_split=allow_split)
    clustered = pack_minibatches(u_sizes, u_costs, u_max, n_mb, dp_size, mini_batch_size, keep_group_on_rank)
    packings = [p for p in (spread, clustered) if p is not None]
    if not packings:
        try:
            proven = exact_search(u_sizes, n_mb, mini_batch_size) is None
        except SearchBudgetExceeded:
            proven = False
        verdict = "no arrangement exists" if proven else "no arrangement found within the search budget"
        raise BalanceInfeasibleError(
            f"cannot pack group sizes {_describe_sizes(u_sizes)} (size: count) into {n_mb} mini-batch(es) of "
            f"exactly {mini_batch_size} samples each (N={n}, dp_size={dp_size}): {verdict}; "
            "set balance.on_infeasible=split to cut groups"
        )
    packings = [p for p in packings if p.cut_units == 0] or packings

    def membership(packing: Packing) -> tuple[np.ndarray, set[int]]:
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
            return assign_ranks_per_minibatch(c, sample_mb, n_mb, dp_size), 0
        sample_rank = np.empty(n, dtype=np.int64)
        mb_order = np.argsort(sample_mb, kind="stable")
        degraded = 0
        for j in range(n_mb):
            rows = mb_order[j * mini_batch_size : (j + 1) * mini_batch_size]
            labels, cut = ranks_keeping_groups(rows, codes, c, dp_size, per_rank)
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
            score = [float(rank_floor(x, dp_size).sum()) for x in by_mb]
            if min(score) >= (1.0 - _CHOICE_MARGIN) * max(score):
                score = [_rounds_step_time(x, dp_size) for x in by_mb]
            layouts = [layouts[int(np.argmin(score))]]
        sample_mb, cut_groups = layouts[0]
        sample_rank, rank_fallbacks = ranks(sample_mb)

    perm = np.lexsort((np.arange(n), codes, sample_mb, sample_rank))
    stats = permutation_stats(
        perm,
        c,
        codes,
        dp_size,
        mini_batch_size,
        fallback_groups_split=len(cut_groups),
        rank_fallback_minibatches=rank_fallbacks,
    )
    return BalanceResult(perm=perm.tolist(), stats=stats)


def _rounds_step_time(by_minibatch: np.ndarray, dp_size: int) -> float:
    """Sum over mini-batches (rows) of the slowest rank under round-based largest-first, all mini-batches at
    once: a cheap stand-in for the rank step when comparing two memberships."""
    return float(lpt_rounds_batched(by_minibatch, dp_size)[1].max(axis=1).sum())
