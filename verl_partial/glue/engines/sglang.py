"""verl-partial's fix of verl 0.9.1's SGLang server actor (``SGLangHttpServer``), as one reusable class patch.

What SGLang 0.5.12 behind verl's ``sglang_rollout/async_sglang_server.py`` lacks for partial rollout:

* **No per-request abort on the actor.** SGLang has one (``TokenizerManager.abort_request(rid)``; its scheduler
  matches ids by prefix, so callers must use prefix-free ids), verl does not expose it. Added:
  ``take_back_requests(request_ids)``, the same method verl-partial adds to verl's vLLM server.
* **No rejecting gate.** ``abort_all_requests()`` is ``pause_generation(mode="abort")``: a request arriving
  afterwards parks at ``is_pause_cond`` until ``continue_generation``, whatever the caller wanted
  (``SGLangReplica.abort_all_requests`` warns that it ignores ``reject_request``). Added: ``reject_request=True``
  closes our gate *synchronously, before* SGLang's pause, so nothing can reach ``is_pause_cond`` while rejecting;
  a ``generate`` behind it returns ``TokenOutput([], log_probs=None, stop_reason="abort")`` without entering
  SGLang; ``resume_generation`` reopens it after SGLang's ``continue_generation``.
* **Cancel does not stop generation.** ``generate_request`` / ``_wait_one_response`` have no ``CancelledError``
  handler and send no abort: a Ray-cancelled call keeps decoding and holding KV until it ends (an orphan at
  ``release_memory_occupation`` trips its idle assert), and one cancelled while parked at the pause gate leaves its
  ``rid_to_state`` entry forever. Fixed: a cancelled ``generate`` ends its request (:func:`_cancel`), the way
  SGLang 0.5.23 itself cleans up after a failed handler (tokenizer_manager.py@0.5.23:3853-3854 "Undelivered states
  are removed locally. Dispatched requests are aborted"): a state never sent to the scheduler is dropped at once; a
  sent one is aborted and kept until SGLang has answered the abort, then dropped. Dropping a sent state before the
  answer kills SGLang 0.5.12: the scheduler echoes the abort of a queued request (scheduler.py@0.5.12:3574
  "self.send_to_tokenizer.send_output(AbortReq(rid=req.rid), req)") and the tokenizer indexes the table without a
  guard (tokenizer_manager.py@0.5.12:2420 "state = self.rid_to_state[recv_obj.rid]"); the KeyError leaves
  ``handle_loop`` and its wrapper kills the process tree (tokenizer_manager.py@0.5.12:2755
  "kill_process_tree(os.getpid(), include_parent=True)").
* **SGLang 0.5.12 never frees an aborted queued request's state.** ``_handle_abort_req`` marks it finished
  (tokenizer_manager.py@0.5.12:2421 "state.finished = True") and never deletes it; only a scheduler output does
  (tokenizer_manager.py@0.5.12:1871 "del self.rid_to_state[rid]"). Every call taken back while queued leaked its
  entry (prompt and all). Fixed: a ``generate`` that returns drops its request's state when SGLang left it there
  finished. 0.5.23 deletes it itself (tokenizer_manager.py@0.5.23:3638 "del self.rid_to_state[recv_obj.rid]").
* **An abort can miss a request mid chunked prefill.** 0.5.12's scheduler looks for running requests in the running
  and current batches only (scheduler.py@0.5.12:3642-3645 "reqs = self.running_batch.reqs"), so a request between
  two chunks of its prefill is not found and decodes on. Fixed: a cancelled request's abort is re-sent every
  :data:`ABORT_RESEND_S` until SGLang answers it, and ``sleep`` / ``release_kv_cache`` first wait for those answers,
  so no orphan reaches ``release_memory_occupation``'s idle assert (scheduler_update_weights_mixin.py@0.5.12:130-132
  "self.is_fully_idle()"). On 0.5.23 the scheduler catches the chunked request itself
  (scheduler.py@0.5.23:5678 "self._pending_chunked_abort_req = chunked_req") and ignores a re-sent abort of the
  same id (tokenizer_manager.py@0.5.23:2249 "if state.abort_sent:"): the re-sends are harmless there.

Callers that use neither ``reject_request`` nor ``take_back_requests`` see verl's behaviour unchanged, except that a
cancelled call now stops its request (a pure fix). The patch needs of the class only what verl's has:
``generate(prompt_ids, sampling_params, request_id, ...)``, ``abort_all_requests()``, ``resume_generation()``,
``tokenizer_manager`` (``abort_request``, ``get_internal_state``, ``rid_to_state`` and its states' ``finished``,
``event`` and dispatch mark), ``node_rank`` and ``global_steps`` (``sleep`` and ``release_kv_cache`` are wrapped where
the class has them); it is applied to verl's class after import (``patches.apply``) and to the CPU test double
(``cpu_backend.rollout``) the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from types import ModuleType
from typing import Any

from verl.workers.rollout.replica import TokenOutput

logger = logging.getLogger(__name__)

_PATCHED = "_verl_partial_sglang_fix"
_REJECTING = "_verl_partial_rejecting"
_REAPERS = "_verl_partial_abort_reapers"
# How often a cancelled request's abort is re-sent until SGLang answers it: as SGLang's own pause re-sends its
# abort-all (tokenizer_manager.py@0.5.12:1513 "await asyncio.sleep(1.0)").
ABORT_RESEND_S = 1.0
# Server methods that end in release_memory_occupation's idle assert: they wait for cancelled requests' answers.
_QUIESCING = ("sleep", "release_kv_cache")


def apply_sglang_server_fix(server_cls: type) -> type:
    """Patch ``server_cls`` (verl's ``SGLangHttpServer`` or a double of it) in place; idempotent."""
    if getattr(server_cls, _PATCHED, False):
        return server_cls
    original_generate = server_cls.generate
    original_abort_all = server_cls.abort_all_requests
    original_resume = server_cls.resume_generation

    @functools.wraps(original_generate)
    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, *args, **kwargs):
        if getattr(self, _REJECTING, False):
            return TokenOutput(
                token_ids=[], log_probs=None, stop_reason="abort", extra_fields={"global_steps": self.global_steps}
            )
        try:
            output = await original_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        except asyncio.CancelledError:
            _cancel(self, request_id)
            raise
        _forget_answered(self.tokenizer_manager, request_id)
        return output

    @functools.wraps(original_abort_all)
    async def abort_all_requests(self, *args, reject_request: bool = False, **kwargs):
        if reject_request:
            setattr(self, _REJECTING, True)  # before SGLang's pause can park anyone
        return await original_abort_all(self, *args, **kwargs)

    # Ray binds call arguments against inspect.signature, which would follow __wrapped__ to verl's
    # ``abort_all_requests(self)`` and refuse ``reject_request``: the wrapper's own signature must be seen.
    del abort_all_requests.__wrapped__

    @functools.wraps(original_resume)
    async def resume_generation(self, *args, **kwargs):
        result = await original_resume(self, *args, **kwargs)
        setattr(self, _REJECTING, False)
        return result

    async def take_back_requests(self, request_ids: list[str]) -> list[str]:
        """End these requests by id (SGLang matching by prefix: ids must be prefix-free); returns those SGLang holds.

        A queued request returns no tokens, a running one its tokens plus one more, both with "abort". A request
        SGLang does not hold is untouched; one parked at the pause gate is held by the tokenizer manager only, so the
        scheduler does not find it and it stays parked.
        """
        if getattr(self, "node_rank", 0) != 0:  # SGLang serves control calls on node rank 0 only
            return []
        held = [request_id for request_id in request_ids if request_id in self.tokenizer_manager.rid_to_state]
        for request_id in held:
            self.tokenizer_manager.abort_request(request_id)
        return held

    server_cls.generate = generate
    server_cls.abort_all_requests = abort_all_requests
    server_cls.resume_generation = resume_generation

    async def progress_of_requests(self) -> None:
        """The stall check's reading: SGLang's tokenizer manager receives a non-streamed request's tokens only when
        it ends, so this server cannot tell a long decode from a stall; its stalls are judged by answers."""
        return None

    async def kv_cache_tokens(self) -> int | None:
        """Tokens of KV cache this server holds (``partial.kv_tokens_per_server=auto``): SGLang's
        ``max_total_num_tokens``, summed over its data-parallel ranks. verl keeps no usable copy: for SGLang >= 0.5.10
        its ``scheduler_info`` is the launch's third return value, the port arguments
        (sglang/srt/entrypoints/engine.py@0.5.12:882 "port_args,"). So the schedulers are asked, one answer per rank
        (tokenizer_control_mixin.py@0.5.12:791 "return [res.internal_state for res in responses]";
        tokenizer_control_mixin.py@0.5.23:974 "return [res.internal_state for res in responses]"), each naming its
        capacity (scheduler.py@0.5.12:3477 "int(self.max_total_num_tokens)";
        scheduler_components/internal_state.py@0.5.23:83 "token_capacity=scheduler.max_total_num_tokens")."""
        if getattr(self, "node_rank", 0) != 0:
            return None
        states = await self.tokenizer_manager.get_internal_state()
        capacities = [state["memory_usage"]["token_capacity"] for state in states]
        return None if not capacities or None in capacities else sum(int(tokens) for tokens in capacities)

    async def gpu_name(self) -> str | None:
        """The GPU this server's SGLang runs on (``partial.max_calls_per_server=auto``): device 0 of the
        ``CUDA_VISIBLE_DEVICES`` verl's server sets to its workers' GPUs, named by NVML (:func:`nvml_gpu_name`)."""
        return nvml_gpu_name(os.environ.get("CUDA_VISIBLE_DEVICES"))

    server_cls.take_back_requests = take_back_requests
    server_cls.progress_of_requests = progress_of_requests
    server_cls.kv_cache_tokens = kv_cache_tokens
    server_cls.gpu_name = gpu_name
    for name in _QUIESCING:
        if hasattr(server_cls, name):
            setattr(server_cls, name, _after_cancelled_settle(getattr(server_cls, name)))
    setattr(server_cls, _PATCHED, True)
    return server_cls


