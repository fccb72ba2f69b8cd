"""One source of truth for "did this segment end the sample?", per engine.

verl 0.9.1's servers report why a generate call stopped in different words, and neither says outright whether
the model ended its answer:

* vLLM (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``) maps vLLM's ``finish_reason`` ``"stop"``
  (EOS id, ``stop_token_ids`` or a stop string) *and* ``"length"`` (``max_tokens`` reached) both to
  ``stop_reason="completed"``, and ``"abort"`` to ``"aborted"``. A request refused by a closed gate
  (``abort_all_requests(reject_request=True)``) also returns ``"aborted"``, with no tokens.
* SGLang (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``) passes SGLang's
  ``meta_info["finish_reason"]["type"]`` through: ``"stop"``, ``"length"`` or ``"abort"``.
* our CPU engine's server (``verl_partial.cpu_backend.rollout``) reports exactly what verl's vLLM server reports.

Both engines stop on every EOS id of the tokenizer *and* of ``generation_config`` (e.g. Qwen's 151643 next to
151645) and on the request's ``stop_token_ids``; :func:`eos_id_set` builds that union. A finish is then one of
:class:`Finish`, and :func:`finished` decides whether the sample is complete.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from enum import Enum


class Finish(str, Enum):
    """Why one generate call (segment) stopped."""

    EOS = "eos"  # the model ended its answer: an EOS id or a stop token id was sampled (and is in the output)
    STOP = "stop"  # a stop string matched (vLLM drops the string from the output)
    LENGTH = "length"  # the segment used its whole ``max_tokens``
    ABORTED = "aborted"  # abort or gate rejection; may carry the tokens generated before it


def finished(finish: Finish, total_len: int, response_length: int) -> bool:
    """Whether a sample whose last segment ended with ``finish`` and which now holds ``total_len`` response
    tokens is complete: EOS/STOP end it; a sample that holds its whole ``response_length`` is complete whatever the
    server said (SGLang may report the last allowed token of an aborted request as "abort": such a sample has no
    budget left, so it could never run again -- issue 19, 3b); ABORTED otherwise never (parked and resumed)."""
    if finish in (Finish.EOS, Finish.STOP):
        return True
    return total_len >= response_length


def eos_id_set(*sources: int | Iterable[int] | None) -> frozenset[int]:
    """Union of EOS ids from e.g. ``tokenizer.eos_token_id``, ``generation_config.eos_token_id`` (an int or a
    list in HF configs) and the request's ``stop_token_ids``; ``None`` sources are skipped."""
    ids: set[int] = set()
    for source in sources:
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return frozenset(int(token) for token in ids)


def _ends_on_eos(token_ids: Sequence[int], eos_ids: Collection[int]) -> bool:
    return bool(len(token_ids)) and int(token_ids[-1]) in eos_ids
