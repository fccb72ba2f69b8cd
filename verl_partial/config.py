"""Reads our blocks out of verl's composed config into typed dataclasses, failing fast on bad input.

Hydra hands verl an OmegaConf tree; our groups add top-level blocks (``backend``, ``partial``,
``rollout_correction``, ``balance``). Each block maps one to one onto a dataclass, so an unknown key
or a bad value is reported with its full key name before Ray starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from verl_partial.cpu_backend.config import BackendConfig

T = TypeVar("T")


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


def validate_root_config(config: DictConfig) -> None:
    """Validate every block of ours present in ``config``; raises ValueError naming the key."""
    backend_config(config)
