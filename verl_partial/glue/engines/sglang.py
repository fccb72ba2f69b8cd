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
  ``rid_to_state`` entry forever. Fixed: a cancelled ``generate`` sends ``abort_request(rid)`` and drops the
  request's state before re-raising, as vLLM does on cancel.

Callers that use neither ``reject_request`` nor ``take_back_requests`` see verl's behaviour unchanged, except that a
cancelled call now stops its request (a pure fix). The patch needs of the class only what verl's has:
``generate(prompt_ids, sampling_params, request_id, ...)``, ``abort_all_requests()``, ``resume_generation()``,
``tokenizer_manager`` (``abort_request``, ``rid_to_state``), ``node_rank`` and ``global_steps``; it is applied to
verl's class after import (``patches.apply``) and to the CPU test double (``cpu_backend.rollout``) the same way.
"""

from __future__ import annotations

import asyncio
import functools
from types import ModuleType
from typing import Any

from verl.workers.rollout.replica import TokenOutput

_PATCHED = "_verl_partial_sglang_fix"
_REJECTING = "_verl_partial_rejecting"


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
            return await original_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        except asyncio.CancelledError:
            _abort_and_forget(self.tokenizer_manager, request_id)
            raise

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
    server_cls.take_back_requests = take_back_requests
    setattr(server_cls, _PATCHED, True)
    return server_cls


def _abort_and_forget(tokenizer_manager: Any, request_id: str) -> None:
    """Stop a cancelled call's request. The abort reaches the scheduler only for a state SGLang still holds, so it
    is sent first; the state is then dropped, which also frees one parked at the pause gate (never sent, so no
    output would ever delete it). SGLang skips outputs for a deleted state (``_handle_batch_output``)."""
    tokenizer_manager.abort_request(request_id)
    tokenizer_manager.rid_to_state.pop(request_id, None)


# verl's module that defines ``SGLangHttpServer``; fixed when imported (``verl_partial.patches.apply``).
SGLANG_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"


def _fix_sglang_server(module: ModuleType) -> None:
    apply_sglang_server_fix(module.SGLangHttpServer)
