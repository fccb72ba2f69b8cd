"""Every touch of verl internals starts here: :func:`install`, called once per process by the plugin.

verl has no hooks for a new device, for replacing ``_balance_batch`` or for seeing the trainer's
config before workers start, so we wrap a handful of its functions. Each wrapper checks the
composed config (or the process's platform) and otherwise calls verl's original untouched: with no
override of ours, verl behaves exactly as without the package. The version guard
(:mod:`verl_partial.patches.guard`) refuses any verl outside the range these wrappers were written and tested
against. One module per concern: ``cpu`` (CPU backends), ``driver`` (the composed config), ``trainer``
(``RayPPOTrainer``), ``correction`` (policy-loss guard), ``imports`` (patching on import); the engines' own fixes
are :mod:`verl_partial.glue.engines.vllm` and :mod:`verl_partial.glue.engines.sglang`.
"""

from __future__ import annotations

import functools
import os

from verl_partial.glue.engines.vllm import VLLM_CPU_ENV, VLLM_SERVER_MODULE, _add_vllm_take_back, apply_vllm_cpu_fixes
from verl_partial.patches.correction import ALL_REJECTED_GUARD_ENV, install_all_rejected_guard
from verl_partial.patches.cpu import (
    CPU_PLATFORM_ENV,
    CPU_ROLLOUT_NAME,
    CPU_SGLANG_ENV,
    _register_cpu_backend,
    _register_cpu_sglang_backend,
    apply_cpu_process_fixes,
)
from verl_partial.patches.driver import OUR_CONFIG_BLOCKS, _block_enabled, _wrap_driver_entry, uses_our_config
from verl_partial.patches.guard import check_verl_version
from verl_partial.patches.imports import after_import
from verl_partial.patches.trainer import _wrap_trainer


def install() -> None:
    """Register the CPU backend and wrap verl's functions; called once per process by the plugin."""
    import verl

    check_verl_version(verl.__version__)
    _register_cpu_backend()
    if os.environ.get(CPU_PLATFORM_ENV, "").strip().lower() == CPU_ROLLOUT_NAME:
        apply_cpu_process_fixes()
    if os.environ.get(VLLM_CPU_ENV) == "1":
        apply_vllm_cpu_fixes()
    if os.environ.get(ALL_REJECTED_GUARD_ENV) == "1":
        install_all_rejected_guard()
    _wrap_driver_entry()
    _wrap_trainer()
    after_import(VLLM_SERVER_MODULE, _add_vllm_take_back)
    install_sglang_support()


def install_failure_guard(error: BaseException) -> None:
    """After a failed install: any config that asks for our features fails with the install error.

    Without this, verl (which loads plugins silently) would ignore our blocks and train as if they
    were not there.
    """
    import verl.utils.device as device

    original = device.auto_set_device

    @functools.wraps(original)
    def auto_set_device(config):
        if config is not None and uses_our_config(config):
            blocks = [name for name in OUR_CONFIG_BLOCKS if _block_enabled(config, name)]
            raise RuntimeError(
                f"the config asks for verl-partial ({', '.join(blocks)}) but verl-partial failed to register "
                f"with verl: {error!r}"
            ) from error
        return original(config)

    device.auto_set_device = auto_set_device


def install_sglang_support() -> None:
    """verl-partial's fix of verl's ``SGLangHttpServer`` wherever that module is imported (inert for callers that
    use neither ``reject_request`` nor ``take_back_requests``; a cancelled call now stops its request), and, in
    processes of a ``+backend=cpu_sglang`` run only, "sglang" served by the CPU SGLang double."""
    # Imported here: the fix's module imports verl, which loads this package's plugin (and so this module).
    from verl_partial.glue.engines.sglang import SGLANG_SERVER_MODULE, _fix_sglang_server

    after_import(SGLANG_SERVER_MODULE, _fix_sglang_server)
    if os.environ.get(CPU_SGLANG_ENV) == "1":
        _register_cpu_sglang_backend()
