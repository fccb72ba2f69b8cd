"""The one place where engine quirks live: how each rollout engine's servers answer, abort and take calls back.

verl 0.9.1 fronts its engines with the same server-actor interface, but they differ where partial rollout cares
(read from ``verl/workers/rollout/`` and the engines' own code):

* **vLLM 0.24** (``vllm_rollout/vllm_async_server.py``): ``stop_reason`` is ``"completed"`` for vLLM's ``stop`` and
  ``length`` alike, ``"aborted"`` for ``abort``. ``abort_all_requests(reject_request=True)`` closes a gate that
  refuses late arrivals, but first waits (up to 60 s) until every request already admitted has produced a first
  output, so requests queued behind ``max_num_seqs`` or a full KV cache hold it while the engine keeps decoding.
  verl's per-request ``abort_request`` looks the request up by its external id in a table vLLM 0.24 keys by
  internal ids, so it never finds one; :mod:`verl_partial.glue.engines.vllm` adds ``take_back_requests``, which aborts
  through ``AsyncLLM.abort`` by external id: the call returns ``"aborted"`` with every token so far. A Ray-cancelled
  call returns nothing (``AsyncLLM.generate`` aborts the request on ``CancelledError``).
* **SGLang 0.5.12** (``sglang_rollout/async_sglang_server.py``): passes ``"stop"``/``"length"``/``"abort"`` through,
  and decodes one more token at an abort (:mod:`verl_partial.core.partial.finish` reads the last token first). Its pause
  gate parks late arrivals and its server has no per-request abort; a cancelled call keeps decoding.
  :mod:`verl_partial.glue.engines.sglang` adds a rejecting gate, ``take_back_requests`` and abort-on-cancel to verl's
  SGLang server, so the step end is the same protocol as on vLLM. Control calls go to a replica's first server.
* **ours** (``verl_partial.cpu_backend``): verl's vLLM server's behaviour, barrier included, with the same
  ``take_back_requests``; ``+backend=cpu_sglang`` serves SGLang's.

The finish mappings are :mod:`verl_partial.core.engines.vllm` and :mod:`verl_partial.core.engines.sglang`; this module
selects one and the control calls by ``actor_rollout_ref.rollout.name``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from verl_partial.core.engines.sglang import from_sglang
from verl_partial.core.engines.vllm import from_vllm
from verl_partial.core.partial.finish import SegmentEnd

FinishMapper = Callable[[str | None, Sequence[int], int, Collection[int]], SegmentEnd]
# By ``actor_rollout_ref.rollout.name``. Our CPU server reports verl's vLLM shapes, so it shares vLLM's mapper.
FINISH_MAPPERS: dict[str, FinishMapper] = {"vllm": from_vllm, "sglang": from_sglang, "cpu": from_vllm}


def finish_mapper(rollout_name: str) -> FinishMapper:
    """The mapper for ``actor_rollout_ref.rollout.name``; an engine we have not read is refused, not guessed."""
    mapper = FINISH_MAPPERS.get(rollout_name)
    if mapper is None:
        raise ValueError(
            f"actor_rollout_ref.rollout.name must be one of {sorted(FINISH_MAPPERS)} for partial rollout, "
            f"got {rollout_name!r}"
        )
    return mapper


# Tokens of context a server keeps back beyond prompt + new tokens: SGLang caps new tokens at
# ``max_model_len - prompt - 1`` (verl's ``SGLangHttpServer.generate``), vLLM at ``max_model_len - prompt``.
_CONTEXT_RESERVE = {"sglang": 1}


def effective_model_len(max_model_len: int | None, max_position_embeddings: int | None) -> int | None:
    """The context the servers will use: ``rollout.max_model_len``, or (verl's default ``null``) the model's
    ``max_position_embeddings``, as vLLM and SGLang both fall back to."""
    return max_model_len if max_model_len is not None else max_position_embeddings


def check_model_len(
    max_model_len: int | None,
    prompt_length: int,
    response_length: int,
    *,
    max_position_embeddings: int | None = None,
    rollout_name: str = "vllm",
) -> None:
    """Refuse a context too small for prompt + response, including the ``null`` default (issue 19, failure 5).

    verl clamps ``max_tokens`` to the room left without saying so. vLLM then reports a truncated answer as
    ``"completed"``, which would be trained as a finished one; SGLang reports a 0-token ``"length"`` on every later
    call of a sample that reached the cap, which never finishes it.
    """
    context = effective_model_len(max_model_len, max_position_embeddings)
    if context is None:
        return
    needed = prompt_length + response_length + _CONTEXT_RESERVE.get(rollout_name, 0)
    if context < needed:
        source = (
            f"actor_rollout_ref.rollout.max_model_len ({max_model_len})"
            if max_model_len is not None
            else f"the model's max_position_embeddings ({max_position_embeddings}), which the {rollout_name} "
            "servers use when actor_rollout_ref.rollout.max_model_len is null"
        )
        reserve = " + 1 (SGLang keeps one token of context back)" if needed > prompt_length + response_length else ""
        raise ValueError(
            f"{source} must be >= data.max_prompt_length + data.max_response_length ({prompt_length} + "
            f"{response_length}{reserve} = {needed}); a smaller context silently truncates answers that partial "
            "rollout would train as finished, or never finish"
        )


# The server method (ours, on every engine) that aborts calls by request id and lets them return their tokens.
TAKE_BACK_METHOD = "take_back_requests"
# The server method (ours, on every engine) the scheduler's stall check reads: tokens so far of each request held,
# by request id, or None where the server cannot tell (SGLang: its tokenizer sees a non-streamed request only at
# its end).
PROGRESS_METHOD = "progress_of_requests"
# The server method (ours, on every engine) that reports the tokens of KV cache its engine holds, or None where it
# cannot tell (``partial.kv_tokens_per_server=auto``).
KV_CACHE_METHOD = "kv_cache_tokens"
# The server method (ours, on every engine) that names the GPU its engine runs on as the engine reports it (vLLM's
# ``current_platform.get_device_name()``), or None on a CPU (``partial.max_calls_per_server=auto``).
GPU_NAME_METHOD = "gpu_name"


@dataclass(frozen=True)
class EngineAdapter:
    """What differs per engine: the stop-reason mapping and which servers of a replica take control calls."""

    name: str
    finish: FinishMapper

    def control_servers(self, replica: Any) -> list[Any]:
        """SGLang serves control calls on a replica's first server only (verl's ``SGLangReplica``); vLLM's other
        nodes answer them as no-ops, so vLLM and ours take them on every server."""
        return list(replica.servers[:1] if self.name == "sglang" else replica.servers)

    def abort_calls(self, replica: Any) -> list[Any]:
        """Close the replica's gates, refusing late arrivals, and end its running requests (they return their tokens):
        one Ray call per control server, for the caller to chain on (the resume waits for them)."""
        return [server.abort_all_requests.remote(reject_request=True) for server in self.control_servers(replica)]

    def resume_calls(self, replica: Any) -> list[Any]:
        """Reopen the replica's gates: one Ray call per control server."""
        return [server.resume_generation.remote() for server in self.control_servers(replica)]

    async def take_back(self, server: Any, request_ids: list[str]) -> None:
        """Abort these calls on ``server`` by request id; each then returns ABORTED with its tokens so far."""
        await getattr(server, TAKE_BACK_METHOD).remote(request_ids)

    def progress_calls(self, replica: Any) -> list[Any]:
        """Read how far the replica's requests got (a stall check): one Ray call per control server."""
        return [getattr(server, PROGRESS_METHOD).remote() for server in self.control_servers(replica)]


