"""vLLM's finish quirk: how verl's vLLM server reports why a call stopped (the CPU engine's server reports the same).

The verl-touching vLLM fixes are :mod:`verl_partial.glue.engines.vllm`."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from verl_partial.core.partial.finish import Finish, _ends_on_eos


def from_vllm(stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, eos_ids: Collection[int]) -> Finish:
    """Map verl's vLLM server output (``TokenOutput.stop_reason``, ``token_ids``) for a call made with
    ``max_tokens`` to a :class:`Finish`.

    The last token decides before the reason does: an EOS id ends the answer even when the segment is exactly
    ``max_tokens`` long or was aborted in the same engine step (resuming it would train tokens after its EOS).
    ``"completed"`` covers both EOS and budget stops: a segment shorter than ``max_tokens`` stopped on a stop string
    (which vLLM removes from the output), a full-length one hit its budget. ``"aborted"`` with the whole budget used
    is a budget stop too.
    """
    if stop_reason not in ("completed", "aborted"):
        raise ValueError(f"unknown vLLM stop_reason {stop_reason!r}; verl 0.9.1 reports 'completed' or 'aborted'")
    if _ends_on_eos(token_ids, eos_ids):
        return Finish.EOS
    if len(token_ids) >= max_tokens:
        return Finish.LENGTH
    return Finish.ABORTED if stop_reason == "aborted" else Finish.STOP
