"""verl side of rollout correction: lag-split metrics, staleness mask, all-rejected guard.

The config hand-over needs no code here: our ``+rollout_correction`` groups write verl's
``algorithm.rollout_correction`` and, for bypass, the actor's ``policy_loss`` (verl 0.9.1 applies
bypass to the driver's copy only, after the workers got theirs: verl #4912, #4272) in the composed
config itself (``verl_partial.hydra_resolvers``). Two verl 0.9.1 behaviours this module exists for:

* The bypass loss raises ``ValueError`` for a micro-batch without a valid token (verl #6485 in its
  0.9 form) and ``token-mean`` divides 0 by 0 for an empty mini-batch; ``guard_all_rejected`` turns
  such a micro-batch into an exact zero-loss contribution and counts it. It only wraps a function:
  putting the wrapped losses into verl's registry is ``patches.correction.install_all_rejected_guard``.
* verl's metrics average over all tokens whatever policy version sampled them; with partial
  rollout, ``compute_lag_split_metrics`` reruns verl's own metric function per version lag.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlRolloutCorrectionConfig

from verl_partial.config.correction import RolloutCorrectionConfig, to_verl_fields

ALL_REJECTED_METRIC = "rollout_corr/all_rejected_microbatches"
_RS_MASKED_FRACTION = "rollout_corr/rollout_rs_masked_fraction"
_GUARD_MARK = "_verl_partial_all_rejected_guard"

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


def to_verl_config(cfg: RolloutCorrectionConfig) -> VerlRolloutCorrectionConfig:
    """verl's own typed config for ``cfg``."""
    return VerlRolloutCorrectionConfig(**to_verl_fields(cfg))


def guard_all_rejected(policy_loss_fn: PolicyLossFn) -> PolicyLossFn:
    """Wrap a registered verl policy loss so a micro-batch with no trainable token adds exactly zero loss.

    verl's ``bypass_mode`` loss raises ``ValueError("response_mask must contain at least one valid
    token")`` on such a micro-batch, and ``token-mean`` aggregation turns an all-empty mini-batch
    into 0/0. The guarded function instead returns a zero that is still attached to ``log_prob``'s
    graph (so backward runs and FSDP's gradient hooks fire on every rank) and sets
    ``rollout_corr/all_rejected_microbatches`` to 1 for it, 0 for other micro-batches; verl averages
    per-micro-batch metrics, so the logged value is the fraction of micro-batches with nothing
    trained. A micro-batch whose tokens the bypass loss's own rejection sampling all masks counts too.

    The metric keys of an empty micro-batch are those verl's loss reports for an on-policy no-op
    (log_prob = old_log_prob, zero advantages, all positions valid): verl aggregates metrics across
    data-parallel ranks only when every rank reports the same keys the same number of times.
    """
    if getattr(policy_loss_fn, _GUARD_MARK, False):
        return policy_loss_fn

    @functools.wraps(policy_loss_fn)
    def guarded(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        settings = {"loss_agg_mode": loss_agg_mode, "config": config, "rollout_is_weights": rollout_is_weights}
        if response_mask.any():
            # By keyword, as verl's ppo_loss calls it: a user-registered loss need not take them in this order.
            loss, metrics = policy_loss_fn(
                old_log_prob=old_log_prob,
                log_prob=log_prob,
                advantages=advantages,
                response_mask=response_mask,
                **settings,
            )
            return loss, {**metrics, ALL_REJECTED_METRIC: float(_rejected_every_token(metrics, response_mask))}
        with torch.no_grad():
            # The on-policy no-op: same keys as a real call, nothing to learn.
            _, metrics = policy_loss_fn(
                old_log_prob=old_log_prob,
                log_prob=old_log_prob,
                advantages=torch.zeros_like(advantages),
                response_mask=torch.ones_like(response_mask),
                **settings,
            )
        zero = torch.where(response_mask.bool(), log_prob, torch.zeros_like(log_prob)).sum()
        return zero, {**metrics, ALL_REJECTED_METRIC: 1.0}

    setattr(guarded, _GUARD_MARK, True)
    return guarded


def _rejected_every_token(metrics: Mapping[str, Any], response_mask: torch.Tensor) -> bool:
    """Whether the bypass loss's own rejection sampling masked all ``n`` valid tokens.

    verl reports masked/(n + 1e-8) as a float32 mean; "more than n - 1/2 tokens masked" reads that
    exactly for any micro-batch below several million tokens.
    """
    fraction = metrics.get(_RS_MASKED_FRACTION)
    if fraction is None:
        return False
    valid = float(response_mask.sum())
    return fraction > 1.0 - 0.5 / valid
