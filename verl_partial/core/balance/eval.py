"""Measuring a permutation under verl's dp-shard + mini-batch split: groups split, per-step rank costs, efficiency.

Kept apart from planning so that any permutation -- ours, verl's default ``_balance_batch``, the
identity -- is scored by the same rules, and so that everything :func:`~verl_partial.core.balance.groups.balance_groups`
reports is recomputed from its final permutation rather than trusted from the planner.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from verl_partial.core.balance.layout import as_costs, check_layout, factorize

__all__ = ["BalanceStats", "evaluate_permutation", "permutation_stats", "rank_floor"]


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
            (:func:`rank_floor`: the r heaviest samples with the cheapest rows their ranks must also hold):
            no rank assignment of the same mini-batches can do better, so efficiency - efficiency_bound is
            what the rank step leaves. It says nothing about membership: see ``balance_bound.efficiency_lower_bound``.
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
    c = as_costs(costs)
    n = c.shape[0]
    codes, _ = factorize(group_keys, n)
    p = np.asarray(perm, dtype=np.int64).reshape(-1)
    if p.shape[0] != n or not np.array_equal(np.sort(p), np.arange(n)):
        raise ValueError(f"perm is not a permutation of range({n})")
    check_layout(n, dp_size, mini_batch_size)
    return permutation_stats(p, c, codes, dp_size, mini_batch_size)


def permutation_stats(
    perm: np.ndarray,
    c: np.ndarray,
    codes: np.ndarray,
    dp_size: int,
    mini_batch_size: int,
    fallback_groups_split: int = 0,
    rank_fallback_minibatches: int = 0,
) -> BalanceStats:
    """:func:`evaluate_permutation` on inputs already checked, plus the planner's own fallback counts."""
    n = c.shape[0]
    n_mb = n // mini_batch_size
    per_rank = mini_batch_size // dp_size
    new_cost = c[perm].reshape(dp_size, n_mb, per_rank)  # [rank, mini-batch, slot]
    rank_cost = new_cost.sum(axis=2)  # [rank, mini-batch]
    mb_max = rank_cost.max(axis=0)
    mb_mean = rank_cost.mean(axis=0)
    total = float(c.sum())
    ideal = total / dp_size
    floor = rank_floor(np.sort(new_cost.transpose(1, 0, 2).reshape(n_mb, -1), axis=1), dp_size)
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
    return BalanceStats(
        num_samples=n,
        num_groups=n_groups,
        dp_size=dp_size,
        mini_batch_size=mini_batch_size,
        num_minibatches=n_mb,
        groups_split=_count_multi(codes, mb_of, n_mb, n_groups),
        groups_split_across_ranks=_count_multi(codes, rank_of, dp_size, n_groups),
        minibatch_max_rank_cost=tuple(mb_max.tolist()),
        minibatch_mean_rank_cost=tuple(mb_mean.tolist()),
        efficiency=efficiency,
        efficiency_bound=bound,
        fallback_groups_split=fallback_groups_split,
        rank_fallback_minibatches=rank_fallback_minibatches,
    )


# r in the rank floor goes up to this many heaviest samples ([K, r, q] table stays small; any r is valid).
_FLOOR_MAX_R = 64


def rank_floor(sorted_costs: np.ndarray, dp_size: int) -> np.ndarray:
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
