"""verl's rollout-replica interface over the CPU engine: replica, Ray server actor, in-worker adapter.

verl talks to vLLM/SGLang through three objects: a ``RolloutReplica`` that launches server actors, the
server actor that answers token-in/token-out ``generate`` calls (plus abort/resume/sleep), and a
``BaseRollout`` adapter living in each FSDP worker that pushes new weights to its server. This module
implements the same three over :class:`~verl_partial.cpu_backend.engine.CpuBatchedEngine`, so verl's
own AgentLoopManager, load balancer and weight-sync path run unchanged.

Two server doubles, each copying a real server's control semantics so the scheduler is tested against what
production engines do: :class:`CpuRolloutServer` (``+backend=cpu``) is verl's ``vLLMHttpServer`` on vLLM 0.24;
:class:`FixedCpuSglangServer` (``+backend=cpu_sglang``, ``rollout.name=sglang``) is verl's ``SGLangHttpServer`` on
SGLang 0.5.12 with verl-partial's server fix, and :class:`CpuSglangServer` the same without the fix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections.abc import AsyncIterator, Generator, Mapping
from types import SimpleNamespace
from typing import Any

import ray
import torch
from omegaconf import DictConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import get_max_position_embeddings

from verl_partial.config.backend import EMULATE_GPU_ENV, ENGINE_STATS_DIR_ENV, EmulatedGpu
from verl_partial.cpu_backend.engine import CpuBatchedEngine, EngineRequest, GenerationResult, SamplingParams, Semantics
from verl_partial.glue.engines.sglang import apply_sglang_server_fix

logger = logging.getLogger("verl_partial.cpu_backend")

SERVER_NAME_PREFIX = "verl_partial_cpu_server_"
# Fault injection for resilience tests, e.g. "raise=0.1,hang=0.05,hang_s=30,seed=0": each generate
# call raises with probability `raise`, or stalls `hang_s` seconds with probability `hang`; `step_s` makes every
# engine step last at least that long (an answer of N tokens then outlasts N x step_s on any machine).
FAULTS_ENV = "VERL_PARTIAL_CPU_FAULTS"
# vllm_async_server.py's _GATE_BARRIER_TIMEOUT_S: how long abort_all_requests waits for admitted requests.
GATE_BARRIER_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    raise_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 30.0
    seed: int = 0
    step_s: float = 0.0

    @classmethod
    def from_env(cls, spec: str | None) -> FaultInjection:
        if not spec:
            return cls()
        names = {"raise": "raise_rate", "hang": "hang_rate", "hang_s": "hang_s", "step_s": "step_s", "seed": "seed"}
        values: dict[str, float] = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in names:
                raise ValueError(f"{FAULTS_ENV}: unknown key {key.strip()!r}; allowed: {sorted(names)}")
            values[names[key.strip()]] = float(value)
        if "seed" in values:
            values["seed"] = int(values["seed"])
        return cls(**values)


# Sampling keys the CPU engine honours; a key outside this set that would change what is sampled is
# an error rather than being silently ignored.
_NEUTRAL_SAMPLING_VALUES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    return f"{SERVER_NAME_PREFIX}{replica_rank}{name_suffix}"


def to_engine_params(sampling_params: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """Translate verl's sampling dict (as sent to vLLM) into engine parameters, refusing what we cannot do."""
    params = dict(sampling_params)
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", default_max_tokens))
    for key, neutral in _NEUTRAL_SAMPLING_VALUES.items():
        value = params.pop(key, neutral)
        if value != neutral:
            raise ValueError(f"the CPU rollout backend does not implement {key}={value}; use {neutral}")
    params.pop("logprobs", None)  # log-probs are always returned
    known = {"temperature", "top_p", "top_k", "ignore_eos", "seed"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"the CPU rollout backend does not support sampling params {unknown}; supported: {sorted(known)}"
        )
    return SamplingParams(max_tokens=int(max_tokens), **params)


