"""The one place where engine quirks live: how each rollout engine's servers answer, abort and cancel.

verl 0.9.1 fronts three engines with the same server-actor interface, but they differ where partial rollout
cares (read from ``verl/workers/rollout/``):

* **vLLM** (``vllm_rollout/vllm_async_server.py``): ``stop_reason`` is ``"completed"`` for vLLM's ``stop`` and
  ``length`` alike and ``"aborted"`` for ``abort``; ``abort_all_requests(reject_request=True)`` makes requests that
  reach the closed gate return ``"aborted"`` at once instead of parking until ``resume_generation``. Cancelling
  the Ray task of a ``generate`` call cancels its coroutine, and vLLM's ``AsyncLLM.generate`` aborts a request whose
  consumer is cancelled, so nothing keeps generating.
* **SGLang** (``sglang_rollout/async_sglang_server.py``): passes ``"stop"``/``"length"``/``"abort"`` through;
  ``abort_all_requests`` ignores ``reject_request`` (late arrivals wait for ``resume_generation``), so the
  scheduler's step end must cancel them (``partial.abort_grace_s``). The server has no per-request abort; a
  cancelled ``generate`` coroutine is the only handle on one request.
* **ours** (``verl_partial.cpu_backend``): reports exactly what verl's vLLM server reports, gate included.

The finish mapping itself is :mod:`verl_partial.core.finish` (pure, unit-tested against each engine's output
shapes); this module only selects it and the control calls by ``actor_rollout_ref.rollout.name``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verl_partial.core.finish import FinishMapper, finish_mapper


@dataclass(frozen=True)
class EngineAdapter:
    """What differs per engine: the stop-reason mapping and whether its gate can refuse late arrivals."""

    name: str
    finish: FinishMapper
    # abort_all_requests(reject_request=True) refuses calls arriving at the closed gate (else they park there).
    rejects_late_arrivals: bool

    async def abort_all(self, replicas: Sequence[Any]) -> None:
        """Close every replica's gate and end its running requests (they return ABORTED with their tokens)."""
        await asyncio.gather(
            *[replica.abort_all_requests(reject_request=self.rejects_late_arrivals) for replica in replicas]
        )

    async def resume(self, replicas: Sequence[Any]) -> None:
        await asyncio.gather(*[replica.resume_generation() for replica in replicas])


_REJECTS_LATE_ARRIVALS = {"vllm": True, "sglang": False, "cpu": True}


def engine_adapter(rollout_name: str) -> EngineAdapter:
    """The adapter for ``actor_rollout_ref.rollout.name``; an engine whose server code we have not read is refused."""
    mapper = finish_mapper(rollout_name)  # raises, naming the key, for an unknown engine
    return EngineAdapter(rollout_name, mapper, _REJECTS_LATE_ARRIVALS[rollout_name])
