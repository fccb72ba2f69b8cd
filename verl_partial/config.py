"""Reads our blocks out of verl's composed config into typed dataclasses, failing fast on bad input.

Hydra hands verl an OmegaConf tree; our groups add top-level blocks (``backend``, ``partial``,
``rollout_correction``, ``balance``). Each block maps one to one onto a dataclass, so an unknown key
or a bad value is reported with its full key name -- in the driver, before Ray starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from verl_partial.core.balance_config import BalanceConfig
from verl_partial.core.partial_config import PartialConfig
from verl_partial.cpu_backend.config import BackendConfig

T = TypeVar("T")

PARTIAL_MANAGER = "verl_partial.glue.partial_rollout.PartialAgentLoopManager"


def block_to_dataclass(config: DictConfig | dict[str, Any], block: str, cls: type[T]) -> T:
    """Build ``cls`` from ``config[block]``; unknown keys are an error naming ``block.key``."""
    raw = config.get(block) if config is not None else None
    values: dict[str, Any] = {}
    if raw is not None:
        values = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw)
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {[f'{block}.{key}' for key in unknown]}; allowed keys: {sorted(known)}")
    return cls(**values)


def backend_config(config: DictConfig) -> BackendConfig | None:
    if config.get("backend") is None:
        return None
    return block_to_dataclass(config, "backend", BackendConfig)


def partial_config(config: DictConfig) -> PartialConfig | None:
    """The partial-rollout config when ``+partial=...`` was selected and enabled, else None."""
    if config.get("partial") is None:
        return None
    parsed = block_to_dataclass(config, "partial", PartialConfig)
    return parsed if parsed.enable else None


def check_partial_against_trainer(config: DictConfig) -> None:
    """Combinations partial rollout cannot honour fail here, naming the verl key to change."""
    rollout = config.actor_rollout_ref.rollout
    problems = []
    if config.trainer.get("use_v1", False):
        problems.append("trainer.use_v1 must be false: partial rollout hooks the legacy RayPPOTrainer")
    if str(config.algorithm.adv_estimator).lower() == "remax":
        problems.append("algorithm.adv_estimator=remax is unsupported: its greedy baseline rollouts are not groups")
    if not rollout.get("calculate_log_probs", False):
        problems.append(
            "actor_rollout_ref.rollout.calculate_log_probs must be true: parked samples keep per-token log-probs"
        )
    manager = rollout.get("agent", {}).get("agent_loop_manager_class")
    if manager != PARTIAL_MANAGER:
        problems.append(f"actor_rollout_ref.rollout.agent.agent_loop_manager_class must be {PARTIAL_MANAGER}")
    if problems:
        raise ValueError("partial rollout cannot run with this config:\n  - " + "\n  - ".join(problems))


def check_balance_against_trainer(config: DictConfig) -> None:
    """Group-preserving balancing relies on the actor splitting its shard into mini-batches in order."""
    balance = block_to_dataclass(config, "balance", BalanceConfig)
    if not config.trainer.get("balance_batch", True):
        raise ValueError("balance needs trainer.balance_batch=true: verl only balances (and we only hook) then")
    if balance.enable and config.actor_rollout_ref.actor.get("shuffle", False):
        raise ValueError(
            "balance.enable=true needs actor_rollout_ref.actor.shuffle=false: a shuffled actor regroups "
            "mini-batches per rank, so no order can keep groups together"
        )


def validate_root_config(config: DictConfig) -> None:
    """Validate every block of ours present in ``config``; raises ValueError naming the key."""
    backend_config(config)
    if partial_config(config) is not None:
        check_partial_against_trainer(config)
    if config.get("balance") is not None:
        check_balance_against_trainer(config)
    if config.get("rollout_correction") is not None:
        from verl_partial.core.correction import check_against_trainer, from_mapping

        raw = config.rollout_correction
        correction = from_mapping(OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else raw)
        check_against_trainer(
            correction,
            calculate_log_probs=bool(config.actor_rollout_ref.rollout.get("calculate_log_probs", False)),
            policy_loss_mode=config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla"),
        )
