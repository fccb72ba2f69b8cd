"""DAPO's dynamic sampling with partial rollout through ``python -m verl.trainer.main_ppo +partial=default``.

``algorithm.filter_groups.enable=true`` with a reward that gives every sample of one prompt in three the same score
(and random scores otherwise): whole groups are judged on verl's reward loop while the step generates, uniform ones are
never trained and are counted, every step still trains ``train_batch_size`` whole groups, and the rewards the filter
read are the ones trained (the hand-over reuses them instead of scoring again).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import ledger, run_trainer

pytestmark = pytest.mark.e2e

STEPS, GROUPS, N = 3, 8, 4

REWARD = """
import random


def uniform(extra_info):
    return int((extra_info or {}).get("index", 0)) % 3 == 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = 1.0 if uniform(extra_info) else random.random()
    return {"score": score, "acc": score, "uniform": float(uniform(extra_info))}
"""


def test_uniform_groups_are_filtered_and_each_step_trains_a_full_batch(demo_assets, tmp_path):
    reward = tmp_path / "uniform_reward.py"
    reward.write_text(REWARD)
    assets = dataclasses.replace(demo_assets, reward_fn_path=reward, reward_fn_name="compute_score")
    run = run_trainer(
        assets,
        tmp_path,
        steps=STEPS,
        partial="default",
        extra=[
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=10",
            f"partial.dump_dir={tmp_path / 'dump'}",
            f"partial.ledger_path={tmp_path / 'ledger.jsonl'}",
        ],
    )
    run.assert_ok()
    events = ledger(tmp_path / "ledger.jsonl")
    filtered = {e["key"] for e in events if e["event"] == "filtered"}
    trained: list[str] = []
    for step in range(1, STEPS + 1):
        dump = torch.load(tmp_path / "dump" / f"step_{step}.pt")
        keys = [sample["key"] for sample in dump["samples"]]
        assert len(set(keys)) == GROUPS and all(keys.count(key) == N for key in set(keys))
        assert all(int(sample["prompt_id"]) % 3 != 0 for sample in dump["samples"]), "a uniform group was trained"
        trained += sorted(set(keys))
        assert run.metric(step, "critic/score/mean") < 1.0  # the trained rewards are the random ones
    assert filtered, "no group was filtered: the reward was not read at hand-over"
    assert not filtered & set(trained)
    assert len(trained) == len(set(trained))
    assert sum(run.metric(step, "partial/filtered_groups") for step in range(1, STEPS + 1)) == len(filtered)
    assert run.metric(STEPS, "partial/total/filtered_groups") == len(filtered)
    assert all(run.metric(step, "partial/filtered_tokens") >= 0 for step in range(1, STEPS + 1))
