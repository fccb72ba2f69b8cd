"""What verl-partial does at each RayPPOTrainer hook (installed by ``verl_patches``).

Every function here is a no-op unless the config holds the matching block of ours, so the trainer
behaves exactly like verl's without our overrides.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from verl_partial.config import partial_config, validate_root_config

logger = logging.getLogger("verl_partial")


def before_trainer_init(config: Any) -> None:
    """Runs before RayPPOTrainer.__init__: the last moment config edits reach the workers."""
    validate_root_config(config)


def after_trainer_init(trainer: Any) -> None:
    config = partial_config(trainer.config)
    if config is not None:
        from verl_partial.glue.partial_rollout import PartialRolloutLoader

        trainer.train_dataloader = PartialRolloutLoader(trainer, config)


def _partial_loader(trainer: Any):
    from verl_partial.glue.partial_rollout import PartialRolloutLoader

    loader = getattr(trainer, "train_dataloader", None)
    return loader if isinstance(loader, PartialRolloutLoader) else None


def _step_folder(trainer: Any) -> str:
    root = trainer.config.trainer.default_local_dir
    if not os.path.isabs(root):
        root = os.path.join(os.getcwd(), root)
    return os.path.join(root, f"global_step_{trainer.global_steps}")


def before_save_checkpoint(trainer: Any) -> None:
    """In-flight groups are written before verl's tracker file, so a listed checkpoint always has them."""
    loader = _partial_loader(trainer)
    if loader is not None:
        loader.save(_step_folder(trainer))


def after_load_checkpoint(trainer: Any) -> None:
    loader = _partial_loader(trainer)
    if loader is None or trainer.global_steps == 0:
        return
    folder = _step_folder(trainer)
    if loader.load(folder):
        logger.info("restored %d in-flight partial-rollout groups from %s", len(loader.pool.groups), folder)
    else:
        logger.warning("checkpoint %s has no partial-rollout state (written without +partial); starting empty", folder)


def step_meta(batch: Any) -> dict[str, Any] | None:
    """Our per-step payload travelling in ``batch.meta_info`` (metrics and moved generation time)."""
    from verl_partial.glue.partial_rollout import META_KEY

    return batch.meta_info.pop(META_KEY, None)


def balance_enabled(config: Any) -> bool:
    block = config.get("balance")
    return block is not None and bool(block.get("enable", False))


def balance_batch(trainer: Any, batch: Any, metrics: dict[str, Any]) -> None:
    raise NotImplementedError
