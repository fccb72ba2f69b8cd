"""``balance.rows=transition``: the pure plan, the cut of a real ``verl.DataProto``, advantages and padding loss."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils.model import compute_position_id_with_mask

from verl_partial.config.balance import BalanceConfig
from verl_partial.core.balance.transitions import padding_rows, plan_transitions, turn_spans
from verl_partial.glue import trainer_hooks
from verl_partial.glue.dataproto import (
    IS_FINAL,
    IS_PADDING,
    TRAJECTORY_ID,
    TRANSITIONS_META,
    TURN_INDEX,
    expand_to_transitions,
    trajectories_split,
    transition_advantage,
)

PAD = 0


# ------------------------------------------------------------------------------------------------ core plan
def test_turn_spans_are_maximal_runs_of_model_tokens():
    assert turn_spans(np.array([1, 1, 0, 0, 1, 0, 1, 1, 1])) == [(0, 2), (4, 5), (6, 9)]
    assert turn_spans(np.array([0, 0, 1, 1])) == [(2, 4)]
    assert turn_spans(np.zeros(5)) == []
    assert turn_spans(np.ones(3)) == [(0, 3)]


def test_padding_rows():
    assert [padding_rows(n, 16) for n in (16, 17, 31, 32, 1)] == [0, 15, 1, 0, 15]
    with pytest.raises(ValueError):
        padding_rows(3, 0)


def test_plan_covers_every_turn_pads_to_the_multiple_and_marks_finals():
    mask = np.array(
        [
            [1, 1, 0, 0, 1, 1, 0, 0],  # two turns, tool output between
            [1, 1, 1, 0, 0, 0, 0, 0],  # one turn
            [1, 0, 0, 1, 0, 0, 0, 0],  # two turns, trailing tool output dropped
            [0, 0, 0, 0, 0, 0, 0, 0],  # no model token: one fully masked transition keeps its reward
        ]
    )
    lengths = np.array([6, 3, 6, 2])
    plan = plan_transitions(mask, lengths, np.array([5, 5, 2, 5]), row_multiple=4)
    assert plan.num_transitions == 6 and plan.num_padding == 2 and len(plan) == 8
    assert plan.source[:6].tolist() == [0, 0, 1, 2, 2, 3]
    assert list(zip(plan.start[:6].tolist(), plan.end[:6].tolist(), strict=True)) == [
        (0, 2),
        (4, 6),
        (0, 3),
        (0, 1),
        (3, 4),
        (0, 2),
    ]
    assert plan.turn[:6].tolist() == [0, 1, 0, 0, 1, 0]
    assert plan.is_final.tolist() == [False, True, True, False, True, True, False, False]
    assert plan.final_row.tolist() == [1, 2, 4, 5]
    # Padding repeats the cheapest transition (row 2's first turn: 2 prompt + 1 response tokens).
    assert plan.source[6:].tolist() == [2, 2] and plan.end[6:].tolist() == [1, 1]
    assert plan.is_padding.tolist() == [False] * 6 + [True] * 2


def test_config_names_the_key_and_allowed_values():
    assert BalanceConfig().rows == "trajectory"
    with pytest.raises(ValueError, match=r"balance.rows must be one of \['trajectory', 'transition'\]"):
        BalanceConfig(rows="turns")


# ------------------------------------------------------------------------------------------- verl DataProto
P, R = 6, 14


def multi_turn_batch(seed: int = 0, n_prompts: int = 3, n: int = 2) -> DataProto:
    """Left-padded prompts, right-padded responses of 1-3 model turns separated by tool output, as the agent
    loop returns them (reward on the last response token)."""
    rng = np.random.default_rng(seed)
    rows = n_prompts * n
    prompts = torch.full((rows, P), PAD)
    prompt_mask = torch.zeros((rows, P), dtype=torch.long)
    responses = torch.full((rows, R), PAD)
    response_attention = torch.zeros((rows, R), dtype=torch.long)
    response_mask = torch.zeros((rows, R), dtype=torch.long)
    for row in range(rows):
        plen = int(rng.integers(2, P + 1))
        prompts[row, P - plen :] = torch.as_tensor(rng.integers(10, 100, plen))
        prompt_mask[row, P - plen :] = 1
        pattern = []
        for turn in range(int(rng.integers(1, 4))):
            if turn:
                pattern += [0] * int(rng.integers(1, 3))  # tool output
            pattern += [1] * int(rng.integers(1, 3))
        if rng.random() < 0.3:
            pattern += [0]  # trailing tool output
        length = len(pattern)
        responses[row, :length] = torch.as_tensor(rng.integers(100, 200, length))
        response_attention[row, :length] = 1
        response_mask[row, :length] = torch.as_tensor(pattern)
    attention = torch.cat([prompt_mask, response_attention], dim=1)
    log_probs = torch.as_tensor(rng.normal(size=(rows, R)), dtype=torch.float32) * response_mask
    versions = torch.where(response_mask == 1, torch.as_tensor(rng.integers(0, 3, (rows, R))), -1).to(torch.int32)
    scores = torch.zeros((rows, R))
    lengths = response_attention.sum(-1)
    scores[torch.arange(rows), lengths - 1] = torch.as_tensor(rng.integers(0, 2, rows), dtype=torch.float32)
    uid = np.repeat([f"u{i}" for i in range(n_prompts)], n).astype(object)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": compute_position_id_with_mask(attention),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
            "rollout_policy_version": versions,
            "rm_scores": scores,
            "row_id": torch.arange(rows),
            "dummy_tensor": torch.arange(rows)[:, None] * 10,  # per-row, like verl's dataset dummy tensor
        },
        non_tensors={
            "uid": uid,
            "__num_turns__": np.array([int(rng.integers(2, 6)) for _ in range(rows)], dtype=object),
            "multi_modal_inputs": np.array([{} for _ in range(rows)], dtype=object),
        },
        meta_info={"global_steps": 1},
    )


def test_each_transition_is_the_original_tokens_up_to_its_turn():
    original = multi_turn_batch()
    batch = multi_turn_batch()
    metrics = expand_to_transitions(batch, row_multiple=8, pad_token_id=PAD)
    t, o = batch.batch, original.batch
    assert len(batch) % 8 == 0 and batch.meta_info[TRANSITIONS_META] and batch.meta_info["global_steps"] == 1
    real = ~batch.non_tensor_batch[IS_PADDING]
    assert metrics["balance/transition_rows"] == real.sum() > metrics["balance/trajectories"] == 6
    assert metrics["balance/padding_rows"] == len(batch) - real.sum()
    seen_turns: dict[int, list[int]] = {}
    for i in np.flatnonzero(real):
        src = int(t["row_id"][i])
        spans = turn_spans(o["response_mask"][src].numpy())
        turn = int(batch.non_tensor_batch[TURN_INDEX][i])
        start, end = spans[turn]
        seen_turns.setdefault(src, []).append(turn)
        length = end - start
        # prompt + response of the transition = the original row's valid tokens up to the end of the turn
        valid = t["input_ids"][i][t["attention_mask"][i] == 1]
        original_valid = o["input_ids"][src][o["attention_mask"][src] == 1]
        plen = int(o["attention_mask"][src, :P].sum())
        assert valid.tolist() == original_valid[: plen + end].tolist()
        assert t["prompts"][i][t["attention_mask"][i, : t["prompts"].shape[1]] == 1].tolist() == (
            original_valid[: plen + start].tolist()
        )
        assert t["responses"][i, :length].tolist() == o["responses"][src, start:end].tolist()
        assert (t["responses"][i, length:] == PAD).all()
        # log-probs and policy versions moved exactly (bitwise), nothing beyond the turn
        assert torch.equal(t["rollout_log_probs"][i, :length], o["rollout_log_probs"][src, start:end])
        assert (t["rollout_log_probs"][i, length:] == 0).all()
        assert torch.equal(t["rollout_policy_version"][i, :length], o["rollout_policy_version"][src, start:end])
        assert (t["rollout_policy_version"][i, length:] == -1).all()
        assert t["response_mask"][i].tolist() == [1] * length + [0] * (R - length)
        # positions of the kept tokens are the ones the model saw in the trajectory
        kept = t["position_ids"][i][t["attention_mask"][i] == 1]
        assert kept.tolist() == o["position_ids"][src][o["attention_mask"][src] == 1][: plen + end].tolist()
        # the trajectory's reward on the turn's last token
        assert t["rm_scores"][i].sum() == o["rm_scores"][src].sum() == t["rm_scores"][i, length - 1]
        assert batch.non_tensor_batch[TRAJECTORY_ID][i] == f"{original.non_tensor_batch['uid'][src]}/{src}"
        assert batch.non_tensor_batch["uid"][i] == original.non_tensor_batch["uid"][src]
        assert t["dummy_tensor"][i].tolist() == [src * 10]
        assert batch.non_tensor_batch["__num_turns__"][i] == original.non_tensor_batch["__num_turns__"][src]
        assert batch.non_tensor_batch[IS_FINAL][i] == (turn == len(spans) - 1)
    # every model turn of every trajectory became exactly one row
    for src in range(len(original)):
        assert sorted(seen_turns[src]) == list(range(len(turn_spans(o["response_mask"][src].numpy()))))
    pad = ~real
    assert (t["response_mask"][pad] == 0).all() and (t["rm_scores"][pad] == 0).all()
    pad_ids = batch.non_tensor_batch[TRAJECTORY_ID][pad]
    assert len(set(pad_ids)) == pad.sum() and set(batch.non_tensor_batch["uid"][pad]) == set(pad_ids)


def test_unknown_tensor_layout_is_refused_naming_the_key():
    batch = multi_turn_batch()
    batch.batch["odd"] = torch.zeros((len(batch), P + R))  # sequence-aligned, unknown to the cut
    with pytest.raises(ValueError, match=r"balance.rows=transition.*'odd'"):
        expand_to_transitions(batch, row_multiple=4, pad_token_id=PAD)


def _verl_compute_advantage():
    from verl.trainer.ppo import ray_trainer

    return inspect.unwrap(ray_trainer.compute_advantage)  # verl's own, without our wrapper


def test_grpo_advantages_are_the_trajectorys_broadcast_over_its_transitions():
    compute_advantage = _verl_compute_advantage()
    options = dict(adv_estimator="grpo", num_repeat=2, norm_adv_by_std_in_grpo=True)
    original = multi_turn_batch(seed=3, n_prompts=4)
    original.batch["token_level_rewards"] = original.batch["rm_scores"]
    expected = compute_advantage(original, **options).batch["advantages"]
    per_trajectory = expected.sum(-1) / original.batch["response_mask"].sum(-1)  # GRPO: one scalar per row

    batch = multi_turn_batch(seed=3, n_prompts=4)
    expand_to_transitions(batch, row_multiple=16, pad_token_id=PAD)
    batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
    transition_advantage(batch, compute_advantage, **options)
    advantages, mask = batch.batch["advantages"], batch.batch["response_mask"]
    assert torch.equal(batch.batch["returns"], advantages)
    assert per_trajectory.abs().max() > 0  # some group has unequal rewards: the check below can fail
    for i in range(len(batch)):
        if batch.non_tensor_batch[IS_PADDING][i]:
            assert (advantages[i] == 0).all()
            continue
        src = int(batch.batch["row_id"][i])
        assert torch.allclose(advantages[i], per_trajectory[src] * mask[i], atol=1e-6)


def test_trajectories_split_counts_the_final_order():
    batch = multi_turn_batch()
    expand_to_transitions(batch, row_multiple=4, pad_token_id=PAD)
    assert trajectories_split(batch, dp_size=1, mini_batch_size_samples=4)["balance/trajectories_split"] >= 0
    together = np.argsort(batch.non_tensor_batch[TRAJECTORY_ID], kind="stable")
    batch.reorder(torch.as_tensor(together))
    ids = batch.non_tensor_batch[TRAJECTORY_ID]
    # sorted by trajectory: only trajectories crossing a mini-batch boundary of 4 rows are split
    boundaries = sum(ids[k - 1] == ids[k] for k in range(4, len(ids), 4))
    assert trajectories_split(batch, dp_size=1, mini_batch_size_samples=4)["balance/trajectories_split"] == boundaries
    everything = trajectories_split(batch, dp_size=1, mini_batch_size_samples=len(ids))
    assert everything["balance/trajectories_split"] == 0


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_padding_rows_contribute_zero_loss(mode):
    """verl's own loss aggregation over a mini-batch with padding rows: same loss as without them, zero gradient
    into them, whatever their log-probs. verl passes the mini-batch row count as ``global_batch_size`` and the
    mask's token sum as ``batch_num_tokens``, both unchanged by a zero-mask row (padding only fills rows the
    mini-batch has anyway)."""
    batch = multi_turn_batch(seed=5)
    expand_to_transitions(batch, row_multiple=16, pad_token_id=PAD)
    pad = torch.as_tensor(batch.non_tensor_batch[IS_PADDING])
    assert pad.any()
    mask = batch.batch["response_mask"].float()
    rng = torch.Generator().manual_seed(0)
    log_prob = torch.randn(mask.shape, generator=rng).requires_grad_(True)
    advantages = torch.randn(len(batch), 1, generator=rng) * mask

    def loss(rows: torch.Tensor) -> torch.Tensor:
        loss_mat = -advantages[rows] * torch.exp(log_prob[rows] - log_prob[rows].detach())
        return agg_loss(
            loss_mat,
            mask[rows],
            mode,
            batch_num_tokens=mask[rows].sum(),
            global_batch_size=len(batch),
            loss_scale_factor=R,
        )

    full = loss(torch.arange(len(batch)))
    full.backward()
    assert (log_prob.grad[pad] == 0).all()
    assert (log_prob.grad[~pad].abs().sum()) > 0
    assert torch.allclose(full, loss(torch.nonzero(~pad).squeeze(1)))


# ------------------------------------------------------------------------------------- the trainer hooks
def _trainer(**balance):
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {
            "balance": {"enable": True, "group_key": "trajectory_id", "rows": "transition", **balance},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": 2}, "model": {"path": "-"}},
        }
    )
    return SimpleNamespace(config=config, tokenizer=SimpleNamespace(pad_token_id=PAD))


def _split_by_hand(ids: np.ndarray, mini_batch: int, dp: int) -> int:
    """verl's layout: rank r holds rows [r*N/dp, (r+1)*N/dp) and trains them in slices of mini_batch/dp rows."""
    shard, per_rank = len(ids) // dp, mini_batch // dp
    minibatches: dict[str, set[int]] = {}
    for position, tid in enumerate(ids):
        minibatches.setdefault(tid, set()).add((position % shard) // per_rank)
    return sum(len(found) > 1 for found in minibatches.values())


def test_hook_cuts_then_balances_by_trajectory():
    batch, metrics = multi_turn_batch(seed=7, n_prompts=4), {}
    trainer_hooks.balance_batch(_trainer(), batch, metrics, 2, verl_default=None)
    ids = batch.non_tensor_batch[TRAJECTORY_ID]
    assert len(batch) % 4 == 0 and metrics["balance/transition_rows"] > metrics["balance/trajectories"] == 8
    assert metrics["balance/trajectories_split"] == 0 == _split_by_hand(ids, 4, dp=2)
    assert metrics["balance/groups_split"] == 0 and metrics["balance/efficiency"] >= 1.0


def test_hook_measures_trajectories_split_by_another_order():
    """``balance.enable=false``: verl's own balancer runs on the transitions (here an order by turn, which tears
    trajectories apart) and ``balance/trajectories_split`` reports what that order did."""

    def by_turn(b, m):
        b.reorder(torch.as_tensor(np.argsort(b.non_tensor_batch[TURN_INDEX], kind="stable")))

    batch, metrics = multi_turn_batch(seed=7, n_prompts=4), {}
    trainer_hooks.balance_batch(_trainer(enable=False), batch, metrics, 1, verl_default=by_turn)
    expected = _split_by_hand(batch.non_tensor_batch[TRAJECTORY_ID], 4, dp=1)
    assert metrics["balance/trajectories_split"] == expected > 0


def test_advantage_hook_passes_plain_batches_through_and_refuses_other_estimators():
    compute_advantage = _verl_compute_advantage()
    plain = multi_turn_batch(seed=3)
    plain.batch["token_level_rewards"] = plain.batch["rm_scores"]
    out = trainer_hooks.transition_advantage(plain, compute_advantage, (), {"adv_estimator": "grpo", "num_repeat": 2})
    assert out.batch["advantages"].shape == plain.batch["response_mask"].shape and len(out) == len(plain)
    cut = multi_turn_batch(seed=3)
    expand_to_transitions(cut, row_multiple=4, pad_token_id=PAD)
    cut.batch["token_level_rewards"] = cut.batch["rm_scores"]
    with pytest.raises(ValueError, match="algorithm.adv_estimator=grpo"):
        trainer_hooks.transition_advantage(cut, compute_advantage, ("rloo",), {})