class _CpuServerBase:
    """What both CPU server doubles share: the model, its EOS ids, weight loads and the no-op memory calls.

    ``max_model_len`` follows verl's servers: ``rollout.max_model_len`` when set (and not above the model's
    ``max_position_embeddings``), else ``max_position_embeddings`` (``vLLMHttpServer._validate_configs``,
    ``SGLangHttpServer.__init__``). A CPU engine holding a tiny model has no memory to release or profile.
    ``virtual_step_s`` is the engine's (tests on a virtual clock); Ray launches servers without it. A server
    started with ``VERL_PARTIAL_EMULATE_GPU`` (``backend.emulate_gpu``, exported by the driver) runs a GPU-shaped
    engine: each step lasts what the simulator's roofline gives that GPU and model for the step's batch, and the
    engine holds only the KV cache that GPU holds for that model (``ServerSpec.kv_capacity_tokens``), preempting as
    vLLM does when it runs out.
    """

    # Whose engine semantics the server reproduces (set by each server class).
    SEMANTICS: Semantics

    def __init__(
        self,
        config: RolloutConfig | DictConfig,
        model_config: HFModelConfig | DictConfig,
        replica_rank: int,
        virtual_step_s: float | None = None,
    ) -> None:
        semantics = self.SEMANTICS
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, int(os.environ.get("VERL_PARTIAL_CPU_THREADS", "1"))))
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
        self.max_model_len = resolve_max_model_len(self.config.max_model_len, model.config)
        self.emulate_gpu = EmulatedGpu.parse(os.environ.get(EMULATE_GPU_ENV))
        gpu_server = None if self.emulate_gpu is None else self.emulate_gpu.server_spec(self.config.max_num_seqs)
        self.engine = CpuBatchedEngine(
            model,
            eos_token_ids=self._eos_token_ids(model),
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            logprobs_mode=self.config.logprobs_mode,
            semantics=semantics,
            virtual_step_s=virtual_step_s,
            step_time=None if gpu_server is None else gpu_server.step_seconds,
            kv_capacity_tokens=None if gpu_server is None else gpu_server.kv_capacity_tokens,
            # Only a modelled step can show what a GPU server's prefix cache saves; our forward computes every token.
            prefix_caching=gpu_server is not None and self.config.enable_prefix_caching,
            stats_file=stats_file(self.replica_rank),
        )

    def _eos_token_ids(self, model) -> set[int]:
        ids: set[int] = set()
        for source in (model.generation_config.eos_token_id, self.model_config.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, list) else [source])
        if not ids:
            raise ValueError(f"model at {self.model_config.local_path} defines no eos_token_id")
        return ids

    def _default_max_tokens(self, prompt_len: int) -> int:
        """verl's default when the caller sends no max tokens (both servers' ``generate``)."""
        return min(self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len)

    def get_server_address(self) -> str:
        # verl keys its load balancer by address; there is no HTTP endpoint behind it.
        return f"cpu://replica-{self.replica_rank}"

    async def load_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: int | None) -> None:
        self.engine.load_weights(named_tensors.items())
        self.global_steps = global_steps
        self.engine.mark("weights", global_steps)

    async def sleep(self) -> None:
        """The trainer's rollout is over (``sleep_replicas``): stamped for the benchmark; a CPU engine frees nothing."""
        self.engine.mark("sleep", self.global_steps)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        **_unused: Any,
    ) -> TokenOutput:
        """The server actor's ``generate``, as verl's servers take it; each engine's semantics are its ``_generate``."""
        if image_data or video_data:
            raise ValueError("the CPU rollout backend is text-only")
        return await self._generate([int(token) for token in prompt_ids], sampling_params, request_id)

    async def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> TokenOutput:
        raise NotImplementedError

    async def gpu_name(self) -> str | None:
        """What verl-partial adds to the engines' servers (``partial.max_calls_per_server=auto``): the GPU the engine
        runs on, as vLLM and NVML name it; here the emulated GPU's (``backend.emulate_gpu``), whose steps the engine
        models, or None: the plain CPU engine runs on no GPU."""
        return None if self.emulate_gpu is None else self.emulate_gpu.device_name

    def engine_stats(self) -> dict[str, Any]:
        """The engine's cumulative counters (``EngineStats``) with ``max_num_seqs``, the ``emulate_gpu`` setting
        (``"<GPU>/<model>"`` or None), the KV-cache capacity it implies (tokens, or None: unlimited) and whether its
        steps are charged as behind a prefix cache: what
        :func:`~verl_partial.cpu_backend.occupancy.slot_occupancy` reads.
        One cheap Ray call in any trainer mode (the counters are always kept)."""
        return {
            **dataclasses.asdict(self.engine.stats),
            "max_num_seqs": self.engine.max_num_seqs,
            "emulate_gpu": None if self.emulate_gpu is None else self.emulate_gpu.name,
            "kv_capacity_tokens": self.engine.kv_capacity_tokens,
            "prefix_caching": self.engine.prefix_caching,
        }


