"""Config keys that only verl 0.9.1's v1 trainer reads, and what verl-partial does with each on the legacy trainer.

``+partial`` (and ``+backend``, ``+balance``) run verl's legacy ``RayPPOTrainer`` (``trainer.use_v1=false``). The
keys below are read by ``verl/trainer/ppo/v1/`` and nowhere else in verl 0.9.1 (grep of the wheel: no reader outside
``trainer/ppo/v1/`` and the config schema; ``utils/tracking.py`` only logs a filter_groups table v1 builds). On the
legacy trainer they would be silently ignored, so a value other than verl's default is refused at start-up, naming
the key. Each reason says what to use instead where there is something. ``algorithm.filter_groups`` is the one
``+partial`` honours itself (its pool filters whole groups at hand-over, :mod:`verl_partial.core.partial.group_filter`):
it is refused without ``+partial``, and with it only where the rewards are not known before hand-over (a colocated
reward model scores inside ``fit()``, after the step's groups were chosen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

_MISSING = object()
_SAMPLER = "v1's replay-buffer sampler; the legacy trainer has none"


@dataclass(frozen=True)
class V1OnlyKey:
    """One key only v1 reads: verl 0.9.1's default (the value the legacy trainer's behaviour matches) and why a
    different value cannot be honoured on the legacy trainer."""

    key: str
    default: Any
    reason: str
    # ``+partial`` implements it on the legacy trainer (then :func:`check_filter_groups` decides).
    partial_honours: bool = False


V1_ONLY_KEYS: tuple[V1OnlyKey, ...] = (
    V1OnlyKey(
        "algorithm.filter_groups.enable",
        False,
        "DAPO's dynamic sampling (drop groups whose rewards do not vary, keep drawing) lives only in v1's replay "
        "buffer (trainer/ppo/v1/replay_buffer.py, trainer_base.py 173-189 and 728); the legacy trainer never filters. "
        "Add +partial=<preset>, whose pool filters whole groups itself",
        partial_honours=True,
    ),
    V1OnlyKey(
        "trainer.checkpoint_callback_class",
        None,
        "only v1's trainer builds and calls it (trainer/ppo/v1/trainer_base.py 122, 1014, 1027: "
        "build_checkpoint_callback / on_save); the legacy trainer would never call it",
    ),
    V1OnlyKey(
        "trainer.v1.trainer_mode",
        "sync",
        "selects v1's own trainer (colocate_async / separate_async); +partial is an asynchronous mode of the legacy "
        "trainer and replaces it, it cannot run inside it",
    ),
    V1OnlyKey("trainer.v1.colocate_async.num_warmup_batches", 1, "read only by v1's colocate_async trainer"),
    V1OnlyKey("trainer.v1.separate_async.num_warmup_batches", 1, "read only by v1's separate_async trainer"),
    V1OnlyKey("trainer.v1.separate_async.parameter_sync_step", 4, "read only by v1's separate_async trainer"),
    V1OnlyKey(
        "trainer.v1.separate_async.hybrid_rollout.enable_switch",
        False,
        "v1's separate_async trainer lends idle trainer GPUs to rollout; the legacy trainer is colocated",
    ),
    V1OnlyKey(
        "trainer.v1.sampler.max_off_policy_threshold",
        8,
        "v1's staleness bound; with +partial set partial.max_staleness (and partial.staleness_policy) instead",
    ),
    V1OnlyKey(
        "trainer.v1.sampler.max_off_policy_strategy",
        "drop",
        "v1's staleness handling; with +partial set partial.staleness_policy instead",
    ),
    V1OnlyKey(
        "trainer.v1.sampler.sync_refill_failed_groups",
        False,
        "v1's sync trainer refills failed groups; with +partial a failed call is retried (partial.max_retries) and "
        "the step draws prompts until its groups are complete",
    ),
    V1OnlyKey("trainer.v1.sampler.custom_sampler.path", None, _SAMPLER),
    V1OnlyKey("trainer.v1.sampler.custom_sampler.name", None, _SAMPLER),
    V1OnlyKey("trainer.v1.sampler.sampler_kwargs", {}, _SAMPLER),
)


def _value(config: DictConfig, key: str) -> Any:
    value = OmegaConf.select(config, key, default=_MISSING)
    if value is _MISSING:
        return _MISSING
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def filter_groups_enabled(config: DictConfig) -> bool:
    return bool(OmegaConf.select(config, "algorithm.filter_groups.enable", default=False))


def check_filter_groups(config: DictConfig) -> None:
    """``algorithm.filter_groups`` under ``+partial``: groups are judged on rewards computed during generation by
    verl's reward loop (as v1 requires too), so a reward model colocated with the actor is refused, and so is a
    metric left empty."""
    if not filter_groups_enabled(config):
        return
    metric = OmegaConf.select(config, "algorithm.filter_groups.metric", default=None)
    if not metric:
        raise ValueError("algorithm.filter_groups.metric must be set when algorithm.filter_groups.enable=true")
    enable_rm = bool(OmegaConf.select(config, "reward.reward_model.enable", default=False))
    own_pool = bool(OmegaConf.select(config, "reward.reward_model.enable_resource_pool", default=False))
    if enable_rm and not own_pool:
        raise ValueError(
            "algorithm.filter_groups.enable=true with +partial needs each group's rewards while it generates (verl's "
            "reward loop): use a rule-based reward or reward.reward_model.enable_resource_pool=true; a colocated "
            "reward model scores only inside fit(), after the step's groups were chosen"
        )


def check_v1_only_keys(config: DictConfig, groups: str, partial: bool = False) -> None:
    """Refuse every v1-only key set to a value other than verl's default, naming it; ``groups`` names what moved
    the job to the legacy trainer (for the message); ``partial``: ``+partial`` is among them, and honours the keys
    marked so. An absent key is verl's default."""
    if partial:
        check_filter_groups(config)
    problems = []
    for entry in V1_ONLY_KEYS:
        if partial and entry.partial_honours:
            continue
        value = _value(config, entry.key)
        if value is not _MISSING and value != entry.default:
            problems.append(f"{entry.key}={value!r} (verl's default {entry.default!r}): {entry.reason}")
    if problems:
        raise ValueError(
            f"{groups} run verl's legacy RayPPOTrainer (trainer.use_v1=false), which never reads these keys of verl's "
            "v1 trainer; they would be silently ignored:\n  - " + "\n  - ".join(problems) + "\nReset them to verl's "
            "default, or drop the verl-partial groups to run verl's v1 trainer"
        )
