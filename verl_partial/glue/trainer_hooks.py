"""What verl-partial does at each RayPPOTrainer hook (installed by ``patches.trainer``).

Every function here is a no-op unless the config holds the matching block of ours, so the trainer
behaves exactly like verl's without our overrides.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from verl_partial.config.job import balance_config, correction_config, partial_config, validate_root_config

logger = logging.getLogger("verl_partial")


# The typed rollout-correction config of the trainer in this process (one trainer per TaskRunner).
_correction: Any = None


def before_trainer_init(config: Any) -> None:
    """Runs before RayPPOTrainer.__init__: validates again in the TaskRunner; edits nothing.

    Our groups write verl's own keys in the composed config (``verl_partial.hydra_resolvers``), so
    what the workers receive is what ``--cfg job --resolve`` printed; the check here only refuses a
    config that no longer says what our blocks ask for.
    """
    global _correction
    validate_root_config(config)
    _correction = correction_config(config)


def after_trainer_init(trainer: Any) -> None:
    config = partial_config(trainer.config)
    if config is not None:
        from verl_partial.glue.partial.rollout import PartialRolloutLoader

        trainer.train_dataloader = PartialRolloutLoader(trainer, config)


def _partial_loader(trainer: Any):
    from verl_partial.glue.partial.rollout import PartialRolloutLoader

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
    from verl_partial.glue.dataproto import pop_step_meta

    return pop_step_meta(batch)


def staleness_aware_correction(batch: Any) -> dict[str, float]:
    """Lag-split correction metrics and the optional stale-token mask, before verl's correction runs.

    Needs our correction block and the per-token policy versions partial rollout puts in the batch;
    returns no metrics otherwise.
    """
    from verl_partial.glue.dataproto import (
        apply_staleness_mask,
        compute_lag_split_metrics,
        has_policy_versions,
        read_step_meta,
    )

    meta = read_step_meta(batch)
    if _correction is None or meta is None or not has_policy_versions(batch):
        return {}
    metrics: dict[str, float] = {}
    if _correction.log_by_lag:
        metrics.update(compute_lag_split_metrics(batch, _correction, meta["version"]))
    if _correction.max_staleness is not None:
        metrics.update(apply_staleness_mask(batch, _correction, meta["version"]))
    return metrics


def add_step_metrics(batch: Any, metrics: dict[str, float]) -> None:
    """Queue metrics for this step's log line (merged where verl computes its timing metrics)."""
    from verl_partial.glue.dataproto import add_step_metrics as add

    add(batch, metrics)


def balance_batch(
    trainer: Any,
    batch: Any,
    metrics: dict[str, Any],
    dp_size: int,
    verl_default: Any,
    critic_dp_size: int | None = None,
) -> None:
    """Group-preserving balancing in place of verl's; with ``balance.enable=false``, measure verl's own.

    ``verl_default(batch, metrics)`` is verl's original ``_balance_batch``; the measurement mode runs it
    unchanged and reports how many groups its order splits across mini-batches. ``critic_dp_size`` is the
    critic's data-parallel size when the trainer has a critic (it trains on the same order, so it must cut
    mini-batches like the actor).
    """
    from verl_partial.config.job import check_balance_critic
    from verl_partial.glue.dataproto import balance_batch_by_group, measure_batch_order

    config = balance_config(trainer.config)
    if config.enable and critic_dp_size is not None:
        check_balance_critic(trainer.config, critic_dp_size=critic_dp_size, actor_dp_size=dp_size)
    mini_batch = trainer.config.actor_rollout_ref.actor.ppo_mini_batch_size * trainer.config.actor_rollout_ref.rollout.n
    model_config = _model_config(trainer.config.actor_rollout_ref.model.path) if config.cost == "flops" else None
    sizes = dict(config=config, dp_size=dp_size, mini_batch_size_samples=mini_batch, model_config=model_config)
    transitions = config.rows == "transition"
    if transitions:
        from verl_partial.glue.dataproto import expand_to_transitions

        pad_token_id = trainer.tokenizer.pad_token_id
        metrics.update(expand_to_transitions(batch, row_multiple=mini_batch, pad_token_id=pad_token_id))
    if config.enable:
        metrics.update(balance_batch_by_group(batch, **sizes))
    else:
        verl_default(batch, metrics)
        metrics.update(measure_batch_order(batch, **sizes))
    if transitions:
        from verl_partial.glue.dataproto import trajectories_split

        metrics.update(trajectories_split(batch, dp_size=dp_size, mini_batch_size_samples=mini_batch))


def transition_advantage(data: Any, compute_advantage: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """verl's ``compute_advantage``, or for a batch cut into transitions (``balance.rows=transition``) the
    per-trajectory GRPO broadcast of verl v1."""
    from verl_partial.glue.dataproto import is_cut_into_transitions
    from verl_partial.glue.dataproto import transition_advantage as broadcast

    if not is_cut_into_transitions(data):
        return compute_advantage(data, *args, **kwargs)
    bound = inspect.signature(compute_advantage).bind(data, *args, **kwargs)
    options = {name: value for name, value in bound.arguments.items() if name != "data"}
    estimator = str(getattr(options.get("adv_estimator"), "value", options.get("adv_estimator")))
    if estimator != "grpo":
        raise ValueError(
            f"balance.rows=transition supports algorithm.adv_estimator=grpo only (verl v1's per-trajectory rule), "
            f"got {estimator!r}"
        )
    return broadcast(data, compute_advantage, **options)


@functools.lru_cache(maxsize=4)
def _model_config(path: str) -> Any:
    """The actor model's config for ``balance.cost=flops``: read from disk once, not at every step."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