def stats_file(replica_rank: int) -> str | None:
    """Where this replica's engine keeps its counters for a benchmark (``VERL_PARTIAL_ENGINE_STATS_DIR``), or None."""
    folder = os.environ.get(ENGINE_STATS_DIR_ENV)
    return None if not folder else os.path.join(folder, f"engine-{replica_rank}.json")


def resolve_max_model_len(configured: int | None, hf_config: Any) -> int:
    """``rollout.max_model_len``, or the model's ``max_position_embeddings`` when null (verl's servers)."""
    limit = get_max_position_embeddings(hf_config)
    if configured is None:
        return limit
    if configured > limit:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_model_len ({configured}) should be less than or equal to "
            f"max_position_embeddings ({limit})"
        )
    return configured


class CpuRolloutServer(_CpuServerBase):
    """Ray actor holding one CPU engine with vLLM semantics; the counterpart of verl's ``vLLMHttpServer``.

    Every control path copies ``verl/workers/rollout/vllm_rollout/vllm_async_server.py`` (verl 0.9.1) over
    vLLM 0.24's ``AsyncLLM``: the submission gate, the ``_admitting`` barrier, the per-request abort and the
    ``max_tokens`` clamp. Requests beyond ``max_num_seqs`` queue in the engine and produce nothing until they run.
    """

    SEMANTICS = "vllm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = FaultInjection.from_env(os.environ.get(FAULTS_ENV))
        self.fault_rng = random.Random(self.faults.seed * 1000 + self.replica_rank)
        self.engine.min_step_s = self.faults.step_s
        # vLLMHttpServer.__init__: the submission gate, closed by abort_all_requests and opened by
        # resume_generation; a request arriving while it is closed parks (or, when rejecting, is refused).
        self._submission_paused = False
        self._rejecting = False
        self._resume_event: asyncio.Event | None = None
        # Admitted past the gate but without a first output yet (vLLMHttpServer._admitting).
        self._admitting = 0

    async def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> TokenOutput:
        """``vLLMHttpServer.generate``: clamp ``max_tokens`` to ``[1, max_model_len - prompt]`` (a truncated answer
        ends "length", reported "completed"), wait at the gate, then run in the engine; ``_admitting`` falls at the
        request's first output. A cancelled call aborts its request (vLLM's ``AsyncLLM.generate`` does so on
        ``CancelledError``) and returns nothing."""
        draw = self.fault_rng.random()
        if draw < self.faults.raise_rate:
            raise RuntimeError(f"injected fault ({FAULTS_ENV})")
        if draw < self.faults.raise_rate + self.faults.hang_rate:
            await asyncio.sleep(self.faults.hang_s)
        max_possible_tokens = self.max_model_len - len(prompt_ids)
        if max_possible_tokens < 1:
            raise ValueError(
                f"Prompt length ({len(prompt_ids)}) leaves no room to generate within the model's maximum context "
                f"length ({self.max_model_len}); need at least 1 token of headroom."
            )
        sampling_params = dict(sampling_params)
        max_tokens = sampling_params.pop(
            "max_tokens", sampling_params.pop("max_new_tokens", self._default_max_tokens(len(prompt_ids)))
        )
        # vllm_async_server.py: ``sampling_params.setdefault("ignore_eos", self.config.get("ignore_eos", False))``.
        sampling_params.setdefault("ignore_eos", self.config.ignore_eos)
        params = to_engine_params(sampling_params, default_max_tokens=max(1, min(max_tokens, max_possible_tokens)))
        rejected = await self._park_until_admitted(request_id)
        if rejected is not None:
            return rejected
        # No await between admission and the engine registering the request: an abort that closes the gate
        # after this line finds the request in the engine.
        try:
            request = self.engine.submit(request_id, prompt_ids, params)
        except BaseException:
            self._admitting -= 1
            raise
        try:
            try:
                await request.first_output.wait()
            finally:
                self._admitting -= 1
            result = await request.future
        except asyncio.CancelledError:
            await self.engine.abort(request_id)
            raise
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            # vLLMHttpServer.generate: finish_reason "stop" and "length" both map to "completed".
            stop_reason="aborted" if result.stop_reason == "aborted" else "completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _gate(self) -> asyncio.Event:
        if self._resume_event is None:
            self._resume_event = asyncio.Event()
            self._resume_event.set()
        return self._resume_event

    async def _park_until_admitted(self, request_id: str) -> TokenOutput | None:
        """``vLLMHttpServer._park_until_admitted``: wait out a closed gate, or refuse the request when the gate
        rejects late arrivals (no tokens, ``stop_reason="aborted"``, ``log_probs=None``); count the admitted one
        in ``_admitting``. A parked request is not in the engine, so ``abort_request`` does not find it."""
        while self._submission_paused:
            if self._rejecting:
                logger.debug("rejecting request %s behind a closed gate", request_id)
                return TokenOutput(
                    token_ids=[],
                    log_probs=None,
                    stop_reason="aborted",
                    extra_fields={"global_steps": self.global_steps},
                )
            await self._gate().wait()
        self._admitting += 1
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """``vLLMHttpServer.abort_all_requests``: close the gate (declaring whether late arrivals park or are
        refused), then wait up to ``GATE_BARRIER_TIMEOUT_S`` while admitted requests have no first output yet --
        a request queued behind ``max_num_seqs`` holds this barrier while the engine keeps generating -- then
        pause the engine and abort every request in it (running: all tokens so far; queued: none; "aborted"), and
        with ``reset_prefix_cache`` forget the cached prefixes (``pause_generation(clear_cache=...)``).
        The engine stays paused until :meth:`resume_generation`."""
        self._submission_paused, self._rejecting = True, reject_request
        self._gate().clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GATE_BARRIER_TIMEOUT_S
        while self._admitting > 0:
            if loop.time() > deadline:
                logger.warning("submission gate barrier timed out with %d admission(s) in flight", self._admitting)
                break
            await asyncio.sleep(0.01)
        request_ids = self.engine.request_ids
        self.engine.pause()
        await self.engine.abort_all()
        if reset_prefix_cache:
            self.engine.reset_prefix_cache()
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        """verl 0.9.1's ``vLLMHttpServer.abort_request`` on vLLM 0.24: it looks ``request_id`` up in
        ``output_processor.request_states``, which vLLM keys by internal ids (the caller's id plus a random suffix,
        ``InputProcessor.assign_request_id``), so it never finds a request. Copied as it behaves, so nothing can
        come to rely on a per-request abort that real servers do not have; use :meth:`take_back_requests`."""
        return {"aborted": False, "error": f"Request {request_id} not found"}

    async def take_back_requests(self, request_ids: list[str]) -> list[str]:
        """What verl-partial adds to verl's vLLM server (``glue.engines.vllm._add_vllm_take_back``): ``AsyncLLM.abort``
        by the caller's ids. Each request the engine holds ends "aborted" through its ``generate`` call (running:
        every token so far; queued: none); any other id (parked at the gate, in transit, done) is untouched.
        Returns the ids the engine held."""
        return [request_id for request_id in request_ids if await self.engine.abort(request_id)]

    async def progress_of_requests(self) -> dict[str, int]:
        """What verl-partial adds to verl's vLLM server (``verl_patches._add_vllm_take_back``): tokens so far of
        each request the engine holds (queued: 0), for the scheduler's stall check."""
        return {request_id: self.engine.tokens_so_far(request_id) for request_id in self.engine.request_ids}

    async def kv_cache_tokens(self) -> int | None:
        """What verl-partial adds to verl's vLLM server: the tokens of KV cache the engine holds, its emulated GPU's
        (``backend.emulate_gpu``), or None: the plain CPU engine holds as much context as it is given."""
        return self.engine.kv_capacity_tokens

    async def resume_generation(self) -> None:
        """``vLLMHttpServer.resume_generation``: resume the engine, then open the gate."""
        self.engine.resume()
        self._submission_paused, self._rejecting = False, False
        self._gate().set()

    async def wait_for_requests_to_drain(self) -> None:
        await self.engine.wait_until(lambda: self.engine.is_idle)


