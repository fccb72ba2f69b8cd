"""Rollout correction: verl's policy losses guarded against micro-batches with nothing to train.

Installed by ``install()`` only in processes started with VERL_PARTIAL_ALL_REJECTED_GUARD=1, which the driver exports
when the config has a ``rollout_correction`` block; otherwise verl's losses stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from verl_partial.patches.guard import check_verl_version

# Set for every Ray process by the driver when our rollout-correction block is in the config.
ALL_REJECTED_GUARD_ENV = "VERL_PARTIAL_ALL_REJECTED_GUARD"


def install_all_rejected_guard(loss_modes: Iterable[str] | None = None) -> None:
    """Guard the named (default: all registered) policy losses in verl's ``POLICY_LOSS_REGISTRY``.

    The wrapper is :func:`verl_partial.glue.correction.guard_all_rejected`. verl's ``ppo_loss`` looks the
    loss up by name on every call (``core_algos.get_policy_loss_fn``), so replacing the registry entry is
    enough; patching the module attribute would not be. Must run in each actor worker process; idempotent.
    Losses registered after the call are not guarded.
    """
    import verl
    from verl.trainer.ppo import core_algos

    from verl_partial.glue.correction import guard_all_rejected

    check_verl_version(verl.__version__)  # the registry and the loss signature are verl 0.9's
    registry = core_algos.POLICY_LOSS_REGISTRY
    for name in list(registry) if loss_modes is None else loss_modes:
        registry[name] = guard_all_rejected(core_algos.get_policy_loss_fn(name))