def check_take_back(servers: dict[str, Any], resolve: Callable[[list[Any]], list[Any]]) -> None:
    """Probe every server's take-back once, before the first call: ``take_back_requests([])`` on each.

    A server without the method (a verl or engine we did not patch), or a vLLM the take-back cannot drive (its own
    check, :func:`verl_partial.glue.engines.vllm.check_vllm_engine`), fails here, naming the server. Found only mid-step
    it looked like a server that answered, and its calls were retried forever. ``resolve`` is ``ray.get``.
    """
    refs, problems = [], []
    for address, server in servers.items():
        method = getattr(server, TAKE_BACK_METHOD, None)
        if method is None:
            problems.append(f"server {address} has no {TAKE_BACK_METHOD} (verl-partial's patch did not reach it)")
        else:
            refs.append((address, method.remote([])))
    for address, ref in refs:
        try:
            resolve([ref])
        except Exception as error:  # noqa: BLE001 -- every server's failure is collected and raised below
            problems.append(f"server {address}: {type(error).__name__}: {error}")
    if problems:
        raise RuntimeError("partial rollout cannot take calls back on these servers:\n  - " + "\n  - ".join(problems))


def read_kv_cache_tokens(servers: dict[str, Any], resolve: Callable[[list[Any]], list[Any]]) -> int | None:
    """The KV cache of the smallest server, in tokens, as the engines report it (one Ray call per server, once per
    run): the cap ``partial.kv_tokens_per_server=auto`` divides. None when any server cannot tell (our CPU engine
    without an emulated GPU), since a cap from the others could starve it or overfill it. ``resolve`` is
    ``ray.get``; a server without the method (a verl or engine we did not patch) fails here, naming it."""
    sizes = _ask_every_server(servers, KV_CACHE_METHOD, "partial.kv_tokens_per_server", resolve)
    if not sizes or any(size is None for size in sizes.values()):
        return None
    return min(int(size) for size in sizes.values())


def read_gpu_names(servers: dict[str, Any], resolve: Callable[[list[Any]], list[Any]]) -> dict[str, str | None]:
    """Each server's GPU as its engine names it, None on a CPU (one Ray call per server, once per run): what
    ``partial.max_calls_per_server=auto`` looks the compute knee up by (``verl_partial.sim.hardware.knee_of_servers``).
    A server without the method fails here, naming it."""
    return _ask_every_server(servers, GPU_NAME_METHOD, "partial.max_calls_per_server", resolve)


def _ask_every_server(
    servers: dict[str, Any], method: str, key: str, resolve: Callable[[list[Any]], list[Any]]
) -> dict[str, Any]:
    """Every server's answer to ``method``, by address; refuses, naming ``key``'s ``auto`` and the servers, when a
    server lacks the method (verl-partial's patch did not reach it)."""
    missing = [address for address, server in servers.items() if getattr(server, method, None) is None]
    if missing:
        raise RuntimeError(
            f"{key}=auto cannot ask servers {missing}: they have no {method} (verl-partial's patch did not reach "
            f"them); set {key} explicitly"
        )
    answers = resolve([getattr(server, method).remote() for server in servers.values()])
    return dict(zip(servers, answers, strict=True))


def engine_adapter(rollout_name: str) -> EngineAdapter:
    """The adapter for ``actor_rollout_ref.rollout.name``; an engine whose server code we have not read is refused."""
    return EngineAdapter(rollout_name, finish_mapper(rollout_name))  # raises, naming the key, for an unknown engine
