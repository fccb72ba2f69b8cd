"""The ``balance:`` block: group-preserving batch balancing, its documentation and its one preset.

Kept separate from the algorithm so that config loading (Hydra/OmegaConf) and the pure packing code do not depend
on each other. Each field's docstring is the documentation of ``balance.<field>`` (docs/configuration.md is
generated from it); validation follows :mod:`verl_partial.config.checks`. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from verl_partial.config.checks import check_types, choices, require

__all__ = ["BLOCK", "BalanceConfig", "COST_MODELS", "ON_INFEASIBLE_MODES", "PRESETS", "ROW_MODES"]

BLOCK = "balance"

CostModel = Literal["workload", "tokens", "flops"]
OnInfeasible = Literal["error", "split"]
RowMode = Literal["trajectory", "transition"]
#: Allowed values of ``balance.cost``.
COST_MODELS: tuple[str, ...] = choices(CostModel)
#: Allowed values of ``balance.on_infeasible``.
ON_INFEASIBLE_MODES: tuple[str, ...] = choices(OnInfeasible)
#: Allowed values of ``balance.rows``.
ROW_MODES: tuple[str, ...] = choices(RowMode)


@dataclass(frozen=True)
class BalanceConfig:
    """Group-preserving balancing; ``+balance=group`` is ``PRESETS["group"]``."""

    enable: bool = False
    """Replace verl's sample-level ``_balance_batch`` with the group-preserving one. ``false`` (with the ``balance``
    block present) runs verl's own and only measures how many groups its order splits across mini-batches."""

    group_key: str = "uid"
    """Non-tensor key whose value names the group a row belongs to. ``uid`` (one prompt's ``rollout.n`` responses)
    is verl's default; a multi-turn pipeline that emits one row per transition should use its rollout/trajectory id
    so that one trajectory never spans two optimizer steps."""

    cost: CostModel = "workload"
    """Per-sample cost model used for balancing. ``workload`` is verl's own ``calculate_workload`` (24576·L + L²,
    calibrated for a 7B dense model) so our numbers are comparable with verl's ``global_seqlen/*`` metrics;
    ``tokens`` is L (right when the step is memory/linear bound or for tiny models); ``flops`` is 2·N_params·L +
    2·num_layers·L²·hidden from the actual model config."""

    keep_group_on_rank: bool = False
    """Additionally keep each group on a single data-parallel rank (useful for prefix sharing, e.g. verl's
    PrefixGrouper). Best effort: a mini-batch whose group sizes cannot be packed into exact per-rank slots falls back
    to per-sample placement inside that mini-batch and is counted in ``balance/rank_fallback_minibatches``."""

    on_infeasible: OnInfeasible = "error"
    """What to do when groups cannot be packed into whole mini-batches (a group larger than a mini-batch, or sizes
    that cannot fill mini-batches exactly). ``error`` raises a ValueError naming the sizes; ``split`` cuts the fewest
    groups needed, counts them in ``balance/fallback_groups_split`` and carries on. Batch/mini-batch/dp divisibility
    errors are always raised: verl itself cannot run such a batch."""

    rows: RowMode = "trajectory"
    """What one training row is. ``trajectory`` (verl's v0 layout): one row per rollout, multi-turn responses with
    tool output masked. ``transition`` (agent-lightning's layout, verl v1's multi-output semantics): each multi-turn
    row is cut into one row per model turn before balancing (prompt = the context so far, response = that turn), the
    trajectory's reward is copied to every transition, the row count is padded with zero-mask rows to a multiple of
    the mini-batch, and GRPO advantages come from each trajectory's final transition, broadcast to the others. Adds
    the ``trajectory_id`` column to group by (``balance.group_key=trajectory_id``). Needs multi-turn rollout and
    GRPO; see :mod:`verl_partial.core.balance.transitions`."""

    def __post_init__(self) -> None:
        check_types(self, BLOCK)
        require(
            bool(self.group_key),
            f"{BLOCK}.group_key",
            "a non-empty string naming a non-tensor batch key (e.g. 'uid')",
            self.group_key,
        )


#: Every ``+balance=<name>`` preset; ``hydra_configs/balance/<name>.yaml`` holds the same values.
PRESETS: dict[str, BalanceConfig] = {"group": BalanceConfig(enable=True)}
