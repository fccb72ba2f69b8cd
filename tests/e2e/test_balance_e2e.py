"""Group-preserving balancing in verl's trainer with 2 data-parallel FSDP ranks (and 2 CPU replicas)."""

from __future__ import annotations

import pytest
from harness import run_trainer

pytestmark = pytest.mark.e2e

# 8 prompts x 4 samples = 32 rows; ppo_mini_batch_size 4 prompts -> 2 optimizer steps of 16 rows.
TWO_RANKS = (
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.test_freq=0",
)


def test_groups_stay_in_one_mini_batch_with_two_ranks_and_partial_rollout(demo_assets, tmp_path):
    run = run_trainer(demo_assets, tmp_path, steps=2, partial="default", extra=[*TWO_RANKS, "+balance=group"])
    run.assert_ok()
    for step in (1, 2):
        assert run.metric(step, "balance/groups_split") == 0
        assert run.metric(step, "balance/efficiency") >= 1.0
        # Invariant 10: every resumed segment went back to the replica holding its prefix.
        assert run.metric(step, "partial/route_changes") == 0
