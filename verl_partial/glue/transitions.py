"""verl adapter for ``balance.rows=transition``: a multi-turn ``DataProto`` cut into one row per model turn.

Runs where verl calls ``_balance_batch`` (after the rollout/prompt union, ``rm_scores`` present, before the
old log-probs), so every later stage -- log-probs, reference, rollout correction, advantages, the actor's
mini-batches -- sees transitions. The plan (turn spans, padding) is :mod:`verl_partial.core.transitions`; this
module only moves tensors. Semantics follow verl 0.9.1's v1 trainer, which is the only place verl trains
several outputs per sample (see the core module's docstring):

* prompt = original prompt + response tokens before the turn (tool output included), left-padded; response =
  the turn's tokens, right-padded to the original response width; position ids recomputed from the attention
  mask (verl's ``compute_position_id_with_mask``, what the agent loop uses for text);
* every response-aligned tensor (``responses``, ``response_mask``, ``rollout_log_probs``, partial rollout's
  per-token policy versions, ...) is sliced; per-row tensors (width neither the response's, the prompt's nor
  the sequence's) and non-tensor columns are copied; any other prompt- or sequence-aligned tensor is refused;
* ``rm_scores``: the trajectory's reward on the last token of every transition (v1 copies the final output's
  ``reward_score`` to all outputs of the session);
* padding rows (copies of the cheapest transition with ``response_mask`` and ``rm_scores`` zeroed, own
  ``uid``/``trajectory_id``) make the row count a multiple of the actor's mini-batch, as v1's
  ``upsample_batch_to_divisible_size`` does; a zero mask removes them from every loss term verl aggregates;
* GRPO advantages: computed by verl's own ``compute_advantage`` on the final transitions only and broadcast
  over each trajectory's transitions (v1's ``compute_advantage_for_multi_trajectories``); padding rows get 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask

from verl_partial.core.balance_eval import evaluate_permutation
from verl_partial.core.transitions import TransitionPlan, plan_transitions

__all__ = [
    "TRANSITIONS_META",
    "TRAJECTORY_ID",
    "TURN_INDEX",
    "IS_FINAL",
    "IS_PADDING",
    "expand_to_transitions",
    "trajectories_split",
    "transition_advantage",
]

#: ``meta_info`` flag of a batch cut into transitions (read by the advantage patch).
TRANSITIONS_META = "verl_partial_transitions"
#: Non-tensor columns added to the transition batch.
TRAJECTORY_ID = "trajectory_id"
TURN_INDEX = "turn_index"
IS_FINAL = "is_final_transition"
IS_PADDING = "is_padding"

# Tensors laid out over prompt + response, rebuilt rather than sliced.
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")
# Fill values beyond a transition's response (masked positions; kept like the rollout pads them).
_RESPONSE_FILL = {"rollout_policy_version": -1}
_KEY = "balance.rows=transition"


def expand_to_transitions(batch: DataProto, *, row_multiple: int, pad_token_id: int | None) -> dict[str, float]:
    """Replace ``batch``'s rows in place by one row per model turn (plus padding rows); return ``balance/*`` counts.

    Args:
        batch: The step's batch after verl's union: ``prompts``, ``responses``, ``response_mask``,
            ``input_ids``, ``attention_mask``, ``position_ids`` (2-D), ``rm_scores``.
        row_multiple: The actor's global mini-batch in rows (``ppo_mini_batch_size * rollout.n``).
        pad_token_id: The tokenizer's pad id (verl's agent loop pads with it too).
    """
    tensors = batch.batch
    missing = [
        key for key in ("prompts", "responses", "response_mask", "rm_scores", *_SEQUENCE_KEYS) if key not in tensors
    ]
    if missing:
        raise ValueError(f"{_KEY} needs the batch tensors {missing} (a multi-turn agent-loop output with rm_scores)")
    if pad_token_id is None:
        raise ValueError(f"{_KEY} needs a tokenizer with a pad token (verl's agent loop pads with it)")
    if tensors["position_ids"].dim() != 2:
        raise ValueError(
            f"{_KEY}: position_ids of shape {tuple(tensors['position_ids'].shape)} (multi-modal rope) are not "
            "supported; set balance.rows=trajectory"
        )
    prompt_width, response_width = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    attention = tensors["attention_mask"]
    plan = plan_transitions(
        tensors["response_mask"].cpu().numpy(),
        attention[:, prompt_width:].sum(-1).cpu().numpy(),
        attention[:, :prompt_width].sum(-1).cpu().numpy(),
        row_multiple=row_multiple,
    )
    new_tensors = _transition_tensors(tensors, plan, prompt_width, response_width, pad_token_id)
    new_non_tensors = {key: value[plan.source] for key, value in batch.non_tensor_batch.items()}
    ids = _trajectory_ids(batch.non_tensor_batch.get("uid"), plan)
    new_non_tensors[TRAJECTORY_ID] = ids
    if "uid" in new_non_tensors:  # padding rows never join a real GRPO group
        new_non_tensors["uid"] = np.where(plan.is_padding, ids, new_non_tensors["uid"]).astype(object)
    new_non_tensors[TURN_INDEX] = plan.turn.astype(np.int64)
    new_non_tensors[IS_FINAL] = plan.is_final.copy()
    new_non_tensors[IS_PADDING] = plan.is_padding.copy()

    batch.batch = TensorDict(new_tensors, batch_size=[len(plan)])
    batch.non_tensor_batch = new_non_tensors
    batch.meta_info[TRANSITIONS_META] = True
    trajectories = int(plan.is_final.sum())
    per_trajectory = np.bincount(plan.source[~plan.is_padding], minlength=trajectories)
    return {
        "balance/trajectories": float(trajectories),
        "balance/transition_rows": float(plan.num_transitions),
        "balance/padding_rows": float(plan.num_padding),
        "balance/rows_per_trajectory/mean": float(per_trajectory.mean()),
        "balance/rows_per_trajectory/max": float(per_trajectory.max()),
    }


def _transition_tensors(
    tensors: TensorDict, plan: TransitionPlan, prompt_width: int, response_width: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    source = torch.as_tensor(plan.source, dtype=torch.long)
    start = torch.as_tensor(plan.start, dtype=torch.long)
    length = torch.as_tensor(plan.end - plan.start, dtype=torch.long)
    padding = torch.as_tensor(plan.is_padding)
    # New prompt: the window of width P' ending where the turn starts, over [P' pad columns | prompt | response].
    new_prompt_width = prompt_width + int(plan.start.max())
    window = (prompt_width + start)[:, None] + torch.arange(new_prompt_width)

    def left_window(full: torch.Tensor, fill: int) -> torch.Tensor:
        padded = torch.cat([full.new_full((full.shape[0], new_prompt_width), fill), full], dim=1)
        return padded[source[:, None], window]

    offsets = torch.arange(response_width)
    in_turn = offsets < length[:, None]
    index = (start[:, None] + offsets).clamp(max=response_width - 1)

    def turn_slice(values: torch.Tensor, fill: int | float) -> torch.Tensor:
        sliced = values[source[:, None], index]
        keep = in_turn.reshape(*in_turn.shape, *([1] * (sliced.dim() - 2)))
        return torch.where(keep, sliced, torch.full_like(sliced, fill))

    attention = tensors["attention_mask"]
    prompt_ids = left_window(tensors["input_ids"], pad_token_id)
    prompt_attention = left_window(attention, 0)
    responses = turn_slice(tensors["responses"], pad_token_id)
    full_attention = torch.cat([prompt_attention, in_turn.to(attention.dtype)], dim=1)
    out = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": full_attention,
        "position_ids": compute_position_id_with_mask(full_attention).to(tensors["position_ids"].dtype),
    }
    rows = torch.arange(len(plan))
    for key, values in tensors.items():
        if key in out:
            continue
        if key == "rm_scores":
            # v1: every output of a session carries the final output's reward; here on each turn's last token.
            score = values.sum(-1)[source].masked_fill(padding, 0)
            scores = torch.zeros((len(plan), response_width), dtype=values.dtype)
            scores[rows, (length - 1).clamp(min=0)] = score
            out[key] = scores
        elif values.dim() >= 2 and values.shape[1] == response_width:
            out[key] = turn_slice(values, _RESPONSE_FILL.get(key, 0))
        elif values.dim() >= 2 and values.shape[1] in (prompt_width, prompt_width + response_width):
            raise ValueError(
                f"{_KEY}: batch tensor {key!r} of shape {tuple(values.shape)} is laid out over the prompt or the whole "
                "sequence, which this cut does not know how to rebuild; set balance.rows=trajectory"
            )
        else:  # per-row values (e.g. verl's dataset ``dummy_tensor`` of shape [B, 1])
            out[key] = values[source]
    out["response_mask"] = out["response_mask"].masked_fill(padding[:, None], 0)
    return out


def _trajectory_ids(uid: np.ndarray | None, plan: TransitionPlan) -> np.ndarray:
    """``<uid>/<row>`` per transition (unique: a uid's rollout.n rows differ in row), ``pad/<k>`` on padding."""
    prefix = uid[plan.source] if uid is not None else np.full(len(plan), "row", dtype=object)
    ids = [f"{p}/{s}" for p, s in zip(prefix, plan.source, strict=True)]
    for k, row in enumerate(np.flatnonzero(plan.is_padding)):
        ids[row] = f"pad/{k}"
    return np.array(ids, dtype=object)


def trajectories_split(batch: DataProto, *, dp_size: int, mini_batch_size_samples: int) -> dict[str, float]:
    """``balance/trajectories_split``: trajectories whose transitions sit in more than one mini-batch, in the
    batch's current (final) order, whatever ``balance.group_key`` was balanced on."""
    ids = batch.non_tensor_batch[TRAJECTORY_ID]
    stats = evaluate_permutation(
        list(range(len(ids))), np.ones(len(ids)), ids, dp_size=dp_size, mini_batch_size=mini_batch_size_samples
    )
    return {"balance/trajectories_split": float(stats.groups_split)}


def transition_advantage(data: DataProto, compute_advantage: Callable[..., DataProto], **kwargs: Any) -> DataProto:
    """GRPO on the final transition of every trajectory, broadcast to its transitions (verl v1's rule).

    ``compute_advantage`` is verl's own (``ray_trainer.compute_advantage``), called on the final transitions only,
    so the group baseline and std are those of the trajectories, exactly as without transitions. ``advantages``
    and ``returns`` of every row become the trajectory's scalar times the row's ``response_mask`` (0 on padding).
    """
    final = np.flatnonzero(data.non_tensor_batch[IS_FINAL].astype(bool))
    final_data = data.select_idxs(final)
    final_data.meta_info.pop(TRANSITIONS_META, None)  # a plain batch of trajectories for verl's own function
    final_data = compute_advantage(final_data, **kwargs)
    first_token = final_data.batch["response_mask"].argmax(dim=1)
    final_scores = final_data.batch["advantages"][torch.arange(len(final)), first_token]
    ids = data.non_tensor_batch[TRAJECTORY_ID]
    position = {tid: i for i, tid in enumerate(ids[final])}
    lookup = torch.tensor([position.get(tid, -1) for tid in ids], dtype=torch.long)
    scores = torch.where(lookup >= 0, final_scores[lookup.clamp(min=0)], torch.zeros_like(final_scores[:1]))
    advantages = scores.unsqueeze(-1) * data.batch["response_mask"]
    data.batch["advantages"] = advantages
    data.batch["returns"] = advantages.clone()
    return data
