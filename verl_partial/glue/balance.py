"""verl adapter for group-preserving balancing: DataProto in, reordered DataProto + ``balance/`` metrics out.

This is the only balancing module that touches verl. It computes per-sample costs exactly the way verl's
``RayPPOTrainer._balance_batch`` does (sequence length = ``attention_mask`` row sum, workload via verl's
own ``calculate_workload``) so that ``balance/*`` and verl's ``global_seqlen/*`` metrics describe the same
quantity, hands them to :mod:`verl_partial.core.balance` and applies the permutation in place.

Call it where verl calls ``_balance_batch`` (after generation, before old-log-prob/advantages): nothing in
between may reorder the batch, and the actor must split mini-batches in order (``actor.shuffle=False``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.utils.seqlen_balancing import calculate_workload

from verl_partial.core.balance import balance_groups
from verl_partial.core.balance_config import BalanceConfig
from verl_partial.core.balance_eval import evaluate_permutation

__all__ = ["balance_batch_by_group", "measure_batch_order", "sample_costs", "flops_per_sample"]


def _attr(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def flops_per_sample(seqlen: torch.Tensor, model_config: Any) -> torch.Tensor:
    """Forward FLOPs of one sequence of length L (training adds a constant factor that cancels in balancing).

    cost(L) = 2 * N_params * L + 2 * num_layers * L**2 * hidden

    * ``2 * N_params * L``: every weight does one multiply-add per token (dense matmuls, LM head included).
    * ``2 * num_layers * L**2 * hidden``: attention scores (Q K^T) and the weighted sum (A V) are
      2 * L**2 * hidden FLOPs each per layer without masking; a causal mask halves their sum to 2 * L**2 * hidden.

    ``model_config`` is any object with attributes (a HF ``PretrainedConfig`` works):
    ``num_hidden_layers`` (or ``num_layers``), ``hidden_size``, and optionally ``num_params``. Without
    ``num_params`` the parameter count is estimated per layer as attention q/o (2*h*h) + k/v
    (2*h*kv_heads*head_dim, GQA-aware when ``num_key_value_heads``/``head_dim`` exist) + MLP
    (3*h*intermediate_size for gated MLPs, else 8*h*h), plus the LM head (vocab_size*h) when
    ``vocab_size`` is given. Embedding lookups are not FLOPs and are not counted.
    """
    layers = _attr(model_config, "num_hidden_layers", "num_layers", "n_layer")
    hidden = _attr(model_config, "hidden_size", "n_embd", "d_model")
    if layers is None or hidden is None:
        raise ValueError(
            "balance.cost=flops needs a model config with num_hidden_layers (or num_layers) and hidden_size; "
            f"got {type(model_config).__name__}"
        )
    layers, hidden = int(layers), int(hidden)
    n_params = _attr(model_config, "num_params")
    if n_params is None:
        heads = _attr(model_config, "num_attention_heads")
        kv_heads = _attr(model_config, "num_key_value_heads") or heads
        head_dim = _attr(model_config, "head_dim") or (hidden // int(heads) if heads else None)
        kv_width = int(kv_heads) * int(head_dim) if kv_heads and head_dim else hidden
        inter = _attr(model_config, "intermediate_size")
        mlp = 3 * hidden * int(inter) if inter else 8 * hidden * hidden
        per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + mlp
        vocab = _attr(model_config, "vocab_size")
        n_params = layers * per_layer + (int(vocab) * hidden if vocab else 0)
    length = seqlen.to(torch.float64)
    return 2.0 * float(n_params) * length + 2.0 * layers * hidden * length**2


def sample_costs(seqlen: torch.Tensor, cost: str, model_config: Any = None) -> np.ndarray:
    """Per-sample cost for ``balance.cost`` (see :class:`BalanceConfig`) as float64 numpy."""
    seqlen = seqlen.long()  # int64: verl's workload overflows int32 beyond L ~ 46k
    if cost == "workload":
        out = calculate_workload(seqlen)
    elif cost == "tokens":
        out = seqlen
    elif cost == "flops":
        if model_config is None:
            raise ValueError("balance.cost=flops needs model_config (the actor model's config object)")
        out = flops_per_sample(seqlen, model_config)
    else:  # BalanceConfig validates; this guards direct calls
        raise ValueError(f"balance.cost must be one of ['workload', 'tokens', 'flops'], got {cost!r}")
    return out.detach().cpu().to(torch.float64).numpy()


def balance_batch_by_group(
    batch: DataProto,
    *,
    config: BalanceConfig,
    dp_size: int,
    mini_batch_size_samples: int,
    model_config: Any = None,
) -> dict[str, float]:
    """Reorder ``batch`` in place so groups stay in one mini-batch and ranks are balanced per mini-batch.

    Args:
        batch: The training batch (after generation and ``union``), with ``attention_mask`` and the group key.
        config: The ``balance`` block. With ``enable=False`` nothing happens and ``{}`` is returned.
        dp_size: Data-parallel size of the actor (what verl's dispatch chunks the batch into).
        mini_batch_size_samples: ``actor.ppo_mini_batch_size * rollout.n`` (global, in samples).
        model_config: Needed only for ``cost="flops"``.

    Returns:
        ``balance/*`` metrics (see docs/balance-algorithm.md), including ``balance/time_ms``.

    Raises:
        ValueError: missing group key (naming ``balance.group_key`` and the available keys), incompatible
            sizes, or infeasible group sizes with ``on_infeasible="error"``.
    """
    if not config.enable:
        return {}
    keys, costs = _keys_and_costs(batch, config, model_config)

    start = time.perf_counter()
    result = balance_groups(
        costs,
        keys,
        dp_size=dp_size,
        mini_batch_size=mini_batch_size_samples,
        keep_group_on_rank=config.keep_group_on_rank,
        on_infeasible=config.on_infeasible,
    )
    elapsed_ms = (time.perf_counter() - start) * 1e3
    batch.reorder(torch.as_tensor(result.perm, dtype=torch.long))
    metrics = result.stats.to_metrics(prefix="balance/")
    metrics["balance/time_ms"] = elapsed_ms
    return metrics


def measure_batch_order(
    batch: DataProto, *, config: BalanceConfig, dp_size: int, mini_batch_size_samples: int, model_config: Any = None
) -> dict[str, float]:
    """``balance/*`` metrics of the batch's current order, e.g. after verl's own ``_balance_batch``."""
    keys, costs = _keys_and_costs(batch, config, model_config)
    stats = evaluate_permutation(
        list(range(len(costs))), costs, keys, dp_size=dp_size, mini_batch_size=mini_batch_size_samples
    )
    return stats.to_metrics(prefix="balance/")


def _keys_and_costs(batch: DataProto, config: BalanceConfig, model_config: Any) -> tuple[np.ndarray, np.ndarray]:
    keys = batch.non_tensor_batch.get(config.group_key)
    if keys is None:
        raise ValueError(
            f"balance.group_key={config.group_key!r} is not a non-tensor key of the batch; "
            f"available non-tensor keys: {sorted(batch.non_tensor_batch)}"
        )
    try:
        dict.fromkeys(keys)
    except TypeError as exc:
        raise ValueError(
            f"balance.group_key={config.group_key!r} must name a column of hashable values (str, int, tuple, ...): "
            f"rows with equal values form a group, but hashing one failed ({exc}). Point balance.group_key at a "
            "string or integer id column (e.g. 'uid', or a trajectory id)"
        ) from exc
    mask = batch.batch["attention_mask"]
    return keys, sample_costs(mask.reshape(mask.shape[0], -1).sum(-1), config.cost, model_config)
