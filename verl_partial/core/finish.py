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

from collections.abc import Callable, Collection, Iterable, Sequence
from enum import Enum


class Finish(str, Enum):
    """Why one generate call (segment) stopped."""

    EOS = "eos"  # the model ended its answer: an EOS id or a stop token id was sampled (and is in the output)
    STOP = "stop"  # a stop string matched (vLLM drops the string from the output)
    LENGTH = "length"  # the segment used its whole ``max_tokens``
    ABORTED = "aborted"  # abort or gate rejection; may carry the tokens generated before it


def finished(finish: Finish, total_len: int, response_length: int) -> bool:
    """Whether a sample whose last segment ended with ``finish`` and which now holds ``total_len`` response
    tokens is complete: EOS/STOP end it; LENGTH only once the whole ``response_length`` is used; ABORTED never
    (the sample is parked and resumed)."""
    if finish in (Finish.EOS, Finish.STOP):
        return True
    if finish is Finish.LENGTH:
        return total_len >= response_length
    return False


def eos_id_set(*sources: int | Iterable[int] | None) -> frozenset[int]:
    """Union of EOS ids from e.g. ``tokenizer.eos_token_id``, ``generation_config.eos_token_id`` (an int or a
    list in HF configs) and the request's ``stop_token_ids``; ``None`` sources are skipped."""
    ids: set[int] = set()
    for source in sources:
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return frozenset(int(token) for token in ids)


def from_vllm(stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, eos_ids: Collection[int]) -> Finish:
    """Map verl's vLLM server output (``TokenOutput.stop_reason``, ``token_ids``) for a call made with
    ``max_tokens`` to a :class:`Finish`.

    ``"completed"`` covers both EOS and budget stops; the last token decides: an EOS id is an EOS even when the
    segment is exactly ``max_tokens`` long; otherwise a segment shorter than ``max_tokens`` stopped on a stop
    string (which vLLM removes from the output) and a full-length one hit its budget.
    """
    if stop_reason == "aborted":
        return Finish.ABORTED
    if stop_reason != "completed":
        raise ValueError(f"unknown vLLM stop_reason {stop_reason!r}; verl 0.9.1 reports 'completed' or 'aborted'")
    if len(token_ids) and int(token_ids[-1]) in eos_ids:
        return Finish.EOS
    if len(token_ids) < max_tokens:
        return Finish.STOP
    return Finish.LENGTH


def from_sglang(stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, eos_ids: Collection[int]) -> Finish:
    """Map verl's SGLang server output to a :class:`Finish`: ``"stop"`` is an EOS when the last token is an EOS
    id, else a stop string; ``"length"`` and ``"abort"`` map one to one. ``max_tokens`` is unused (SGLang says
    ``"length"`` itself) and kept so every engine's mapper has one signature."""
    del max_tokens
    if stop_reason == "abort":
        return Finish.ABORTED
    if stop_reason == "length":
        return Finish.LENGTH
    if stop_reason == "stop":
        return Finish.EOS if len(token_ids) and int(token_ids[-1]) in eos_ids else Finish.STOP
    raise ValueError(f"unknown SGLang stop_reason {stop_reason!r}; SGLang reports 'stop', 'length' or 'abort'")


FinishMapper = Callable[[str | None, Sequence[int], int, Collection[int]], Finish]

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


def check_model_len(max_model_len: int | None, prompt_length: int, response_length: int) -> None:
    """Refuse a ``max_model_len`` too small for prompt + response.

    verl clamps ``max_tokens`` to ``max_model_len - prompt`` without saying so; vLLM then reports a truncated
    answer as ``"completed"`` and it would be trained as a finished one.
    """
    if max_model_len is not None and max_model_len < prompt_length + response_length:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_model_len ({max_model_len}) must be null or >= "
            f"data.max_prompt_length + data.max_response_length ({prompt_length} + {response_length}); "
            "a smaller value silently truncates answers that partial rollout would train as finished"
        )