# --------------------------------------------------------------------------------------------------------------
# SGLang mode (``+backend=cpu_sglang``): SGLang 0.5.12's TokenizerManager and verl 0.9.1's SGLangHttpServer over
# our engine with SGLang semantics. SGLang cannot run here (CUDA-only kernels; its CPU path needs Intel AMX), so
# this double copies the behaviour the scheduler has to survive, line by line, from the cited sources.
# --------------------------------------------------------------------------------------------------------------

# The ``to_json()["type"]`` of SGLang's finish types FINISH_MATCHED_TOKEN (schedule_batch.py@0.5.12:140
# "class FINISH_MATCHED_TOKEN(BaseFinishReason):"), FINISH_LENGTH (schedule_batch.py@0.5.12:176
# "class FINISH_LENGTH(BaseFinishReason):") and FINISH_ABORT (schedule_batch.py@0.5.12:188
# "class FINISH_ABORT(BaseFinishReason):").
_SGLANG_FINISH_TYPE: dict[str, str] = {"completed": "stop", "length": "length", "aborted": "abort"}
# TokenizerManager.pause_generation(mode="abort") re-sends the abort every second until no request holds the
# model-update reader lock (tokenizer_manager.py@0.5.12:1513 "await asyncio.sleep(1.0)").
SGLANG_PAUSE_POLL_S = 1.0
# SamplingParams(max_new_tokens=128) when a request names none (sglang/srt/sampling/sampling_params.py@0.5.12:42
# "max_new_tokens: int = 128,").
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


