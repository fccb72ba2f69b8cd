"""vLLM's finish quirk: how verl's vLLM server reports why a call stopped (the CPU engine's server reports the same).

The verl-touching vLLM fixes are :mod:`verl_partial.glue.engines.vllm`."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from verl_partial.core.partial.finish import Finish, SegmentEnd, answer_length


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
