"""Typed mirror of ``hydra_configs/backend/*.yaml``'s ``backend:`` block."""

from __future__ import annotations

from dataclasses import dataclass

BACKEND_NAMES = ("cpu", "cpu_vllm", "cpu_sglang")


@dataclass(frozen=True)
class BackendConfig:
    """Which CPU execution backend verl-partial set up (GPU users keep verl's own vLLM/SGLang set-up).

    ``cpu``: our CPU engine as verl's rollout. ``cpu_vllm``: verl's own vLLM rollout on vLLM's CPU build.
    ``cpu_sglang``: ``rollout.name=sglang`` served by our CPU engine with SGLang 0.5.12's semantics (SGLang itself
    cannot run on this CPU), so verl's SGLang code paths and the SGLang server fix are exercised.
    """

    name: str = "cpu"

    def __post_init__(self) -> None:
        if self.name not in BACKEND_NAMES:
            raise ValueError(f"backend.name must be one of {list(BACKEND_NAMES)}, got {self.name!r}")