class SglangServerDied(RuntimeError):
    """The double's TokenizerManager hit an exception in its output handling: SGLang's ``handle_loop`` runs under
    ``print_exception_wrapper``, which kills the server's process tree (tokenizer_manager.py@0.5.12:2755
    "kill_process_tree(os.getpid(), include_parent=True)"). Every later call on the double raises this."""


@dataclasses.dataclass
class SglangTimeStats:
    """``APIServerReqTimeStats``' stamp of the send to the scheduler (tokenizer_manager.py@0.5.12:1187
    "tokenized_obj.time_stats.set_api_server_dispatch_time()")."""

    api_server_dispatch_time: float = 0.0


@dataclasses.dataclass(eq=False)
class SglangReqState:
    """``ReqState`` (tokenizer_manager.py@0.5.12:135-140 "out_list: List[Dict[Any, Any]]"): the outputs for the
    caller, ``finished``, the event the caller waits on, the request; ``handle`` is the double's engine request."""

    out_list: list[dict[str, Any]]
    finished: bool
    event: asyncio.Event
    obj: Mapping[str, Any]
    time_stats: SglangTimeStats
    handle: EngineRequest | None = None


@dataclasses.dataclass
class SglangTokenizerStats:
    """What the double's TokenizerManager holds: ``rid_to_state`` entries; of them, those nothing in SGLang will
    ever delete (answered but left, or abandoned before the send); whether it died (:class:`SglangServerDied`)."""

    request_states: int
    leaked_request_states: int
    in_flight: int
    paused: bool
    died: bool