def nvml_gpu_name(visible_devices: str | None) -> str | None:
    """The name NVML gives the first of ``visible_devices`` (``CUDA_VISIBLE_DEVICES``: indices or UUIDs; unset: device
    0), as vLLM reports it too. Through NVML (``nvidia-ml-py``, an SGLang dependency) rather than torch, so the server
    actor creates no CUDA context: SGLang's own ``get_device_name`` initialises CUDA
    (sglang/srt/utils/common.py@0.5.12:1931 "return torch.cuda.get_device_name(device_id)"). None where
    NVML is missing or sees no such GPU (a CPU; AMD GPUs, which NVML does not see): ``auto`` then does not cap."""
    first = (visible_devices if visible_devices is not None else "0").split(",")[0].strip()
    if not first:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        if first.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        name = pynvml.nvmlDeviceGetName(handle)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    return name.decode() if isinstance(name, bytes) else name


def _after_cancelled_settle(method):
    @functools.wraps(method)
    async def quiescing(self, *args, **kwargs):
        await settle_cancelled(self)
        return await method(self, *args, **kwargs)

    return quiescing


async def settle_cancelled(server: Any) -> None:
    """Wait until SGLang has answered every cancelled request's abort (each ends: SGLang finishes every request it
    holds, at the latest at its ``max_new_tokens``, and the abort is re-sent until it does)."""
    reapers = getattr(server, _REAPERS, None)
    while reapers:
        await asyncio.gather(*list(reapers))


