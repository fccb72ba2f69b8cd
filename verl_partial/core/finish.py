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
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar


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


T = TypeVar("T")


@dataclass(frozen=True)
class SegmentEnd:
    """How a generate call ended AND where its answer ends: ``keep`` tokens (and their log-probs) of the returned
    run are the sample's; anything after them was never the model's answer.

    A speculative engine appends a whole accepted run before it tests abort, length and EOS (SGLang 0.5.12,
    ``scheduler_output_processor_mixin.py`` 552-564): after an abort or at the length cap the run can hold an EOS
    followed by tokens. Keeping those tokens, or resuming after them, would train text after the answer ended.
    """

    finish: Finish
    keep: int

    def cut(self, values: Sequence[T]) -> Sequence[T]:
        """The answer's part of ``values`` (the call's new token ids, or their log-probs)."""
        return values[: self.keep]


def answer_length(token_ids: Sequence[int], eos_ids: Collection[int]) -> int | None:
    """Tokens up to and including the first EOS id of ``token_ids``; ``None`` if it holds none."""
    for index, token in enumerate(token_ids):
        if int(token) in eos_ids:
            return index + 1
    return None


def from_vllm(
    stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, eos_ids: Collection[int]
) -> SegmentEnd:
    """Map verl's vLLM server output (``TokenOutput.stop_reason``, ``token_ids``) for a call made with
    ``max_tokens`` to a :class:`SegmentEnd`.

    An EOS ends the answer wherever it is in the run: at the end even when the segment is exactly ``max_tokens``
    long or was aborted in the same engine step (resuming it would train tokens after its EOS), and inside the run
    (vLLM 0.24's scheduler already stops a speculative run at its first stop token, ``check_stop`` per accepted
    token; the cut makes it hold whatever the server returns). ``"completed"`` covers both EOS and budget stops: a
    segment shorter than ``max_tokens`` stopped on a stop string (which vLLM removes from the output), a
    full-length one hit its budget. ``"aborted"`` with the whole budget used is a budget stop too.
    """
    if stop_reason not in ("completed", "aborted"):
        raise ValueError(f"unknown vLLM stop_reason {stop_reason!r}; verl 0.9.1 reports 'completed' or 'aborted'")
    eos_end = answer_length(token_ids, eos_ids)
    if eos_end is not None:
        return SegmentEnd(Finish.EOS, eos_end)
    if len(token_ids) >= max_tokens:
        return SegmentEnd(Finish.LENGTH, len(token_ids))
    return SegmentEnd(Finish.ABORTED if stop_reason == "aborted" else Finish.STOP, len(token_ids))


def from_sglang(
    stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, eos_ids: Collection[int]
) -> SegmentEnd:
    """Map verl's SGLang server output to a :class:`SegmentEnd`.

    SGLang 0.5.12 passes its finish type through, but the type does not say whether the model ended its answer:
    at an abort every running request decodes one more token, and ``Req.check_finished``
    (``sglang/srt/managers/schedule_batch.py``) tests abort before EOS and length, and length before EOS. So the
    extra token may be an EOS (reported "abort"), or the last allowed token (reported "abort"), and an EOS that is a
    segment's last allowed token is reported "length" (issue 19, failure 3). With speculative decoding the whole
    accepted run is appended before those tests, so an EOS can sit inside the run, followed by tokens (issue 26,
    finding 6; 0.5.23 fixed the length case, not the abort case). Hence the first EOS decides first (and cuts the
    run there), then the budget, then the reason.
    """
    if stop_reason not in ("stop", "length", "abort"):
        raise ValueError(f"unknown SGLang stop_reason {stop_reason!r}; SGLang reports 'stop', 'length' or 'abort'")
    eos_end = answer_length(token_ids, eos_ids)
    if eos_end is not None:
        return SegmentEnd(Finish.EOS, eos_end)
    if stop_reason == "length" or len(token_ids) >= max_tokens:
        return SegmentEnd(Finish.LENGTH, len(token_ids))
    return SegmentEnd(Finish.ABORTED if stop_reason == "abort" else Finish.STOP, len(token_ids))


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
