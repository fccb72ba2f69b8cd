"""Token policy-version lags: the tensor side of the staleness mask and of the lag-split metrics.

With partial rollout a response can hold tokens sampled by several policy versions. The lag of a
token is ``current_version - version_that_sampled_it``; both masks and metrics here work per token,
never per sequence, so a resumed sample's fresh tail is not punished for its stale head.
No verl import: the metric values themselves come from verl's ``rollout_corr_helper`` in the glue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LagSlice:
    """The tokens of one lag, as a smaller batch verl's metric functions can take unchanged.

    Attributes:
        lag: policy versions between the sampling policy and the current one.
        rows: indices of the sequences holding at least one valid token of this lag.
        mask: ``response_mask[rows]`` restricted to the tokens of this lag.
        num_tokens: number of valid tokens of this lag.
    """

    lag: int
    rows: torch.Tensor
    mask: torch.Tensor
    num_tokens: int


def token_lags(policy_version: torch.Tensor, current_version: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token lag ``current_version - policy_version`` (int64); padding positions get lag 0.

    Raises ValueError on a shape mismatch, a non-integer version tensor, or a valid token sampled by
    a policy newer than ``current_version`` (a bookkeeping bug upstream, not something to mask).
    """
    if policy_version.shape != response_mask.shape:
        raise ValueError(
            f"rollout_policy_version shape {tuple(policy_version.shape)} must equal response_mask shape "
            f"{tuple(response_mask.shape)}"
        )
    if policy_version.is_floating_point() or policy_version.dtype == torch.bool:
        raise ValueError(f"rollout_policy_version must hold integer versions, got dtype {policy_version.dtype}")
    valid = response_mask.bool()
    lags = torch.where(
        valid, current_version - policy_version.long(), torch.zeros_like(policy_version, dtype=torch.long)
    )
    if bool((lags < 0).any()):
        newest = int(policy_version[valid].max())
        raise ValueError(
            f"a token was sampled by policy version {newest}, newer than the current version {current_version}"
        )
    return lags


def split_by_lag(lags: torch.Tensor, response_mask: torch.Tensor) -> list[LagSlice]:
    """One ``LagSlice`` per lag present among the valid tokens, in increasing lag order.

    Only rows holding tokens of the lag are kept, so sequence-level statistics (sequence IS weight,
    per-sequence PPL) are computed over the sequences that lag actually occurs in.
    """
    valid = response_mask.bool()
    slices = []
    for lag in torch.unique(lags[valid]).tolist():
        of_lag = valid & (lags == lag)
        rows = of_lag.any(dim=-1).nonzero(as_tuple=True)[0]
        mask = (response_mask * of_lag.to(response_mask.dtype))[rows]
        slices.append(LagSlice(lag=int(lag), rows=rows, mask=mask, num_tokens=int(of_lag.sum())))
    return slices


def mask_stale_tokens(response_mask: torch.Tensor, lags: torch.Tensor, max_staleness: int) -> tuple[torch.Tensor, int]:
    """``response_mask`` with every valid token of lag > ``max_staleness`` zeroed, and how many were."""
    stale = response_mask.bool() & (lags > max_staleness)
    return response_mask * (~stale).to(response_mask.dtype), int(stale.sum())
