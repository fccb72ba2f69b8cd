"""SGLang's finish quirk: how verl's SGLang server reports why a call stopped.

The verl-touching SGLang fix is :mod:`verl_partial.glue.engines.sglang`."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from verl_partial.core.partial.finish import Finish, SegmentEnd, answer_length


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
    run there), then the budget, then the reason. At an abort the whole run is returned (``finished_len`` is cut to
    ``max_new_tokens`` for a length finish only), so it can pass ``max_tokens``: what lies past it is cut too.
    """
    if stop_reason not in ("stop", "length", "abort"):
        raise ValueError(f"unknown SGLang stop_reason {stop_reason!r}; SGLang reports 'stop', 'length' or 'abort'")
    token_ids = token_ids[:max_tokens]
    eos_end = answer_length(token_ids, eos_ids)
    if eos_end is not None:
        return SegmentEnd(Finish.EOS, eos_end)
    if stop_reason == "length" or len(token_ids) >= max_tokens:
        return SegmentEnd(Finish.LENGTH, len(token_ids))
    return SegmentEnd(Finish.ABORTED if stop_reason == "abort" else Finish.STOP, len(token_ids))
