"""What verl-partial does at each RayPPOTrainer hook (installed by ``verl_patches``).

Every function here is a no-op unless the config holds the matching block of ours, so the trainer
behaves exactly like verl's without our overrides.
"""

from __future__ import annotations

from typing import Any


def before_trainer_init(config: Any) -> None:
    """Runs before RayPPOTrainer.__init__: the last moment config edits reach the workers."""
    from verl_partial.config import validate_root_config

    validate_root_config(config)


def after_trainer_init(trainer: Any) -> None:
    return None


def balance_enabled(config: Any) -> bool:
    block = config.get("balance")
    return block is not None and bool(block.get("enable", False))


def balance_batch(trainer: Any, batch: Any, metrics: dict[str, Any]) -> None:
    raise NotImplementedError
