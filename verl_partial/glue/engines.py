"""The one place where engine quirks live: how each rollout engine's servers answer, abort and take calls back.

verl 0.9.1 fronts its engines with the same server-actor interface, but they differ where partial rollout cares
(read from ``verl/workers/rollout/`` and the engines' own code):

* **vLLM 0.24** (``vllm_rollout/vllm_async_server.py``): ``stop_reason`` is ``"completed"`` for vLLM's ``stop`` and
  ``length`` alike, ``"aborted"`` for ``abort``. ``abort_all_requests(reject_request=True)`` closes a gate that
  refuses late arrivals, but first waits (up to 60 s) until every request already admitted has produced a first
  output, so requests queued behind ``max_num_seqs`` or a full KV cache hold it while the engine keeps decoding.
  verl's per-request ``abort_request`` looks the request up by its external id in a table vLLM 0.24 keys by
  internal ids, so it never finds one; :func:`verl_partial.verl_patches` adds ``take_back_requests``, which aborts
  through ``AsyncLLM.abort`` by external id: the call returns ``"aborted"`` with every token so far. A Ray-cancelled
  call returns nothing (``AsyncLLM.generate`` aborts the request on ``CancelledError``).
* **SGLang 0.5.12** (``sglang_rollout/async_sglang_server.py``): passes ``"stop"``/``"length"``/``"abort"`` through,
  and decodes one more token at an abort (:mod:`verl_partial.core.finish` reads the last token first). Its pause
  gate parks late arrivals and its server has no per-request abort; a cancelled call keeps decoding.
  :mod:`verl_partial.glue.sglang_server` adds a rejecting gate, ``take_back_requests`` and abort-on-cancel to verl's
  SGLang server, so the step end is the same protocol as on vLLM. Control calls go to a replica's first server.
* **ours** (``verl_partial.cpu_backend``): verl's vLLM server's behaviour, barrier included, with the same
  ``take_back_requests``; ``+backend=cpu_sglang`` serves SGLang's.

The finish mapping itself is :mod:`verl_partial.core.finish`; this module selects it and the control calls by
``actor_rollout_ref.rollout.name``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_partial.core.finish import FinishMapper, finish_mapper

# The server method (ours, on every engine) that aborts calls by request id and lets them return their tokens.
TAKE_BACK_METHOD = "take_back_requests"
# The server method (ours, on every engine) the scheduler's stall check reads: tokens so far of each request held,
# by request id, or None where the server cannot tell (SGLang: its tokenizer sees a non-streamed request only at
# its end).
PROGRESS_METHOD = "progress_of_requests"


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


def engine_adapter(rollout_name: str) -> EngineAdapter:
    """The adapter for ``actor_rollout_ref.rollout.name``; an engine whose server code we have not read is refused."""
    return EngineAdapter(rollout_name, finish_mapper(rollout_name))  # raises, naming the key, for an unknown engine
