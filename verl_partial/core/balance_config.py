"""Configuration of group-preserving batch balancing (the ``balance.*`` keys).

Kept separate from the algorithm so that config loading (Hydra/OmegaConf) and the pure packing code do
not depend on each other; this module imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BalanceConfig", "COST_MODELS", "ON_INFEASIBLE_MODES", "ROW_MODES"]

#: Allowed values of ``balance.cost``.
COST_MODELS: tuple[str, ...] = ("workload", "tokens", "flops")
#: Allowed values of ``balance.on_infeasible``.
ON_INFEASIBLE_MODES: tuple[str, ...] = ("error", "split")
#: Allowed values of ``balance.rows``.
ROW_MODES: tuple[str, ...] = ("trajectory", "transition")
# Config path of the block, used in error messages so users can find the key to fix.
_PREFIX = "balance"


@dataclass
class BalanceConfig:
    """The ``balance:`` block.

    Attributes:
        enable: Replace verl's sample-level ``_balance_batch`` with the group-preserving one.
        group_key: Non-tensor key whose value names the group a row belongs to. ``uid`` (one prompt's
            ``rollout.n`` responses) is verl's default; a multi-turn pipeline that emits one row per
            transition should use its rollout/trajectory id so that one trajectory never spans two
            optimizer steps.
        cost: Per-sample cost model used for balancing. ``workload`` is verl's own
            ``calculate_workload`` (24576·L + L², calibrated for a 7B dense model) so our numbers are
            comparable with verl's ``global_seqlen/*`` metrics; ``tokens`` is L (right when the step is
            memory/linear bound or for tiny models); ``flops`` is 2·N_params·L + 2·num_layers·L²·hidden
            from the actual model config.
        keep_group_on_rank: Additionally keep each group on a single data-parallel rank (useful for
            prefix sharing, e.g. verl's PrefixGrouper). Best effort: a mini-batch whose group sizes cannot
            be packed into exact per-rank slots falls back to per-sample placement inside that mini-batch
            and is counted in ``balance/rank_fallback_minibatches``.
        on_infeasible: What to do when groups cannot be packed into whole mini-batches (a group larger
            than a mini-batch, or sizes that cannot fill mini-batches exactly). ``error`` raises a
            ValueError naming the sizes; ``split`` cuts the fewest groups needed, counts them in
            ``balance/fallback_groups_split`` and carries on. Batch/mini-batch/dp divisibility errors are
            always raised: verl itself cannot run such a batch.
        rows: What one training row is. ``trajectory`` (verl's v0 layout): one row per rollout, multi-turn
            responses with tool output masked. ``transition`` (agent-lightning's layout, verl v1's
            multi-output semantics): each multi-turn row is cut into one row per model turn before balancing
            (prompt = the context so far, response = that turn), the trajectory's reward is copied to every
            transition, the row count is padded with zero-mask rows to a multiple of the mini-batch, and GRPO
            advantages come from each trajectory's final transition, broadcast to the others. Adds the
            ``trajectory_id`` column to group by (``balance.group_key=trajectory_id``). Needs multi-turn
            rollout and GRPO; see :mod:`verl_partial.core.transitions`.
    """

    enable: bool = False
    group_key: str = "uid"
    cost: str = "workload"
    keep_group_on_rank: bool = False
    on_infeasible: str = "error"
    rows: str = "trajectory"

    def __post_init__(self) -> None:
        # Bool checks are strict: a YAML typo such as ``enable: "false"`` would otherwise be truthy.
        for name in ("enable", "keep_group_on_rank"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{_PREFIX}.{name} must be a bool (true or false), got {value!r}")
        if not isinstance(self.group_key, str) or not self.group_key:
            raise ValueError(
                f"{_PREFIX}.group_key must be a non-empty string naming a non-tensor batch key "
                f"(e.g. 'uid'), got {self.group_key!r}"
            )
        if self.cost not in COST_MODELS:
            raise ValueError(f"{_PREFIX}.cost must be one of {list(COST_MODELS)}, got {self.cost!r}")
        if self.on_infeasible not in ON_INFEASIBLE_MODES:
            raise ValueError(
                f"{_PREFIX}.on_infeasible must be one of {list(ON_INFEASIBLE_MODES)}, got {self.on_infeasible!r}"
            )
        if self.rows not in ROW_MODES:
            raise ValueError(f"{_PREFIX}.rows must be one of {list(ROW_MODES)}, got {self.rows!r}")
