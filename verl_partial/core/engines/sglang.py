"""SGLang's finish quirk: how verl's SGLang server reports why a call stopped.

The verl-touching SGLang fix is :mod:`verl_partial.glue.engines.sglang`."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from verl_partial.core.partial.finish import Finish, _ends_on_eos


def from_sglang(stop_reason: str | None, token_ids: Sequence[int], max_tokens: int, eos_ids: Collection[int]) -> Finish:
    """Map verl's SGLang server output to a :class:`Finish`.

    SGLang 0.5.12 passes its finish type through, but the type does not say whether the model ended its answer:
    at an abort every running request decodes one more token, and ``Req.check_finished``
    (``sglang/srt/managers/schedule_batch.py``) tests abort before EOS and length, and length before EOS. So the
    extra token may be an EOS (reported "abort"), or the last allowed token (reported "abort"), and an EOS that is a
    segment's last allowed token is reported "length" (issue 19, failure 3). Hence the last token decides first,
    then the budget, then the reason.
    """
    if stop_reason not in ("stop", "length", "abort"):
        raise ValueError(f"unknown SGLang stop_reason {stop_reason!r}; SGLang reports 'stop', 'length' or 'abort'")
    if _ends_on_eos(token_ids, eos_ids):
        return Finish.EOS
    if stop_reason == "length" or len(token_ids) >= max_tokens:
        return Finish.LENGTH
    return Finish.ABORTED if stop_reason == "abort" else Finish.STOP
