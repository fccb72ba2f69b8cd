"""verl's batch layout for balancing: the sizes it accepts and the inputs every balancing step shares.

verl shards a batch of N rows into ``dp`` contiguous equal chunks and the actor cuts each chunk into
K = N / M mini-batches of m = M / dp rows, in order (the layout contract in :mod:`verl_partial.core.balance.groups`).
The divisibility checks and input conversions live here so that planning (:mod:`~verl_partial.core.balance.groups`),
measuring (:mod:`~verl_partial.core.balance.eval`) and bounding (:mod:`~verl_partial.core.balance.bound`) reject
the same batches with the same messages.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["BalanceInfeasibleError", "as_costs", "check_layout", "factorize"]


class BalanceInfeasibleError(ValueError):
    """No arrangement satisfies the mini-batch rules for these sizes (message names the sizes)."""


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


def as_costs(costs: Sequence[float] | np.ndarray) -> np.ndarray:
    """Costs as a flat float64 array; a negative or non-finite cost would make every rank sum meaningless."""
    arr = np.asarray(costs, dtype=np.float64).reshape(-1)
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError("costs must be finite and non-negative")
    return arr


def factorize(keys: Sequence[Hashable] | np.ndarray, n: int) -> tuple[np.ndarray, list[Hashable]]:
    """Integer codes in first-appearance order (keys only need to be hashable, not orderable)."""
    if len(keys) != n:
        raise ValueError(f"got {len(keys)} group keys for {n} costs")
    # dict.fromkeys keeps first-appearance order and runs the hashing loop in C.
    mapping = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    codes = np.fromiter(map(mapping.__getitem__, keys), dtype=np.int64, count=n)
    return codes, list(mapping)
