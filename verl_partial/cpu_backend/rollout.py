"""verl's rollout-replica interface over the CPU engine: replica, Ray server actor, in-worker adapter.

verl talks to vLLM/SGLang through three objects: a ``RolloutReplica`` that launches server actors, the
server actor that answers token-in/token-out ``generate`` calls (plus abort/resume/sleep), and a
``BaseRollout`` adapter living in each FSDP worker that pushes new weights to its server. This module
implements the same three over :class:`~verl_partial.cpu_backend.engine.CpuBatchedEngine`, so verl's
own AgentLoopManager, load balancer and weight-sync path run unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections.abc import Generator
from typing import Any

import ray
import torch
from omegaconf import DictConfig
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from verl_partial.cpu_backend.engine import CpuBatchedEngine, SamplingParams

logger = logging.getLogger("verl_partial.cpu_backend")

SERVER_NAME_PREFIX = "verl_partial_cpu_server_"
# Fault injection for resilience tests, e.g. "raise=0.1,hang=0.05,hang_s=30,seed=0": each generate
# call raises with probability `raise`, or stalls `hang_s` seconds with probability `hang`.
FAULTS_ENV = "VERL_PARTIAL_CPU_FAULTS"


@dataclasses.dataclass(frozen=True)
class FaultInjection:
    raise_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 30.0
    seed: int = 0

    @classmethod
    def from_env(cls, spec: str | None) -> FaultInjection:
        if not spec:
            return cls()
        names = {"raise": "raise_rate", "hang": "hang_rate", "hang_s": "hang_s", "seed": "seed"}
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


class CpuRolloutServer:
    """Ray actor holding one CPU engine; the counterpart of verl's vLLMHttpServer, minus HTTP."""

    def __init__(self, config: RolloutConfig | DictConfig, model_config: HFModelConfig | DictConfig, replica_rank: int):
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
        self.faults = FaultInjection.from_env(os.environ.get(FAULTS_ENV))
        self.fault_rng = random.Random(self.faults.seed * 1000 + replica_rank)
        self.max_model_len = self.config.prompt_length + self.config.response_length
        self.engine = CpuBatchedEngine(
            model,
            eos_token_ids=self._eos_token_ids(model),
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            logprobs_mode=self.config.logprobs_mode,
        )
        # verl's vLLMHttpServer submission gate (vllm_async_server.py): closed by abort_all_requests, opened by
        # resume_generation; a request arriving while it is closed parks (or, when rejecting, is refused).
        self._submission_paused = False
        self._rejecting = False
        self._resume_event: asyncio.Event | None = None

    def _eos_token_ids(self, model) -> set[int]:
        ids: set[int] = set()
        for source in (model.generation_config.eos_token_id, self.model_config.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, list) else [source])
        if not ids:
            raise ValueError(f"model at {self.model_config.local_path} defines no eos_token_id")
        return ids

    def get_server_address(self) -> str:
        # verl keys its load balancer by address; there is no HTTP endpoint behind it.
        return f"cpu://replica-{self.replica_rank}"

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        **_unused: Any,
    ) -> TokenOutput:
        if image_data or video_data:
            raise ValueError("the CPU rollout backend is text-only")
        draw = self.fault_rng.random()
        if draw < self.faults.raise_rate:
            raise RuntimeError(f"injected fault ({FAULTS_ENV})")
        if draw < self.faults.raise_rate + self.faults.hang_rate:
            await asyncio.sleep(self.faults.hang_s)
        prompt_ids = [int(token) for token in prompt_ids]
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len={self.max_model_len}"
            )
        params = to_engine_params(sampling_params, default_max_tokens=min(self.config.response_length, room))
        params.max_tokens = max(1, min(params.max_tokens, room))
        rejected = await self._park_until_admitted(request_id)
        if rejected is not None:
            return rejected
        # No await between admission and the engine registering the request: an abort that closes the gate
        # after this line finds the request in the engine (vLLM needs its _admitting barrier for the same).
        result = await self.engine.generate(request_id, prompt_ids, params)
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            # verl's vLLM server reports EOS and max_tokens both as "completed".
            stop_reason="aborted" if result.stop_reason == "aborted" else "completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _gate(self) -> asyncio.Event:
        if self._resume_event is None:
            self._resume_event = asyncio.Event()
            self._resume_event.set()
        return self._resume_event

    async def _park_until_admitted(self, request_id: str) -> TokenOutput | None:
        """verl's ``vLLMHttpServer._park_until_admitted``: wait out a closed gate, or refuse the request when the
        gate rejects late arrivals (no tokens, ``stop_reason="aborted"``, ``log_probs=None``). A parked request
        is not known to the engine, so ``abort_request`` does not find it; cancelling the call frees it."""
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
        return None

    async def load_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: int | None) -> None:
        self.engine.load_weights(named_tensors.items())
        self.global_steps = global_steps

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """verl's vLLM ``abort_all_requests``: close the gate (declaring whether late arrivals park or are
        refused), then abort every request in the engine -- running ones return all their tokens so far, queued
        ones none, all as ``"aborted"``. The engine stays paused until :meth:`resume_generation`."""
        self._submission_paused, self._rejecting = True, reject_request
        self._gate().clear()
        request_ids = self.engine.request_ids
        self.engine.pause()
        await self.engine.abort_all()
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        """Abort one request the engine knows (running: its tokens so far; queued: none). Like vLLM, a request
        parked at the gate is not found; cancel its call instead."""
        if not await self.engine.abort(request_id):
            return {"aborted": False, "error": f"Request {request_id} not found"}
        return {"aborted": True, "request_id": request_id}

    async def resume_generation(self) -> None:
        self.engine.resume()
        self._submission_paused, self._rejecting = False, False
        self._gate().set()

    async def wait_for_requests_to_drain(self) -> None:
        while self.engine.num_running or self.engine.num_waiting:
            await asyncio.sleep(0.01)

    # Memory management and profiling are meaningless for a CPU engine holding a tiny model.
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
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

    def engine_stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.stats)


class CpuReplica(RolloutReplica):
    """One CPU server per replica, placed next to the replica's FSDP workers (hybrid mode only)."""

    async def launch_servers(self) -> None:
        server_cls = ray.remote(CpuRolloutServer)
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = server_cls.options(name=name, max_concurrency=self.max_concurrency, num_cpus=0).remote(
            config=self.config, model_config=self.model_config, replica_rank=self.replica_rank
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()

    def rollout_worker_use_gpu(self) -> bool:
        return False


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
