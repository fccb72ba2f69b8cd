"""Trainer: ``RayPPOTrainer`` hooks. ``verl.trainer.ppo.ray_trainer`` imports the whole worker stack (~3 s,
0.5 GB), so it is patched when something else imports it, never imported by us."""

from __future__ import annotations

import functools
from types import ModuleType

from verl_partial.patches.imports import after_import

RAY_TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"


def _wrap_trainer() -> None:
    after_import(RAY_TRAINER_MODULE, _patch_ray_trainer)


def _patch_ray_trainer(module: ModuleType) -> None:
    from verl_partial.glue import trainer_hooks

    trainer_cls = module.RayPPOTrainer
    if getattr(trainer_cls, "_verl_partial_patched", False):
        return
    trainer_cls._verl_partial_patched = True

    original_init = trainer_cls.__init__

    @functools.wraps(original_init)
    def __init__(self, config, *args, **kwargs):
        trainer_hooks.before_trainer_init(config)
        original_init(self, config, *args, **kwargs)
        trainer_hooks.after_trainer_init(self)

    trainer_cls.__init__ = __init__

    original_balance = trainer_cls._balance_batch

    @functools.wraps(original_balance)
    def _balance_batch(self, batch, metrics, *args, **kwargs):
        if self.config.get("balance") is not None:
            dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
            # The critic is a TrainingWorker: its dp ranks are registered under the "train" mesh.
            critic_dp = self._get_dp_size(self.critic_wg, "train") if getattr(self, "use_critic", False) else None

            def verl_default(b, m):
                return original_balance(self, b, m, *args, **kwargs)

            return trainer_hooks.balance_batch(self, batch, metrics, dp_size, verl_default, critic_dp)
        return original_balance(self, batch, metrics, *args, **kwargs)

    trainer_cls._balance_batch = _balance_batch

    original_save = trainer_cls._save_checkpoint

    @functools.wraps(original_save)
    def _save_checkpoint(self, *args, **kwargs):
        trainer_hooks.before_save_checkpoint(self)
        return original_save(self, *args, **kwargs)

    trainer_cls._save_checkpoint = _save_checkpoint

    original_load = trainer_cls._load_checkpoint

    @functools.wraps(original_load)
    def _load_checkpoint(self, *args, **kwargs):
        result = original_load(self, *args, **kwargs)
        trainer_hooks.after_load_checkpoint(self)
        return result

    trainer_cls._load_checkpoint = _load_checkpoint

    # fit() builds each step's metrics from module-level helpers; this one sees the final batch and
    # the step's timing dict, so our per-step payload (metrics, generation time moved out of the
    # "gen" timer by partial rollout) is merged here.
    original_timing = module.compute_timing_metrics

    @functools.wraps(original_timing)
    def compute_timing_metrics(batch, timing_raw, *args, **kwargs):
        payload = trainer_hooks.step_meta(batch)
        if payload is not None:
            for key in ("gen", "step"):
                timing_raw[key] = timing_raw.get(key, 0.0) + payload.get("gen_seconds", 0.0)
        metrics = original_timing(batch, timing_raw, *args, **kwargs)
        if payload is not None:
            metrics.update(payload.get("metrics", {}))
        return metrics

    module.compute_timing_metrics = compute_timing_metrics

    # fit() calls the module-level compute_advantage. With balance.rows=transition the batch is flagged (only
    # then) and GRPO runs on each trajectory's final transition, broadcast to the others (verl v1's rule).
    original_advantage = module.compute_advantage

    @functools.wraps(original_advantage)
    def compute_advantage(data, *args, **kwargs):
        return trainer_hooks.transition_advantage(data, original_advantage, args, kwargs)

    module.compute_advantage = compute_advantage
    after_import(ROLLOUT_CORR_MODULE, _patch_rollout_corr_helper)


ROLLOUT_CORR_MODULE = "verl.trainer.ppo.rollout_corr_helper"


def _patch_rollout_corr_helper(module: ModuleType) -> None:
    """fit() imports these two inside the step, so wrapping the module attributes takes effect."""
    from verl_partial.glue import trainer_hooks

    if getattr(module, "_verl_partial_patched", False):
        return
    module._verl_partial_patched = True
    original_decoupled = module.compute_rollout_correction_and_add_to_batch

    @functools.wraps(original_decoupled)
    def compute_rollout_correction_and_add_to_batch(batch, *args, **kwargs):
        ours = trainer_hooks.staleness_aware_correction(batch)
        batch, metrics = original_decoupled(batch, *args, **kwargs)
        return batch, {**metrics, **ours}

    module.compute_rollout_correction_and_add_to_batch = compute_rollout_correction_and_add_to_batch

    original_bypass = module.apply_bypass_mode

    @functools.wraps(original_bypass)
    def apply_bypass_mode(batch, *args, **kwargs):
        # Bypass reports no driver-side metrics; ours ride along in the step payload.
        ours = trainer_hooks.staleness_aware_correction(batch)
        trainer_hooks.add_step_metrics(batch, ours)
        return original_bypass(batch, *args, **kwargs)

    module.apply_bypass_mode = apply_bypass_mode
