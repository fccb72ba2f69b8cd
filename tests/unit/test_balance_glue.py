"""The verl adapter on a real ``verl.DataProto``."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import verl
from omegaconf import OmegaConf
from verl import DataProto
from verl.utils.seqlen_balancing import calculate_workload

from verl_partial.config.balance import BalanceConfig
from verl_partial.config.job import check_balance_against_trainer, check_balance_critic
from verl_partial.core.balance.eval import evaluate_permutation
from verl_partial.glue import trainer_hooks
from verl_partial.glue.dataproto import balance_batch_by_group, flops_per_sample, sample_costs


def make_batch(group_sizes, seed=0, max_len=64, key="uid"):
    rng = np.random.default_rng(seed)
    n = int(sum(group_sizes))
    lengths = np.minimum(max_len, 1 + rng.lognormal(2.5, 0.8, n).astype(int))
    mask = torch.zeros(n, max_len, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, max_len - length :] = 1  # left-padded like verl's prompt+response layout
    ids = np.repeat([f"g{i}" for i in range(len(group_sizes))], group_sizes).astype(object)
    batch = DataProto.from_dict(
        tensors={"attention_mask": mask, "row_id": torch.arange(n)},
        non_tensors={key: ids, "data_source": np.array(["x"] * n, dtype=object)},
    )
    return batch, lengths, ids


def test_reorders_in_place_and_reports_metrics():
    batch, lengths, ids = make_batch([8] * 32)
    cfg = BalanceConfig(enable=True)
    metrics = balance_batch_by_group(batch, config=cfg, dp_size=4, mini_batch_size_samples=64)

    row_id = batch.batch["row_id"].numpy()
    assert sorted(row_id.tolist()) == list(range(256))
    # tensors and non-tensors moved together
    assert (batch.non_tensor_batch["uid"] == ids[row_id]).all()
    assert (batch.batch["attention_mask"].sum(-1).numpy() == lengths[row_id]).all()

    workload = calculate_workload(torch.tensor(lengths, dtype=torch.long)).double().numpy()
    measured = evaluate_permutation(row_id, workload, ids, dp_size=4, mini_batch_size=64)
    assert metrics["balance/groups_split"] == 0 == measured.groups_split
    assert metrics["balance/efficiency"] == pytest.approx(measured.efficiency)
    assert metrics["balance/num_minibatches"] == 4
    assert metrics["balance/num_groups"] == 32
    for key in (
        "balance/efficiency_bound",
        "balance/minibatch_max_rank_cost_mean",
        "balance/minibatch_max_rank_cost_max",
        "balance/minibatch_mean_rank_cost_mean",
        "balance/groups_split_across_ranks",
        "balance/fallback_groups_split",
        "balance/rank_fallback_minibatches",
        "balance/time_ms",
    ):
        assert isinstance(metrics[key], float), key


def test_disabled_is_a_no_op():
    batch, _, ids = make_batch([4] * 8)
    assert balance_batch_by_group(batch, config=BalanceConfig(), dp_size=2, mini_batch_size_samples=8) == {}
    assert batch.batch["row_id"].tolist() == list(range(32))


def test_missing_group_key_names_config_key_and_available_keys():
    batch, _, _ = make_batch([4] * 8)
    cfg = BalanceConfig(enable=True, group_key="rollout_id")
    with pytest.raises(ValueError) as err:
        balance_batch_by_group(batch, config=cfg, dp_size=2, mini_batch_size_samples=8)
    msg = str(err.value)
    assert "balance.group_key='rollout_id'" in msg and "'data_source'" in msg and "'uid'" in msg


def test_multi_turn_unequal_groups_with_custom_key_and_keep_on_rank():
    sizes = [3, 5, 8, 2, 6, 4, 4, 7, 1, 8, 8, 8]  # 64 transitions from 12 rollouts
    batch, _, ids = make_batch(sizes, key="rollout_id", seed=3)
    cfg = BalanceConfig(enable=True, group_key="rollout_id", cost="tokens", keep_group_on_rank=True)
    metrics = balance_batch_by_group(batch, config=cfg, dp_size=2, mini_batch_size_samples=32)
    assert metrics["balance/groups_split"] == 0
    if metrics["balance/rank_fallback_minibatches"] == 0:
        assert metrics["balance/groups_split_across_ranks"] == 0


def test_infeasible_raises_and_leaves_batch_untouched():
    batch, _, _ = make_batch([6, 6, 6, 2])
    with pytest.raises(ValueError, match="exactly 10 samples"):
        balance_batch_by_group(batch, config=BalanceConfig(enable=True), dp_size=2, mini_batch_size_samples=10)
    assert batch.batch["row_id"].tolist() == list(range(20))
    cfg = BalanceConfig(enable=True, on_infeasible="split")
    metrics = balance_batch_by_group(batch, config=cfg, dp_size=2, mini_batch_size_samples=10)
    assert metrics["balance/fallback_groups_split"] == metrics["balance/groups_split"] == 1


def test_cost_models():
    seqlen = torch.tensor([1, 10, 100, 1000])
    assert np.array_equal(sample_costs(seqlen, "tokens"), [1, 10, 100, 1000])
    assert np.array_equal(sample_costs(seqlen, "workload"), calculate_workload(seqlen).double().numpy())

    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_params=1000)
    expected = [2 * 1000 * L + 2 * 2 * 8 * L * L for L in (1, 10, 100, 1000)]
    assert np.allclose(sample_costs(seqlen, "flops", cfg), expected)

    # parameter count estimated from the architecture (GQA-aware) when num_params is absent
    qwen_like = SimpleNamespace(
        num_hidden_layers=2,
        hidden_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=2,
        intermediate_size=16,
        vocab_size=10,
    )
    n_params = 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16) + 10 * 8
    assert flops_per_sample(torch.tensor([3]), qwen_like).item() == pytest.approx(2 * n_params * 3 + 2 * 2 * 8 * 9)

    with pytest.raises(ValueError, match="model_config"):
        sample_costs(seqlen, "flops")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        sample_costs(seqlen, "flops", SimpleNamespace(hidden_size=8))


def test_unhashable_group_key_values_name_the_config_key():
    batch, _, _ = make_batch([4] * 8)
    rows = np.empty(32, dtype=object)
    rows[:] = [[i // 4] for i in range(32)]  # a list per row: groups cannot be told apart by hashing
    batch.non_tensor_batch["turn_ids"] = rows
    cfg = BalanceConfig(enable=True, group_key="turn_ids")
    with pytest.raises(ValueError, match=r"balance\.group_key='turn_ids' must name a column of hashable values"):
        balance_batch_by_group(batch, config=cfg, dp_size=2, mini_batch_size_samples=8)
    assert batch.batch["row_id"].tolist() == list(range(32))


# ---------------------------------------------------------------------------------------------------------
# trainer-level checks: the critic trains on the same order, so it must cut mini-batches like the actor
# ---------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def composed(**dotted: object):
    """verl's generated ppo_trainer config + ``+balance=group`` (what main_ppo composes), with overrides."""
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    config = OmegaConf.merge(config, OmegaConf.load(REPO / "hydra_configs" / "balance" / "group.yaml"))
    for key, value in dotted.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"critic.shuffle": True}, "critic.shuffle must be false"),
        ({"critic.ppo_mini_batch_size": 48}, "critic.ppo_mini_batch_size=48 must be a multiple of"),
    ],
)
def test_critic_that_would_split_groups_fails_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        check_balance_against_trainer(composed(**{"algorithm.adv_estimator": "gae", **overrides}))
    # the same critic settings are fine when no critic runs (GRPO) or balancing is off
    check_balance_against_trainer(composed(**{"algorithm.adv_estimator": "grpo", **overrides}))
    check_balance_against_trainer(composed(**{"algorithm.adv_estimator": "gae", "balance.enable": False, **overrides}))


def test_default_critic_follows_the_actor_and_passes():
    config = composed(**{"algorithm.adv_estimator": "gae"})
    check_balance_against_trainer(config)
    # a critic mini-batch of two whole actor mini-batches keeps every group in one critic step
    actor_mb = config.actor_rollout_ref.actor.ppo_mini_batch_size
    check_balance_against_trainer(
        composed(**{"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 2 * actor_mb})
    )
    check_balance_critic(config, critic_dp_size=4, actor_dp_size=4)
    with pytest.raises(ValueError, match=r"critic's data-parallel size \(2\) must equal the actor's \(4\)"):
        check_balance_critic(config, critic_dp_size=2, actor_dp_size=4)


def test_flops_model_config_is_read_once(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(num_hidden_layers=2, hidden_size=8, num_attention_heads=2).save_pretrained(tmp_path)
    first = trainer_hooks._model_config(str(tmp_path))
    (tmp_path / "config.json").unlink()  # a second read from disk would now fail
    assert trainer_hooks._model_config(str(tmp_path)) is first
    assert first.num_hidden_layers == 2