class SglangTokenizerManager:
    """SGLang 0.5.12 ``TokenizerManager`` (tokenizer_manager.py@0.5.12:216 "class TokenizerManager") as verl's
    ``SGLangHttpServer`` uses it, with the engine (SGLang semantics) standing in for the scheduler process. The
    methods take SGLang's call shapes (a request's fields as a mapping, ``obj.mode`` of the pause, ``(obj, request)``
    of the memory calls), so verl's own ``SGLangHttpServer`` methods can run over it unchanged. The conformance tier
    (``tests/unit/test_sglang_conformance.py``) runs the 0.5.12 wheel's own functions beside it.

    * ``generate_request`` registers the request state *before* the pause gate (tokenizer_manager.py@0.5.12:538
      "self._init_req_state(obj, request)"), parks at ``is_pause_cond`` while paused (tokenizer_manager.py@0.5.12:548
      "await self.is_pause_cond.wait_for(lambda: not self.is_pause)"), then holds the model-update reader lock while
      the scheduler runs it. It has no ``CancelledError`` handler: a cancelled caller leaves the request decoding,
      and a caller cancelled while parked leaves its state forever.
    * ``abort_request(rid)`` returns unless ``rid`` is in ``rid_to_state`` (tokenizer_manager.py@0.5.12:1490
      "if not abort_all and rid not in self.rid_to_state:"); the scheduler then ends every request whose id *starts
      with* ``rid``: a queued one is popped and the abort is echoed to the tokenizer (scheduler.py@0.5.12:3574
      "self.send_to_tokenizer.send_output(AbortReq(rid=req.rid), req)"), a running one decodes one more token
      (scheduler.py@0.5.12:3655 "req.to_finish = FINISH_ABORT()"). A request between two chunks of a chunked
      prefill is in neither batch the scheduler searches (scheduler.py@0.5.12:3642-3645
      "reqs = self.running_batch.reqs"): the abort misses it. The double has no chunked prefill; ``between_chunks``
      names the requests an abort is to miss that way.
    * The echo's handler indexes the table without a guard (tokenizer_manager.py@0.5.12:2420
      "state = self.rid_to_state[recv_obj.rid]"): for a state deleted meanwhile the KeyError kills the server
      (:class:`SglangServerDied`). It marks the state finished (tokenizer_manager.py@0.5.12:2421
      "state.finished = True") and never deletes it. A scheduler output finishing a request deletes its state
      (tokenizer_manager.py@0.5.12:1871 "del self.rid_to_state[rid]"), and one for a deleted state is skipped
      (tokenizer_manager.py@0.5.12:1671 "state = self.rid_to_state.get(rid, None)").
    * ``pause_generation(mode="abort")`` sets ``is_pause`` (late arrivals park; there is no reject) and re-sends
      abort-all every ``SGLANG_PAUSE_POLL_S`` until no request holds the reader lock (tokenizer_manager.py@0.5.12:1509
      "self.abort_request(abort_all=True)"). ``continue_generation`` reopens the gate.
    * ``release_memory_occupation`` asserts the scheduler is fully idle
      (scheduler_update_weights_mixin.py@0.5.12:130-132 "self.is_fully_idle()").
    """

    def __init__(self, engine: CpuBatchedEngine) -> None:
        self.engine = engine
        self.rid_to_state: dict[str, SglangReqState] = {}
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.between_chunks: set[str] = set()
        self.died: BaseException | None = None
        self._in_flight = 0  # holders of model_update_lock.reader_lock
        self._abandoned: set[str] = set()  # cancelled before the send: no output will ever delete their state
        self._awaited: set[SglangReqState] = set()  # states whose caller waits for an output (woken if it dies)

    def _alive(self) -> None:
        if self.died is not None:
            raise SglangServerDied(f"SGLang's TokenizerManager died: {self.died!r}") from self.died

    async def generate_request(self, obj: Mapping[str, Any], request: Any = None) -> AsyncIterator[dict[str, Any]]:
        """``TokenizerManager.generate_request`` + ``_wait_one_response`` for one non-streaming text request
        (``obj``: ``GenerateReqInput``'s fields)."""
        self._alive()
        if obj.get("image_data") or obj.get("video_data"):
            raise ValueError("the CPU rollout backend is text-only")
        rid = obj["rid"]
        params = to_engine_params(dict(obj["sampling_params"]), default_max_tokens=SGLANG_DEFAULT_MAX_NEW_TOKENS)
        if rid in self.rid_to_state:  # tokenizer_manager.py@0.5.12:2594-2595 "if rid in self.rid_to_state:"
            raise ValueError(f"Duplicate request ID detected: {rid}")
        state = SglangReqState([], False, asyncio.Event(), obj, SglangTimeStats())
        self.rid_to_state[rid] = state
        try:
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        except asyncio.CancelledError:
            self._abandoned.add(rid)
            raise
        self._in_flight += 1
        try:
            self._alive()
            state.handle = self.engine.submit(rid, [int(token) for token in obj["input_ids"]], params)
            state.time_stats.api_server_dispatch_time = asyncio.get_running_loop().time() or 1e-9
            handle = state.handle
            handle.future.add_done_callback(lambda _: self._scheduler_output(rid, handle))
            self._awaited.add(state)
            while not state.out_list:  # _wait_one_response
                await state.event.wait()
                state.event.clear()
                self._alive()
            out = state.out_list[-1]
        finally:
            self._awaited.discard(state)
            self._in_flight -= 1
        yield out

    def _scheduler_output(self, rid: str, handle: EngineRequest) -> None:
        """What reaches the tokenizer's ``handle_loop`` when the scheduler ends a request: the echo of an abort
        while queued (never ran: no ``to_finish``), else the request's final output."""
        if self.died is not None:
            return
        result = handle.future.result()
        try:
            if result.stop_reason == "aborted" and not handle.to_finish:
                self._handle_abort_req(rid)
            else:
                self._handle_batch_output(rid, result)
        except Exception as error:  # noqa: BLE001 - print_exception_wrapper catches any Exception
            logger.error("SGLang double: TokenizerManager hit an exception: %r; the server dies", error)
            self.died = error
            for state in self._awaited:
                state.event.set()

    def _handle_abort_req(self, rid: str) -> None:
        """tokenizer_manager.py@0.5.12:2417-2421 "def _handle_abort_req(self, recv_obj: AbortReq):": no guard, no
        delete; the caller gets no tokens and "abort" ("Abort in waiting queue")."""
        state = self.rid_to_state[rid]
        state.finished = True
        meta_info: dict[str, Any] = {"id": rid, "finish_reason": {"type": "abort"}}
        if state.obj.get("return_logprob", False):
            meta_info["output_token_logprobs"] = []
        state.out_list.append({"output_ids": [], "meta_info": meta_info})
        state.event.set()

    def _handle_batch_output(self, rid: str, result: GenerationResult) -> None:
        """tokenizer_manager.py@0.5.12:1660 "async def _handle_batch_output(" for a finished request."""
        state = self.rid_to_state.get(rid, None)
        if state is None:
            logger.error("Received output for rid=%r but the state was deleted in TokenizerManager.", rid)
            return
        state.finished = True
        del self.rid_to_state[rid]
        meta_info: dict[str, Any] = {"id": rid, "finish_reason": {"type": _SGLANG_FINISH_TYPE[result.stop_reason]}}
        if state.obj.get("return_logprob", False):
            entries = [
                (log_prob, token, None) for log_prob, token in zip(result.log_probs, result.token_ids, strict=True)
            ]
            if state.handle is not None and state.handle.params.max_tokens == 0:
                # verl's SGLangHttpServer.generate: "max_new_tokens=0 produces a phantom logprob entry with empty
                # output_ids" (the prefill's token, cut by finished_len = 0).
                entries = [(0.0, 0, None)]
            meta_info["output_token_logprobs"] = entries
        state.out_list.append({"output_ids": list(result.token_ids), "meta_info": meta_info})
        state.event.set()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``TokenizerManager.abort_request`` then ``Scheduler.abort_request``: ids matched by prefix
        (scheduler.py@0.5.12:3562 "if recv_req.abort_all or req.rid.startswith(recv_req.rid):")."""
        self._alive()
        if not abort_all and rid not in self.rid_to_state:
            return
        for request_id in self.engine.request_ids:
            if (abort_all or request_id.startswith(rid)) and request_id not in self.between_chunks:
                self.engine.abort_nowait(request_id)

    async def pause_generation(self, obj: Any) -> None:
        """``TokenizerManager.pause_generation`` with ``obj.mode == "abort"``, the only mode verl uses."""
        if obj.mode != "abort":
            raise NotImplementedError(f"the SGLang double implements pause mode 'abort' only, got {obj.mode!r}")
        async with self.is_pause_cond:
            self.is_pause = True
            while True:
                self.abort_request(abort_all=True)
                if self._in_flight == 0:
                    break
                await asyncio.sleep(SGLANG_PAUSE_POLL_S)

    async def continue_generation(self, obj: Any) -> None:
        """``TokenizerManager.continue_generation``."""
        async with self.is_pause_cond:
            self.is_pause = False
            self.is_pause_cond.notify_all()

    async def get_internal_state(self) -> list[dict[str, Any]]:
        """The one field of ``get_internal_state`` verl-partial reads, for the double's one data-parallel rank: the
        KV-cache capacity in tokens (scheduler.py@0.5.12:3477 "int(self.max_total_num_tokens)"); None where the
        engine holds as much context as it is given, which a real SGLang never does."""
        return [{"memory_usage": {"token_capacity": self.engine.kv_capacity_tokens}}]

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        """``Scheduler.release_memory_occupation``: ``assert self.is_fully_idle()``."""
        self._alive()
        assert self.engine.is_idle, "release_memory_occupation should be called only when server is idle."

    def stats(self) -> SglangTokenizerStats:
        leaked = sum(state.finished or rid in self._abandoned for rid, state in self.rid_to_state.items())
        died = self.died is not None
        return SglangTokenizerStats(len(self.rid_to_state), leaked, self._in_flight, self.is_pause, died)


class CpuSglangServer(_CpuServerBase):
    """The counterpart of verl 0.9.1's ``SGLangHttpServer`` (``sglang_rollout/async_sglang_server.py``) over
    :class:`SglangTokenizerManager`, exactly as verl ships it: ``abort_all_requests()`` takes no
    ``reject_request``, there is no per-request abort, and a cancelled ``generate`` sends no abort.
    :func:`~verl_partial.glue.engines.sglang.apply_sglang_server_fix` adds those, to this class as to verl's."""

    SEMANTICS = "sglang"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node_rank = 0
        self.tokenizer_manager = SglangTokenizerManager(self.engine)

    async def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str) -> TokenOutput:
        """``SGLangHttpServer.generate``: ``max_new_tokens`` clamped to ``[0, max_model_len - prompt - 1]``, the
        finish type ("stop"/"length"/"abort") passed through as ``stop_reason``, log-probs dropped (``[]``) when
        SGLang's logprob list does not match its ``output_ids``."""
        max_possible_tokens = self.max_model_len - len(prompt_ids) - 1
        if max_possible_tokens < 0:
            raise ValueError(
                f"Prompt length ({len(prompt_ids)}) exceeds the model's maximum context length ({self.max_model_len})."
            )
        sampling_params = dict(sampling_params)
        max_new_tokens = sampling_params.pop(
            "max_new_tokens", sampling_params.pop("max_tokens", self._default_max_tokens(len(prompt_ids)))
        )
        sampling_params["max_new_tokens"] = max(0, min(max_new_tokens, max_possible_tokens))
        return_logprob = sampling_params.pop("logprobs", False)
        obj = {
            "rid": request_id,
            "input_ids": prompt_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        output = await self.tokenizer_manager.generate_request(obj, None).__anext__()
        meta_info = output["meta_info"]
        token_ids = list(output["output_ids"])
        log_probs: list[float] | None = None
        if return_logprob:
            entries = meta_info.get("output_token_logprobs") or []
            if entries and len(entries) == len(token_ids):
                log_probs = [float(log_prob) for log_prob, _, _ in entries]
            else:
                token_ids, log_probs = [], []
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason=meta_info["finish_reason"]["type"],
            extra_fields={"global_steps": self.global_steps},
        )

    async def abort_all_requests(self) -> None:
        """``SGLangHttpServer.abort_all_requests``: ``pause_generation(mode="abort")``."""
        await self.tokenizer_manager.pause_generation(SimpleNamespace(mode="abort"))

    async def resume_generation(self) -> None:
        """``SGLangHttpServer.resume_generation``: ``continue_generation``."""
        await self.tokenizer_manager.continue_generation(SimpleNamespace())

    async def sleep(self) -> None:
        """``SGLangHttpServer.sleep`` (hybrid): ``release_memory_occupation``, which asserts an idle scheduler."""
        await super().sleep()
        if self.config.free_cache_engine:
            await self.tokenizer_manager.release_memory_occupation(SimpleNamespace(tags=["kv_cache", "weights"]), None)

    def tokenizer_stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.tokenizer_manager.stats())


