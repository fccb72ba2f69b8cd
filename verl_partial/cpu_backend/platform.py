"""A CPU platform for verl's platform layer.

verl 0.9 resolves the device through ``verl.plugin.platform`` and only knows NVIDIA, Ascend and
ROCm; with none present it falls back to "nvidia" and dies in NCCL. This platform makes every verl
process that selects it (``VERL_PLATFORM=cpu``, set by ``+backend=cpu``) use ``torch.device("cpu")``
and gloo. It is never auto-detected: on a GPU machine verl's own detection stays in charge.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase

PLATFORM_NAME = "cpu"


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _mem_get_info(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def _build_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the allocator/RNG calls verl makes on ``torch.cuda``.

    verl calls ``get_torch_device().empty_cache()``, ``.mem_get_info()``, ``.get_rng_state()`` and
    friends unconditionally; on CPU those are meaningless, so they are no-ops or report host memory.
    """
    module = types.ModuleType("verl_partial_cpu_device")
    for name in ("synchronize", "is_available", "current_stream", "stream", "Stream", "Event", "device_count"):
        setattr(module, name, getattr(torch.cpu, name))
    module.set_device = _noop
    module.current_device = lambda *_a, **_k: "cpu"
    module.empty_cache = _noop
    module.ipc_collect = _noop
    module.set_per_process_memory_fraction = _noop
    module.reset_peak_memory_stats = _noop
    module.memory_allocated = _zero
    module.memory_reserved = _zero
    module.max_memory_allocated = _zero
    module.max_memory_reserved = _zero
    module.mem_get_info = _mem_get_info
    module.get_device_name = lambda *_a, **_k: "cpu"
    module.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    module.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    return module


class PlatformCPU(PlatformBase):
    """verl platform backed by the host CPU, gloo for collectives, Ray logical "GPU" slots for placement.

    Ray placement stays verl's own (one "GPU" bundle per worker): the CPU backend declares logical
    GPUs to Ray, so verl's resource-pool checks and placement groups work unchanged.
    """

    _device_module = _build_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only an explicit VERL_PLATFORM=cpu selects it, so installing the
        # package cannot change which platform verl picks on any machine.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        # verl moves tensors with ``.to(get_device_id())``; an int means "accelerator index" to torch,
        # so the CPU answer must be the device string itself.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
