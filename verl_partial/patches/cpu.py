"""CPU backends: "cpu" (and, for ``+backend=cpu_sglang``, "sglang") registered with verl's platform and rollout
registries, and the fixes for the places where verl 0.9 assumes an accelerator."""

from __future__ import annotations

import functools
import os

CPU_PLATFORM_ENV = "VERL_PLATFORM"
CPU_ROLLOUT_NAME = "cpu"
CPU_SERVER_ADAPTER = "verl_partial.cpu_backend.rollout.CpuServerAdapter"


def _register_cpu_backend() -> None:
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl_partial.cpu_backend.platform import PLATFORM_NAME, PlatformCPU

    PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)

    def load_cpu_replica():
        from verl_partial.cpu_backend.rollout import CpuReplica

        return CpuReplica

    RolloutReplicaRegistry.register(CPU_ROLLOUT_NAME, load_cpu_replica)
    # verl offers no public call for the in-worker adapter; its private registry is the only door.
    rollout_base._ROLLOUT_REGISTRY[(CPU_ROLLOUT_NAME, "async")] = CPU_SERVER_ADAPTER


def apply_cpu_process_fixes() -> None:
    """Fix the three places where verl 0.9 assumes an accelerator.

    Found by running verl 0.9.1's ``RayPPOTrainer`` on the CPU platform and described for users in
    docs/engines.md ("Fixes for verl's accelerator assumptions"); each fix below names the verl code it
    works around.
    """
    import verl.utils.distributed as distributed
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    # verl's initialize_global_process_group_ray (verl/utils/distributed.py) builds "cpu:gloo,{device}:{backend}",
    # i.e. "cpu:gloo,cpu:gloo" on CPU, which torch rejects.
    original_init_pg = distributed.initialize_global_process_group_ray
    if not getattr(original_init_pg, "_verl_partial", False):

        @functools.wraps(original_init_pg)
        def init_process_group_gloo(timeout_second=None, backend=None):
            return original_init_pg(timeout_second=timeout_second, backend=backend or "cpu:gloo")

        init_process_group_gloo._verl_partial = True  # type: ignore[attr-defined]
        distributed.initialize_global_process_group_ray = init_process_group_gloo

    # FSDP engines (verl/workers/engine/fsdp/transformer_impl.py) are registered for cuda/npu only; they are
    # device-generic given the platform.
    for model_type, engine_cls in (
        ("language_model", transformer_impl.FSDPEngineWithLMHead),
        ("value_model", transformer_impl.FSDPEngineWithValueHead),
    ):
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine_cls)

    # The forward-only (ref) engine asks FSDP2 for pinned host memory (CPUOffloadPolicy(pin_memory=True) in
    # transformer_impl.py), which needs an accelerator.
    original_policy = transformer_impl.CPUOffloadPolicy
    if not getattr(original_policy, "_verl_partial", False):

        def unpinned_offload_policy(*args, **kwargs):
            kwargs["pin_memory"] = False
            return original_policy(*args, **kwargs)

        unpinned_offload_policy._verl_partial = True  # type: ignore[attr-defined]
        transformer_impl.CPUOffloadPolicy = unpinned_offload_policy


def _select_cpu_platform_in_driver() -> None:
    """The driver resolved its platform at import time (before Hydra ran); switch it to CPU."""
    from verl.plugin.platform import get_platform, set_platform

    from verl_partial.cpu_backend.platform import PlatformCPU

    os.environ[CPU_PLATFORM_ENV] = CPU_ROLLOUT_NAME
    if get_platform().device_name != "cpu":
        set_platform(PlatformCPU())


# Exported to every Ray process by hydra_configs/backend/cpu_sglang.yaml.
CPU_SGLANG_ENV = "VERL_PARTIAL_CPU_SGLANG"
CPU_SGLANG_ROLLOUT_NAME = "sglang"


def _register_cpu_sglang_backend() -> None:
    """``rollout.name=sglang`` resolves to :class:`~verl_partial.cpu_backend.rollout.CpuSglangReplica` and its
    in-worker adapter, through the same registries ``_register_cpu_backend`` uses for "cpu"."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def load_cpu_sglang_replica():
        from verl_partial.cpu_backend.rollout import CpuSglangReplica

        return CpuSglangReplica

    RolloutReplicaRegistry.register(CPU_SGLANG_ROLLOUT_NAME, load_cpu_sglang_replica)
    rollout_base._ROLLOUT_REGISTRY[(CPU_SGLANG_ROLLOUT_NAME, "async")] = CPU_SERVER_ADAPTER