class FixedCpuSglangServer(CpuSglangServer):
    """:class:`CpuSglangServer` with verl-partial's SGLang server fix, applied as it is to verl's class."""


apply_sglang_server_fix(FixedCpuSglangServer)
# The one method of the fix the double answers itself: the fix asks NVML for the GPU, and the double's GPU is the one
# its engine emulates (none on this machine's NVML).
FixedCpuSglangServer.gpu_name = _CpuServerBase.gpu_name  # type: ignore[method-assign]


class CpuReplica(RolloutReplica):
    """One CPU server per replica, placed next to the replica's FSDP workers (hybrid mode only)."""

    server_cls: type[_CpuServerBase] = CpuRolloutServer

    async def launch_servers(self) -> None:
        server_cls = ray.remote(self.server_cls)
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = server_cls.options(name=name, max_concurrency=self.max_concurrency, num_cpus=0).remote(
            config=self.config, model_config=self.model_config, replica_rank=self.replica_rank
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()

    def rollout_worker_use_gpu(self) -> bool:
        return False


class CpuSglangReplica(CpuReplica):
    """``+backend=cpu_sglang``: verl's ``SGLangReplica`` control calls over the fixed SGLang double.

    Like ``SGLangReplica``, control goes to ``servers[0]`` only and ``abort_all_requests`` ignores
    ``reject_request`` (with verl's warning); a caller wanting the rejecting gate calls the server's
    ``abort_all_requests(reject_request=True)``, which the fix adds.
    """

    server_cls = FixedCpuSglangServer

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        if reject_request:
            logger.warning(
                "SGLang rollout ignores reject_request=True: requests arriving while generation "
                "is paused will wait for the next resume_generation() instead of failing over."
            )
        await self.servers[0].abort_all_requests.remote()

    async def resume_generation(self) -> None:
        await self.servers[0].resume_generation.remote()


class CpuServerAdapter(BaseRollout):
    """Lives in each FSDP worker; the replica's first rank ships full weights to its server after each step."""

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        device_mesh: Any,
        replica_rank: int = -1,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ["RANK"])
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.owns_server = rank % world == 0
        self._server: ray.actor.ActorHandle | None = None

    def _server_handle(self) -> ray.actor.ActorHandle:
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"the CPU rollout backend accepts wire_format='named_tensors' only, got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("the CPU rollout backend does not support LoRA adapters (peft_config); merge them")
        # Every rank must drain the generator: it gathers FSDP shards collectively.
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self.owns_server:
            await self._server_handle().load_weights.remote(state, kwargs.get("global_steps"))
