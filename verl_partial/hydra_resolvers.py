"""OmegaConf resolvers our Hydra groups use to write verl's own keys from our typed blocks.

``+rollout_correction=<preset>`` writes verl's ``algorithm.rollout_correction`` in the composed
config itself, so whichever verl trainer runs (v0 RayPPOTrainer or v1 PPOTrainer) reads the preset,
and ``--cfg job --resolve`` prints what will run. Four of verl's keys equal one of ours and are plain
interpolations; three need our conversion (IcePop bands and asymmetric k1 bounds become verl's
``"lower_upper"`` strings, the token veto adds a second rejection mode), done by
``${verl_partial.rollout_correction:<verl key>}``.

Registered by the Hydra search-path plugin (imported by Hydra before it composes) and by the verl
plugin (imported on ``import verl`` in every process, including the Ray TaskRunner that resolves
the config). Importing this module loads neither verl nor torch.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

CORRECTION_RESOLVER = "verl_partial.rollout_correction"


def _verl_rollout_correction_field(verl_key: str, *, _root_: DictConfig) -> Any:
    """verl's ``algorithm.rollout_correction.<verl_key>`` for the ``rollout_correction`` block of ``_root_``."""
    from verl_partial.config.correction import to_verl_fields
    from verl_partial.config.job import correction_config

    correction = correction_config(_root_)
    if correction is None:
        raise ValueError(f"${{{CORRECTION_RESOLVER}:{verl_key}}} needs a rollout_correction block")
    fields = to_verl_fields(correction)
    if verl_key not in fields:
        raise ValueError(f"${{{CORRECTION_RESOLVER}:{verl_key}}}: unknown verl key; known: {sorted(fields)}")
    return fields[verl_key]


def register() -> None:
    """Idempotent: safe to call from both plugins, in any order, in every process."""
    if not OmegaConf.has_resolver(CORRECTION_RESOLVER):
        OmegaConf.register_new_resolver(CORRECTION_RESOLVER, _verl_rollout_correction_field)
