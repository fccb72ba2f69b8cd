"""Typed mirror of ``hydra_configs/backend/*.yaml``'s ``backend:`` block."""

from __future__ import annotations

from dataclasses import dataclass

BACKEND_NAMES = ("cpu",)


@dataclass(frozen=True)
class BackendConfig:
    """Which execution backend verl-partial set up; only ``cpu`` exists (GPU users keep vLLM/SGLang)."""

    name: str = "cpu"

    def __post_init__(self) -> None:
        if self.name not in BACKEND_NAMES:
            raise ValueError(f"backend.name must be one of {list(BACKEND_NAMES)}, got {self.name!r}")
