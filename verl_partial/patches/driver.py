"""Driver: the composed config is first seen by verl's main() in ``auto_set_device(config)``; validated there, and
the CPU platform and the Ray processes' environment set from it."""

from __future__ import annotations

import functools
import os
from typing import Any

from verl_partial.config.backend import BACKEND_NAMES, EMULATE_GPU_ENV
from verl_partial.patches.correction import ALL_REJECTED_GUARD_ENV
from verl_partial.patches.cpu import CPU_PLATFORM_ENV, CPU_ROLLOUT_NAME, _select_cpu_platform_in_driver

# Top-level config blocks that only exist when one of our Hydra groups was selected.
OUR_CONFIG_BLOCKS = ("backend", "partial", "rollout_correction", "balance")
# What every Ray process of the job gets as its environment (verl merges it into its own runtime env).
ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"


def _wrap_driver_entry() -> None:
    import verl.utils.device as device

    original = device.auto_set_device
    if getattr(original, "_verl_partial", False):
        return

    @functools.wraps(original)
    def auto_set_device(config):
        from verl_partial.config.job import check_resume_keeps_partial, validate_root_config

        if config is not None and not uses_our_config(config):
            # Even a run without our groups must not resume a +partial checkpoint and drop its parked groups.
            check_resume_keeps_partial(config, partial_enabled=False)
        if config is not None and uses_our_config(config):
            validate_root_config(config)
            if config.get("backend") is not None and config.backend.get("name") in BACKEND_NAMES:
                _select_cpu_platform_in_driver()
            if config.get("rollout_correction") is not None:
                _export_to_ray_processes(config, ALL_REJECTED_GUARD_ENV, "1")
        if config is not None and _ray_processes_platform(config) == CPU_ROLLOUT_NAME:
            # +backend=cpu_vllm_v1 (verl's v1 trainer) carries no backend block, only VERL_PLATFORM=cpu for its
            # Ray processes: the driver follows them, else verl's auto_set_device sets trainer.device=cuda.
            _select_cpu_platform_in_driver()
            _check_env_vars_are_strings(config)
            _export_cpu_threads(config)
            _export_emulated_gpu(config)
        return original(config)

    auto_set_device._verl_partial = True  # type: ignore[attr-defined]
    device.auto_set_device = auto_set_device


def _export_to_ray_processes(config: Any, name: str, value: str) -> None:
    """Every Ray process of the job (TaskRunner, workers) reads ``name`` when it imports verl."""
    from omegaconf import open_dict

    with open_dict(config):
        ray_init = config.ray_kwargs.setdefault("ray_init", {})
        runtime_env = ray_init.setdefault("runtime_env", {})
        env_vars = runtime_env.get("env_vars") or {}
        runtime_env["env_vars"] = {**env_vars, name: value}


def _check_env_vars_are_strings(config: Any) -> None:
    """Hydra reads ``...env_vars.OMP_NUM_THREADS=1`` as an int, which Ray refuses inside ``ray.init`` with a
    ``TypeError`` about ``runtime_env['env_vars']`` that names no config key; refused here, naming the key and the
    quoting that makes it a string. The threads setting is the one a CPU user is told to set (docs/engines.md)."""
    from omegaconf import OmegaConf

    env_vars = OmegaConf.select(config, ENV_VARS_KEY, default=None) or {}
    for name, value in env_vars.items():
        if not isinstance(value, str):
            raise ValueError(
                f"{ENV_VARS_KEY}.{name}={value!r}: Ray takes environment variables as strings only; quote the "
                f"value on the command line: {ENV_VARS_KEY}.{name}=\"'{value}'\""
            )


def cpu_threads() -> int:
    """The cores this process may run on (its affinity mask, as a container or ``taskset`` limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _export_cpu_threads(config: Any) -> None:
    """Every Ray process of a CPU back-end gets ``OMP_NUM_THREADS`` = the machine's cores, unless the run set it.

    Ray sets ``OMP_NUM_THREADS=1`` in a worker created without ``num_cpus`` when the variable is unset (its
    ``set_omp_num_threads_if_unset``), and verl creates its FSDP workers that way: without this, verl's trainer
    trains on one core of however many the machine has, and a benchmark whose Ray set-up hook imported torch first
    trains on all of them. Exported here, every mode and every benchmark gets the same threads. Our CPU engine
    sets its own (``VERL_PARTIAL_CPU_THREADS``, default 1, in ``cpu_backend/rollout.py``); vLLM's CPU engine
    inherits this value from its server actor.
    """
    from omegaconf import OmegaConf

    if OmegaConf.select(config, f"{ENV_VARS_KEY}.OMP_NUM_THREADS", default=None) is None:
        _export_to_ray_processes(config, "OMP_NUM_THREADS", str(cpu_threads()))


def _export_emulated_gpu(config: Any) -> None:
    """``backend.emulate_gpu`` reaches the rollout servers (launched by verl through Ray) as an env var.

    verl's v1 trainer carries no ``backend`` block (``+backend=cpu_v1``), so there the env var itself is the setting;
    it is checked as strictly as the typed key, since a server that ignores it would run unemulated in silence.
    """
    from omegaconf import OmegaConf

    from verl_partial.config.backend import EmulatedGpu
    from verl_partial.config.job import backend_config

    backend = backend_config(config) if config.get("backend") is not None else None
    if backend is not None and backend.emulate_gpu is not None:
        _export_to_ray_processes(config, EMULATE_GPU_ENV, backend.emulate_gpu)
        return
    key = f"{ENV_VARS_KEY}.{EMULATE_GPU_ENV}"
    direct = OmegaConf.select(config, key, default=None)
    if direct:
        EmulatedGpu.parse(str(direct))
        rollout = OmegaConf.select(config, "actor_rollout_ref.rollout.name", default=None)
        if rollout != CPU_ROLLOUT_NAME:
            raise ValueError(
                f"{key} is applied by verl-partial's CPU engine only (actor_rollout_ref.rollout.name=cpu), got "
                f"rollout.name={rollout!r}, whose engine would ignore it"
            )


def _ray_processes_platform(config: Any) -> str:
    """The VERL_PLATFORM the config gives every Ray process of the job ("" when it gives none)."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{CPU_PLATFORM_ENV}", default="")
    return str(value or "").strip().lower()


def uses_our_config(config: Any) -> bool:
    return any(_block_enabled(config, name) for name in OUR_CONFIG_BLOCKS)


def _block_enabled(config: Any, name: str) -> bool:
    try:
        block = config.get(name)
    except Exception:
        return False
    return block is not None
