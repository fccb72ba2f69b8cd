"""The one adapter between verl's ``DataProto`` and our algorithms: every place that builds or reads one.

Uses only ``DataProto``'s public API. Four parts, moved here unchanged from the modules that held them:
balancing, transitions, rollout correction's per-token metrics and mask, and partial rollout's hand-over and step
payload. Elsewhere ``DataProto`` only travels (Ray calls, verl's own methods) and names types.

**Balancing.** verl adapter for group-preserving balancing: DataProto in, reordered DataProto + ``balance/`` metrics
out.

This is the only balancing module that touches verl. It computes per-sample costs exactly the way verl's
``RayPPOTrainer._balance_batch`` does (sequence length = ``attention_mask`` row sum, workload via verl's
own ``calculate_workload``) so that ``balance/*`` and verl's ``global_seqlen/*`` metrics describe the same
quantity, hands them to :mod:`verl_partial.core.balance.groups` and applies the permutation in place.

Call it where verl calls ``_balance_batch`` (after generation, before old-log-prob/advantages): nothing in
between may reorder the batch, and the actor must split mini-batches in order (``actor.shuffle=False``).

**Transitions.** verl adapter for ``balance.rows=transition``: a multi-turn ``DataProto`` cut into one row per model
turn.

Runs where verl calls ``_balance_batch`` (after the rollout/prompt union, ``rm_scores`` present, before the
old log-probs), so every later stage -- log-probs, reference, rollout correction, advantages, the actor's
mini-batches -- sees transitions. The plan (turn spans, padding) is :mod:`verl_partial.core.balance.transitions`; this
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

**Rollout correction.** ``compute_lag_split_metrics`` reruns verl's own metric function per version lag;
``apply_staleness_mask`` drops tokens older than ``max_staleness`` versions (:mod:`verl_partial.glue.correction`).

**Partial rollout.** The hand-over's rows (:mod:`verl_partial.glue.partial.rollout` keeps the Ray calls, the worker
in :mod:`verl_partial.glue.partial.agent_loop` verl's postprocessing): ``group_keys`` and ``is_validation`` read
what ``fit()`` asks for, ``hand_over_rows`` and ``row_chunks`` make the workers' chunks, ``row_fields`` gives a
worker each row's columns, ``concat_chunks``, ``attach_versions`` (per-token policy versions) and
``set_hand_over_meta`` assemble the output. The step payload in ``meta_info`` (``pop_step_meta``,
``read_step_meta``, ``add_step_metrics``) and the flags the trainer hooks test (``has_policy_versions``,
``is_cut_into_transitions``) are read here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.utils.model import compute_position_id_with_mask
from verl.utils.seqlen_balancing import calculate_workload

from verl_partial.config.balance import BalanceConfig
from verl_partial.config.correction import BLOCK, RolloutCorrectionConfig, to_verl_fields
from verl_partial.core.balance.eval import evaluate_permutation
from verl_partial.core.balance.groups import balance_groups
from verl_partial.core.balance.transitions import TransitionPlan, plan_transitions
from verl_partial.core.correction.math import mask_stale_tokens, split_by_lag, token_lags
from verl_partial.core.partial.pool import SampleState

__all__ = [
    "balance_batch_by_group",
    "measure_batch_order",
    "sample_costs",
    "flops_per_sample",
    "TRANSITIONS_META",
    "TRAJECTORY_ID",
    "TURN_INDEX",
    "IS_FINAL",
    "IS_PADDING",
    "expand_to_transitions",
    "trajectories_split",
    "transition_advantage",
    "compute_lag_split_metrics",
    "apply_staleness_mask",
    "POLICY_VERSION_KEY",
    "STALE_TOKENS_METRIC",
    "PARTIAL_KEY",
    "STEP_META_KEY",
    "group_keys",
    "is_validation",
    "hand_over_rows",
    "row_chunks",
    "row_fields",
    "concat_chunks",
    "attach_versions",
    "set_hand_over_meta",
    "response_tokens",
    "pop_step_meta",
    "read_step_meta",
    "add_step_metrics",
    "has_policy_versions",
    "is_cut_into_transitions",
]


# -------------------- balancing


def _attr(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def flops_per_sample(seqlen: torch.Tensor, model_config: Any) -> torch.Tensor:
    """Forward FLOPs of one sequence of length L (training adds a constant factor that cancels in balancing).

    cost(L) = 2 * N_params * L + 2 * num_layers * L**2 * hidden

    * ``2 * N_params * L``: every weight does one multiply-add per token (dense matmuls, LM head included).
    * ``2 * num_layers * L**2 * hidden``: attention scores (Q K^T) and the weighted sum (A V) are
      2 * L**2 * hidden FLOPs each per layer without masking; a causal mask halves their sum to 2 * L**2 * hidden.

    ``model_config`` is any object with attributes (a HF ``PretrainedConfig`` works):
    ``num_hidden_layers`` (or ``num_layers``), ``hidden_size``, and optionally ``num_params``. Without
    ``num_params`` the parameter count is estimated per layer as attention q/o (2*h*h) + k/v
    (2*h*kv_heads*head_dim, GQA-aware when ``num_key_value_heads``/``head_dim`` exist) + MLP
    (3*h*intermediate_size for gated MLPs, else 8*h*h), plus the LM head (vocab_size*h) when
    ``vocab_size`` is given. Embedding lookups are not FLOPs and are not counted.
    """
    layers = _attr(model_config, "num_hidden_layers", "num_layers", "n_layer")
    hidden = _attr(model_config, "hidden_size", "n_embd", "d_model")
    if layers is None or hidden is None:
        raise ValueError(
            "balance.cost=flops needs a model config with num_hidden_layers (or num_layers) and hidden_size; "
            f"got {type(model_config).__name__}"
        )
    layers, hidden = int(layers), int(hidden)
    n_params = _attr(model_config, "num_params")
    if n_params is None:
        heads = _attr(model_config, "num_attention_heads")
        kv_heads = _attr(model_config, "num_key_value_heads") or heads
        head_dim = _attr(model_config, "head_dim") or (hidden // int(heads) if heads else None)
        kv_width = int(kv_heads) * int(head_dim) if kv_heads and head_dim else hidden
        inter = _attr(model_config, "intermediate_size")
        mlp = 3 * hidden * int(inter) if inter else 8 * hidden * hidden
        per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + mlp
        vocab = _attr(model_config, "vocab_size")
        n_params = layers * per_layer + (int(vocab) * hidden if vocab else 0)
    length = seqlen.to(torch.float64)
    return 2.0 * float(n_params) * length + 2.0 * layers * hidden * length**2


def sample_costs(seqlen: torch.Tensor, cost: str, model_config: Any = None) -> np.ndarray:
    """Per-sample cost for ``balance.cost`` (see :class:`BalanceConfig`) as float64 numpy."""
    seqlen = seqlen.long()  # int64: verl's workload overflows int32 beyond L ~ 46k
    if cost == "workload":
        out = calculate_workload(seqlen)
    elif cost == "tokens":
        out = seqlen
    elif cost == "flops":
        if model_config is None:
            raise ValueError("balance.cost=flops needs model_config (the actor model's config object)")
        out = flops_per_sample(seqlen, model_config)
    else:  # BalanceConfig validates; this guards direct calls
        raise ValueError(f"balance.cost must be one of ['workload', 'tokens', 'flops'], got {cost!r}")
    return out.detach().cpu().to(torch.float64).numpy()


def balance_batch_by_group(
    batch: DataProto,
    *,
    config: BalanceConfig,
    dp_size: int,
    mini_batch_size_samples: int,
    model_config: Any = None,
) -> dict[str, float]:
    """Reorder ``batch`` in place so groups stay in one mini-batch and ranks are balanced per mini-batch.

    Args:
        batch: The training batch (after generation and ``union``), with ``attention_mask`` and the group key.
        config: The ``balance`` block. With ``enable=False`` nothing happens and ``{}`` is returned.
        dp_size: Data-parallel size of the actor (what verl's dispatch chunks the batch into).
        mini_batch_size_samples: ``actor.ppo_mini_batch_size * rollout.n`` (global, in samples).
        model_config: Needed only for ``cost="flops"``.

    Returns:
        ``balance/*`` metrics (see docs/method/balance.md), including ``balance/time_ms``.

    Raises:
        ValueError: missing group key (naming ``balance.group_key`` and the available keys), incompatible
            sizes, or infeasible group sizes with ``on_infeasible="error"``.
    """
    if not config.enable:
        return {}
    keys, costs = _keys_and_costs(batch, config, model_config)

    start = time.perf_counter()
    result = balance_groups(
        costs,
        keys,
        dp_size=dp_size,
        mini_batch_size=mini_batch_size_samples,
        keep_group_on_rank=config.keep_group_on_rank,
        on_infeasible=config.on_infeasible,
    )
    elapsed_ms = (time.perf_counter() - start) * 1e3
    batch.reorder(torch.as_tensor(result.perm, dtype=torch.long))
    metrics = result.stats.to_metrics(prefix="balance/")
    metrics["balance/time_ms"] = elapsed_ms
    return metrics


def measure_batch_order(
    batch: DataProto, *, config: BalanceConfig, dp_size: int, mini_batch_size_samples: int, model_config: Any = None
) -> dict[str, float]:
    """``balance/*`` metrics of the batch's current order, e.g. after verl's own ``_balance_batch``."""
    keys, costs = _keys_and_costs(batch, config, model_config)
    stats = evaluate_permutation(
        list(range(len(costs))), costs, keys, dp_size=dp_size, mini_batch_size=mini_batch_size_samples
    )
    return stats.to_metrics(prefix="balance/")


def _keys_and_costs(batch: DataProto, config: BalanceConfig, model_config: Any) -> tuple[np.ndarray, np.ndarray]:
    keys = batch.non_tensor_batch.get(config.group_key)
    if keys is None:
        raise ValueError(
            f"balance.group_key={config.group_key!r} is not a non-tensor key of the batch; "
            f"available non-tensor keys: {sorted(batch.non_tensor_batch)}"
        )
    try:
        dict.fromkeys(keys)
    except TypeError as exc:
        raise ValueError(
            f"balance.group_key={config.group_key!r} must name a column of hashable values (str, int, tuple, ...): "
            f"rows with equal values form a group, but hashing one failed ({exc}). Point balance.group_key at a "
            "string or integer id column (e.g. 'uid', or a trajectory id)"
        ) from exc
    mask = batch.batch["attention_mask"]
    return keys, sample_costs(mask.reshape(mask.shape[0], -1).sum(-1), config.cost, model_config)


# -------------------- transitions

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


# -------------------- rollout correction

POLICY_VERSION_KEY = "rollout_policy_version"
STALE_TOKENS_METRIC = "rollout_corr/stale_tokens_masked"
# verl fields that select the loss, not the correction statistics.
_LOSS_FIELDS = ("bypass_mode", "loss_type")


def compute_lag_split_metrics(batch: DataProto, cfg: RolloutCorrectionConfig, current_version: int) -> dict[str, float]:
    """``rollout_corr/lag_{k}/...``: verl's rollout-correction metrics over the tokens of each lag k.

    Needs ``old_log_probs``, ``rollout_log_probs``, ``response_mask`` and the per-token int tensor
    ``rollout_policy_version`` in ``batch.batch``; returns ``{}`` without the latter or with
    ``log_by_lag`` off. Each lag gets ``token_fraction`` (its share of valid tokens) and, in
    decoupled mode, every metric of verl's ``compute_rollout_correction_and_rejection_mask`` under
    ``cfg`` (IS, RS, KL, PPL, chi2), computed on the rows holding that lag with only its tokens
    unmasked. In bypass mode π_old is π_rollout on the driver, so only ``token_fraction`` is logged.
    """
    tensors = batch.batch
    if not cfg.log_by_lag or POLICY_VERSION_KEY not in tensors.keys():
        return {}
    response_mask = tensors["response_mask"]
    lags = token_lags(tensors[POLICY_VERSION_KEY], current_version, response_mask)
    total_tokens = int(response_mask.bool().sum())
    verl_kwargs = {key: value for key, value in to_verl_fields(cfg).items() if key not in _LOSS_FIELDS}
    metrics: dict[str, float] = {}
    for lag_slice in split_by_lag(lags, response_mask):
        prefix = f"rollout_corr/lag_{lag_slice.lag}/"
        metrics[prefix + "token_fraction"] = lag_slice.num_tokens / total_tokens
        if cfg.bypass_mode:
            continue
        _, _, lag_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=tensors["old_log_probs"][lag_slice.rows],
            rollout_log_prob=tensors["rollout_log_probs"][lag_slice.rows],
            response_mask=lag_slice.mask,
            **verl_kwargs,
        )
        metrics.update({prefix + key.removeprefix("rollout_corr/"): value for key, value in lag_metrics.items()})
    return metrics


def apply_staleness_mask(batch: DataProto, cfg: RolloutCorrectionConfig, current_version: int) -> dict[str, float]:
    """Zero ``response_mask`` for tokens older than ``cfg.max_staleness`` versions; count them.

    A no-op returning ``{}`` when ``max_staleness`` is null. Replaces the mask tensor rather
    than editing it in place, as verl's own rejection sampling does, so views taken earlier keep
    the unmasked values.
    """
    if cfg.max_staleness is None:
        return {}
    tensors = batch.batch
    if POLICY_VERSION_KEY not in tensors.keys():
        raise ValueError(
            f"{BLOCK}.max_staleness={cfg.max_staleness} needs the per-token {POLICY_VERSION_KEY!r} "
            "tensor in the batch (written by partial rollout); without it no token's age is known"
        )
    lags = token_lags(tensors[POLICY_VERSION_KEY], current_version, tensors["response_mask"])
    tensors["response_mask"], masked = mask_stale_tokens(tensors["response_mask"], lags, cfg.max_staleness)
    return {STALE_TOKENS_METRIC: float(masked)}


# -------------------- partial rollout: hand-over and the step payload

# The group key ``PartialRolloutLoader`` puts in each prompt row, so the hand-over finds the row's samples.
PARTIAL_KEY = "partial_key"
# Our per-step payload in ``meta_info`` (metrics, moved generation time, the policy version of the step).
STEP_META_KEY = "verl_partial"


def group_keys(prompts: DataProto) -> np.ndarray | None:
    """Each row's partial-rollout group key, or None when the rows are not partial rollout's (other trainer paths)."""
    return prompts.non_tensor_batch.get(PARTIAL_KEY)


def is_validation(prompts: DataProto) -> bool:
    """Whether verl asks to generate for validation (``meta_info["validate"]``)."""
    return bool(prompts.meta_info.get("validate", False))


def hand_over_rows(prompts: DataProto) -> DataProto:
    """The prompt rows the workers build outputs for: ``prompts`` without our group key and without ``meta_info``
    (shares the tensors)."""
    rows = DataProto(batch=prompts.batch, non_tensor_batch=dict(prompts.non_tensor_batch), meta_info={})
    rows.non_tensor_batch.pop(PARTIAL_KEY)
    return rows


def row_chunks(rows: DataProto, bounds: list[tuple[int, int]]) -> list[DataProto]:
    """``rows`` cut at ``bounds`` (``[start, stop)`` row ranges), one chunk per worker."""
    return [rows[start:stop] for start, stop in bounds]


def row_fields(rows: DataProto, samples: int) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """A chunk's non-tensor columns and, per row, its own values (the keyword arguments of verl's
    ``_agent_loop_postprocess``); refuses a chunk whose row count is not the number of samples."""
    if len(rows) != samples:
        raise ValueError(f"hand-over of {samples} samples for {len(rows)} rows")
    fields = rows.non_tensor_batch
    return fields, [{key: value[index] for key, value in fields.items()} for index in range(samples)]


def concat_chunks(outputs: list[DataProto]) -> tuple[DataProto, list[Any]]:
    """The workers' outputs as one batch, and each chunk's agent-loop metrics (taken out of its ``meta_info``,
    as verl's ``AgentLoopManager.generate_sequences`` does before ``_performance_metrics``)."""
    row_metrics = [output.meta_info.pop("metrics") for output in outputs]
    return DataProto.concat(outputs), row_metrics


def attach_versions(output: DataProto, samples: list[SampleState], response_length: int) -> None:
    """Add the per-token policy versions (``rollout_policy_version``, int32, -1 past the response and on tool output)
    of ``samples``, row ``i`` being ``samples[i]``."""
    versions = torch.full((len(samples), response_length), -1, dtype=torch.int32)
    for row, sample in enumerate(samples):
        # Multi-turn: the trajectory's own per-token versions (-1 on tool output), as trained.
        row_versions = sample.versions if sample.payload is None else sample.payload["versions"][:response_length]
        versions[row, : len(row_versions)] = torch.from_numpy(row_versions)
    output.batch[POLICY_VERSION_KEY] = versions


def set_hand_over_meta(output: DataProto, timing: dict[str, float], step_meta: dict[str, Any]) -> None:
    """The hand-over's ``meta_info``: the workers' own entries but their metrics, verl's ``timing`` and our step
    payload."""
    output.meta_info = {
        **{k: v for k, v in output.meta_info.items() if k != "metrics"},
        "timing": timing,
        STEP_META_KEY: step_meta,
    }


def response_tokens(output: DataProto) -> torch.Tensor:
    """The padded response ids verl trains on, one row per sample."""
    return output.batch["responses"]


def pop_step_meta(batch: DataProto) -> dict[str, Any] | None:
    """Take our step payload out of ``meta_info`` (None when partial rollout did not make the batch)."""
    return batch.meta_info.pop(STEP_META_KEY, None)


def read_step_meta(batch: DataProto) -> dict[str, Any] | None:
    """Our step payload, left in place (None when partial rollout did not make the batch)."""
    return batch.meta_info.get(STEP_META_KEY)


def add_step_metrics(batch: DataProto, metrics: dict[str, float]) -> None:
    """Queue metrics in our step payload, for the step's log line; nothing when there are none."""
    if metrics:
        payload = batch.meta_info.setdefault(STEP_META_KEY, {})
        payload.setdefault("metrics", {}).update(metrics)


def has_policy_versions(batch: DataProto) -> bool:
    """Whether the batch holds partial rollout's per-token policy versions."""
    return POLICY_VERSION_KEY in batch.batch.keys()


def is_cut_into_transitions(batch: DataProto) -> bool:
    """Whether ``expand_to_transitions`` cut the batch (``balance.rows=transition``)."""
    return bool(batch.meta_info.get(TRANSITIONS_META, False))
