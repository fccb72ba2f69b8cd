"""Typed mirror of ``hydra_configs/backend/*.yaml``'s ``backend:`` block."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from verl_partial.config.checks import check_types, require

if TYPE_CHECKING:
    from verl_partial.sim.engine import ServerSpec

BACKEND_NAMES = ("cpu", "cpu_vllm", "cpu_sglang")
# The back-ends whose engine is ours, so the only ones that can apply ``backend.emulate_gpu``.
EMULATING_BACKENDS = ("cpu", "cpu_sglang")
# How the driver hands ``backend.emulate_gpu`` to the rollout servers (Ray runtime_env, every process).
EMULATE_GPU_ENV = "VERL_PARTIAL_EMULATE_GPU"
# A folder where each of our CPU engines keeps its counters as JSON (benchmarks: every trainer mode's engine steps and
# overruns, verl's own trainers included).
ENGINE_STATS_DIR_ENV = "VERL_PARTIAL_ENGINE_STATS_DIR"

# "<GPU>/<model>" in the simulator's names (verl_partial/sim/hardware.py), every pair whose weights fit one GPU
# (tests/unit/test_emulated_gpu.py holds this list to the hardware tables).
# Spelled out, not built from the tables: the typed configs sit below the simulator (tests/unit/test_layers.py).
EmulateGpu = Literal[
    "H100-SXM/Qwen2.5-7B",
    "H100-PCIe/Qwen2.5-7B",
    "H800-SXM/Qwen2.5-7B",
    "H20/Qwen2.5-7B",
    "H20/Qwen2.5-32B",
    "H200-SXM/Qwen2.5-7B",
    "H200-SXM/Qwen2.5-32B",
    "A100-SXM-80GB/Qwen2.5-7B",
    "A800-SXM-80GB/Qwen2.5-7B",
    "A100-SXM-40GB/Qwen2.5-7B",
    "L40S/Qwen2.5-7B",
    "B200/Qwen2.5-7B",
    "B200/Qwen2.5-32B",
    "MI300X/Qwen2.5-7B",
    "MI300X/Qwen2.5-32B",
]
EMULATE_GPU_CHOICES: tuple[str, ...] = typing.get_args(EmulateGpu)


@dataclass(frozen=True)
class EmulatedGpu:
    """A GPU-shaped engine: our CPU engine's steps last as long as ``model`` would take on one ``gpu``, and it holds
    only the KV cache that ``gpu`` holds for ``model``.

    The forward still runs (on the CPU, in the engine's worker thread); the engine then sleeps the rest of the
    time the simulator's roofline (:meth:`verl_partial.sim.engine.ServerSpec.step_seconds`) gives for that step's
    batch, with the cores idle, as a GPU host's are. Requests wait for KV-cache room and the newest running one is
    preempted when decoding outgrows it (:attr:`verl_partial.sim.engine.ServerSpec.kv_capacity_tokens`, vLLM's
    recompute preemption, as in the simulator): without the limit, a partial mode holding more context than the GPU
    could would look better than it would be. With ``rollout.enable_prefix_caching`` (on in verl) a step is charged
    only the prefill vLLM's prefix cache would compute (:mod:`verl_partial.core.engines.prefix_cache`): without it,
    every sample of a group would pay its prompt's prefill, which a GPU server pays once.
    """

    gpu: str
    model: str

    @classmethod
    def parse(cls, name: str | None) -> EmulatedGpu | None:
        """``"H100-SXM/Qwen2.5-7B"`` (``backend.emulate_gpu``, or the env var the driver exports); None: off."""
        if not name:
            return None
        require(name in EMULATE_GPU_CHOICES, "backend.emulate_gpu", f"null or one of {list(EMULATE_GPU_CHOICES)}", name)
        gpu, model = name.split("/")
        return cls(gpu, model)

    @property
    def name(self) -> str:
        return f"{self.gpu}/{self.model}"

    @property
    def device_name(self) -> str:
        """The name the emulated GPU's engine would report (vLLM's ``get_device_name()``, NVML's)."""
        from verl_partial.sim.hardware import GPUS

        return GPUS[self.gpu].device_names[0]

    def server_spec(self, max_num_seqs: int) -> ServerSpec:
        """The simulator's server for this GPU and model; its ``step_seconds`` is the engine's step time, its
        ``kv_capacity_tokens`` the engine's KV-cache capacity."""
        from verl_partial.sim.engine import ServerSpec
        from verl_partial.sim.hardware import GPUS, MODELS

        return ServerSpec(gpu=GPUS[self.gpu], model=MODELS[self.model], max_num_seqs=max_num_seqs)


@dataclass(frozen=True)
class BackendConfig:
    """Which CPU execution backend verl-partial set up (GPU users keep verl's own vLLM/SGLang set-up)."""

    name: str = "cpu"
    """``cpu``: our CPU engine as verl's rollout. ``cpu_vllm``: verl's own vLLM rollout on vLLM's CPU build.
    ``cpu_sglang``: ``rollout.name=sglang`` served by our CPU engine with SGLang 0.5.12's semantics (SGLang itself
    cannot run on this CPU), so verl's SGLang code paths and the SGLang server fix are exercised. Set by the group
    (``+backend=<name>``)."""

    emulate_gpu: EmulateGpu | None = None
    """A GPU-shaped engine: ``<GPU>/<model>`` in the simulator's names. Each step of our CPU engine runs its forward,
    then sleeps, cores idle, until it has lasted what that model takes on one such GPU (the simulator's roofline);
    the engine holds only that GPU's KV cache, preempting as vLLM does, and charges only the prefill vLLM's prefix
    cache leaves (``rollout.enable_prefix_caching``). The trainer, Ray, the scheduler, aborts and weight sync stay
    real. Overrunning steps are counted (``engine/overruns``). Figures from it are "emulated". Our engine only:
    refused with ``cpu_vllm``."""

    def __post_init__(self) -> None:
        if self.name not in BACKEND_NAMES:
            raise ValueError(f"backend.name must be one of {list(BACKEND_NAMES)}, got {self.name!r}")
        check_types(self, "backend")
        if self.emulate_gpu is not None and self.name not in EMULATING_BACKENDS:
            raise ValueError(
                f"backend.emulate_gpu is applied by verl-partial's CPU engine only (backend.name in "
                f"{list(EMULATING_BACKENDS)}); backend.name={self.name!r} runs another engine, which would ignore it"
            )

    @property
    def emulated_gpu(self) -> EmulatedGpu | None:
        return EmulatedGpu.parse(self.emulate_gpu)