def _dispatched(state: Any) -> bool:
    """Whether SGLang sent the request to its scheduler (only then can an abort be echoed): 0.5.23 marks the state
    (tokenizer_manager.py@0.5.23:1810 "state.dispatched = True"); 0.5.12 stamps the state's time stats at the send
    (tokenizer_manager.py@0.5.12:1068 "tokenized_obj.time_stats = self.rid_to_state[obj.rid].time_stats",
    tokenizer_manager.py@0.5.12:1187 "tokenized_obj.time_stats.set_api_server_dispatch_time()")."""
    dispatched = getattr(state, "dispatched", None)
    if dispatched is None:
        return state.time_stats.api_server_dispatch_time > 0
    return bool(dispatched)


def _forget_answered(tokenizer_manager: Any, request_id: str) -> None:
    """Drop a request's state that SGLang answered but left in its table (0.5.12, an abort while queued)."""
    state = tokenizer_manager.rid_to_state.get(request_id)
    if state is not None and state.finished:
        del tokenizer_manager.rid_to_state[request_id]


def _cancel(server: Any, request_id: str) -> None:
    """End a cancelled call's request without crashing or leaking SGLang's tokenizer (module docstring)."""
    tokenizer_manager = server.tokenizer_manager
    state = tokenizer_manager.rid_to_state.get(request_id)
    if state is None or state.finished:  # answered (0.5.23 may have cleaned up already)
        _forget_answered(tokenizer_manager, request_id)
        return
    if not _dispatched(state):  # parked at the pause gate or tokenizing: nothing will ever answer it
        del tokenizer_manager.rid_to_state[request_id]
        return
    tokenizer_manager.abort_request(request_id)
    reapers: set[asyncio.Task] = server.__dict__.setdefault(_REAPERS, set())
    reaper = asyncio.ensure_future(_reap(tokenizer_manager, request_id, state))
    reapers.add(reaper)
    reaper.add_done_callback(reapers.discard)


async def _reap(tokenizer_manager: Any, request_id: str, state: Any) -> None:
    """Re-send the abort every :data:`ABORT_RESEND_S` until SGLang answers it (an abort the scheduler missed, mid
    chunked prefill), then drop the state if SGLang left it."""
    resent = 0
    while not state.finished and tokenizer_manager.rid_to_state.get(request_id) is state:
        try:
            await asyncio.wait_for(state.event.wait(), ABORT_RESEND_S)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            resent += 1
            tokenizer_manager.abort_request(request_id)
        state.event.clear()
    if resent:
        logger.info("request %s answered its abort after %d re-sends", request_id, resent)
    if tokenizer_manager.rid_to_state.get(request_id) is state:
        del tokenizer_manager.rid_to_state[request_id]


# verl's module that defines ``SGLangHttpServer``; fixed when imported (``verl_partial.patches.apply``).
SGLANG_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"


def _fix_sglang_server(module: ModuleType) -> None:
    apply_sglang_server_fix(module.SGLangHttpServer)
