"""One training row per model turn (``balance.rows=transition``): the pure plan (no verl, no torch).

Why this exists
---------------
Agent pipelines such as agent-lightning (microsoft/agent-lightning#287) train on one row per *transition*: a
model call whose prompt is the whole context so far (the task prompt, earlier model turns and tool outputs) and
whose response is that call's tokens. All transitions of a trajectory must sit in one optimizer step. verl 0.9.1
does this only in its v1 trainer (TransferQueue: ``trainer/ppo/v1/agent_loop_tq.py`` ``_agent_loop_postprocess``
puts each output under ``{uid}_{session_id}_{index}`` and copies the final output's reward to the session's other
outputs; ``trainer/ppo/v1/utils.py`` computes GRPO from each session's final output and broadcasts it;
``trainer/ppo/padding_utils.py`` pads the row count with zero-mask rows). Its v0 ``RayPPOTrainer`` joins the
agent loop's output 1:1 with the prompts, so a v0 agent loop cannot emit several rows per sample. We therefore
cut each multi-turn row into transitions where verl balances the batch, and mirror v1's reward, advantage and
padding rules.

A *turn* is a maximal run of ``response_mask == 1`` (the model's own tokens); tool output and template tokens
(mask 0) separate turns. Transition ``t`` of a trajectory: prompt = original prompt + response tokens
``[0, start_t)`` (tool outputs included), response = ``[start_t, end_t)``. Tokens after the last model turn
(trailing tool output) belong to no transition: no model call follows them. A trajectory without a model token
keeps one transition spanning its whole (fully masked) response, so its reward still reaches GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TransitionPlan", "turn_spans", "plan_transitions", "padding_rows"]


def turn_spans(response_mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every maximal run of 1s in one row's response mask, in order."""
    mask = np.asarray(response_mask).astype(bool)
    edges = np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def padding_rows(num_rows: int, multiple: int) -> int:
    """Rows to append so that ``num_rows`` becomes a multiple of ``multiple`` (verl's mini-batch size)."""
    if multiple <= 0:
        raise ValueError(f"row multiple must be positive, got {multiple}")
    return -num_rows % multiple


@dataclass(frozen=True)
class TransitionPlan:
    """Row ``i`` of the transition batch is ``response[source[i], start[i]:end[i]]`` after its context.

    Attributes:
        source: Original (trajectory) row of each new row; padding rows repeat the shortest transition's row.
        start, end: The turn's span in the source row's response coordinates.
        turn: 0-based turn index within the trajectory (that of the copied transition for padding rows).
        is_final: The trajectory's last transition (GRPO reads its advantage from this row, as verl v1 does).
            False on padding rows.
        is_padding: Rows appended so the count divides the mini-batch; trained with a zero mask.
    """

    source: np.ndarray
    start: np.ndarray
    end: np.ndarray
    turn: np.ndarray
    is_final: np.ndarray
    is_padding: np.ndarray

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_transitions(self) -> int:
        return int((~self.is_padding).sum())

    @property
    def num_padding(self) -> int:
        return int(self.is_padding.sum())

    @property
    def final_row(self) -> np.ndarray:
        """For every original row (trajectory), the index of its final transition."""
        finals = np.flatnonzero(self.is_final)
        out = np.empty(len(finals), dtype=np.int64)
        out[self.source[finals]] = finals
        return out


def plan_transitions(
    response_mask: np.ndarray, response_length: np.ndarray, prompt_length: np.ndarray, *, row_multiple: int
) -> TransitionPlan:
    """Transitions of every row, padded to a multiple of ``row_multiple`` rows.

    Args:
        response_mask: ``[B, R]`` 0/1, 1 on the model's own tokens.
        response_length: ``[B]`` valid response tokens per row (model and tool tokens, contiguous from 0).
        prompt_length: ``[B]`` valid prompt tokens per row; picks the cheapest transition as padding template.
        row_multiple: The actor's global mini-batch in rows (``ppo_mini_batch_size * rollout.n``).
    """
    mask = np.asarray(response_mask)
    lengths = np.asarray(response_length, dtype=np.int64)
    prompts = np.asarray(prompt_length, dtype=np.int64)
    if mask.ndim != 2 or len(lengths) != len(mask) or len(prompts) != len(mask):
        raise ValueError(f"response_mask must be [B, R] with B lengths, got {mask.shape}, {lengths.shape}")
    if len(mask) == 0:
        raise ValueError("cannot plan transitions of an empty batch")
    source, start, end, turn, final = [], [], [], [], []
    for row in range(len(mask)):
        spans = [(s, e) for s, e in turn_spans(mask[row]) if s < lengths[row]] or [(0, int(lengths[row]))]
        for index, (s, e) in enumerate(spans):
            source.append(row)
            start.append(s)
            end.append(min(e, int(lengths[row])))
            turn.append(index)
            final.append(index == len(spans) - 1)
    source_a, start_a, end_a = np.array(source), np.array(start), np.array(end)
    extra = padding_rows(len(source), row_multiple)
    # The padding template: the transition with the fewest tokens, so padding adds the least compute.
    cheapest = int(np.argmin(prompts[source_a] + end_a))
    pick = np.concatenate([np.arange(len(source)), np.full(extra, cheapest, dtype=np.int64)])
    return TransitionPlan(
        source=source_a[pick],
        start=start_a[pick],
        end=end_a[pick],
        turn=np.array(turn)[pick],
        is_final=np.concatenate([np.array(final, dtype=bool), np.zeros(extra, dtype=bool)]),
        is_padding=np.concatenate([np.zeros(len(source), dtype=bool), np.ones(extra, dtype=bool)]),
    )
