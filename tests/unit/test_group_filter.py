"""DAPO's dynamic sampling (``algorithm.filter_groups``) under partial rollout, on the real pool and scheduler.

The rule (:mod:`verl_partial.core.partial.group_filter`) is v1's: a finished group whose metric has zero standard
deviation is never trained. Here the simulated engine of ``test_partial_scheduler`` generates, a scorer on the same
virtual clock stands in for verl's reward loop, and every prompt whose number is a multiple of three gets the same
reward in all its samples.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_partial_scheduler import check_groups, check_ledger, configs, simulate, wait_fits

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.group_filter import GroupFilter, SampleScore
from verl_partial.core.partial.pool import GroupState, RolloutPool

SCORE_S = 0.5  # virtual seconds a scoring call takes


def uniform(key: str) -> bool:
    return int(key[1:]) % 3 == 0


class Scorer:
    """Rewards by prompt: uniform (every sample 1.0) for uniform prompts, 0/1 alternating otherwise; ``acc`` too."""

    def __init__(self, all_uniform: bool = False) -> None:
        self.all_uniform = all_uniform
        self.scored: list[str] = []
        self.calls = 0

    async def score(self, groups: list[GroupState]) -> list[list[SampleScore]]:
        self.calls += 1
        await asyncio.sleep(SCORE_S)
        results = []
        for group in groups:
            self.scored.append(group.key)
            flat = self.all_uniform or uniform(group.key)
            rewards = [1.0 if flat else float(index % 2) for index in range(len(group.samples))]
            results.append([SampleScore(reward, {"acc": reward}) for reward in rewards])
        return results


def check_filtered(run, scorer: Scorer, batch: int) -> None:
    """No uniform group is trained, each step trains exactly ``batch`` judged groups, and every filtered group is
    counted, in the metrics and the ledger."""
    for groups in run.trained:
        assert len(groups) == batch
        for group in groups:
            assert not uniform(group.key), f"group {group.key} with uniform rewards was trained"
            assert group.scores is not None and len(group.scores) == len(group.samples)
            assert group.key in scorer.scored
    filtered = [key for event, key in run.pool.events if event == "filtered"]
    assert filtered and all(uniform(key) for key in filtered)
    assert sum(metrics["partial/filtered_groups"] for metrics in run.metrics) == len(filtered)
    assert run.pool.totals.filtered_groups == len(filtered)
    assert sum(metrics["partial/filtered_tokens"] for metrics in run.metrics) > 0
    assert not [key for key in filtered if key in {g.key for groups in run.trained for g in groups}]


def six_steps(policy: str, restore: bool, scorer, group_filter: GroupFilter | None = None):
    """Six steps of 3 groups x 4 samples under ``policy``, restored from a checkpoint at steps 3 and 5 if asked."""
    config = PartialConfig(extra_groups=0 if policy == "wait" else 2, max_staleness=1, staleness_policy=policy)
    restore_at = frozenset({3, 5}) if restore else frozenset()
    run = simulate(config, n=4, batch=3, steps=6, response_length=24, seed=11, group_filter=group_filter,
                   scorer=scorer, restore_at=restore_at)  # fmt: skip
    return config, run


@pytest.mark.parametrize("policy", ["restart", "drop", "keep", "wait"])
@pytest.mark.parametrize("restore", [False, True])
def test_uniform_groups_are_never_trained_and_counted(policy: str, restore: bool) -> None:
    scorer = Scorer()
    config, run = six_steps(policy, restore, scorer, GroupFilter(metric="acc"))
    check_filtered(run, scorer, batch=3)
    check_groups(run.trained, config, 4, 3, 24, 11)
    check_ledger(run, 3, config.extra_groups)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(max_extra=4))
def test_filter_holds_the_invariants_over_random_configs(config: PartialConfig) -> None:
    if not wait_fits(config, 2):
        return
    scorer = Scorer()
    run = simulate(config, n=3, batch=2, steps=4, response_length=16, seed=5, group_filter=GroupFilter(), scorer=scorer)
    check_filtered(run, scorer, batch=2)
    check_groups(run.trained, config, 3, 2, 16, 5)
    check_ledger(run, 2, config.extra_groups)


class TokenScorer:
    """Rewards computed from each sample's tokens as they are when scored (its length), so a reward kept from
    before a sample changed would show; counts how often each group was scored."""

    def __init__(self) -> None:
        self.scored: list[str] = []

    async def score(self, groups: list[GroupState]) -> list[list[SampleScore]]:
        await asyncio.sleep(SCORE_S)
        self.scored += [group.key for group in groups]
        return [[SampleScore(float(len(sample.token_ids)), {}) for sample in group.samples] for group in groups]


@pytest.mark.parametrize("policy", ["wait", "restart", "keep"])
@pytest.mark.parametrize("restore", [False, True])
def test_without_a_filter_rewards_are_computed_while_generating_and_kept_for_the_hand_over(
    policy: str, restore: bool
) -> None:
    """With a scorer and no filter (the glue's default when verl has reward loop workers), every trained group
    arrives with one reward per sample, computed from its final tokens while the step generated; nothing is
    filtered, and under ``wait`` (no restart) each group is scored exactly once."""
    scorer = TokenScorer()
    config, run = six_steps(policy, restore, scorer)
    check_groups(run.trained, config, 4, 3, 24, 11)
    check_ledger(run, 3, config.extra_groups)
    for groups in run.trained:
        for group in groups:
            assert group.scores == [SampleScore(float(len(sample.token_ids)), {}) for sample in group.samples]
    trained = [group.key for groups in run.trained for group in groups]
    assert set(trained) <= set(scorer.scored)
    if policy == "wait":
        assert len(scorer.scored) == len(set(scorer.scored))
    assert not any(event == "filtered" for event, _ in run.pool.events)


def test_max_num_gen_batches_exhausted_raises_naming_the_key() -> None:
    config = PartialConfig(extra_groups=2, staleness_policy="restart")
    with pytest.raises(RuntimeError, match=r"algorithm\.filter_groups\.max_num_gen_batches=2"):
        simulate(
            config,
            n=2,
            batch=2,
            steps=1,
            response_length=8,
            seed=3,
            group_filter=GroupFilter(max_num_gen_batches=2),
            scorer=Scorer(all_uniform=True),
        )


def test_unbounded_draws_until_enough_groups_pass() -> None:
    """``max_num_gen_batches <= 0`` keeps drawing: a step whose first groups are all filtered still trains a batch."""
    config = PartialConfig(extra_groups=0)
    scorer = Scorer()
    run = simulate(config, n=2, batch=4, steps=3, response_length=8, seed=7, group_filter=GroupFilter(), scorer=scorer)
    check_filtered(run, scorer, batch=4)
    assert run.metrics[0]["partial/judged_groups"] > 4


def test_group_filter_rule() -> None:
    rule = GroupFilter(metric="acc")
    flat = [SampleScore(0.5, {"acc": 1.0}), SampleScore(0.7, {"acc": 1.0})]
    assert not rule.passes("g", flat)
    assert GroupFilter().passes("g", flat)  # metric=reward: 0.5 and 0.7 vary
    assert rule.passes("g", flat[:1])  # one sample has no std: kept, as in v1
    with pytest.raises(ValueError, match=r"metric='seq_final_reward'.*reward_extra_info"):
        GroupFilter(metric="seq_final_reward").passes("g", flat)
    GroupFilter(max_num_gen_batches=0).check_bound(judged=10**6, passed=0, batch_groups=2)
    GroupFilter(max_num_gen_batches=2).check_bound(judged=4, passed=2, batch_groups=2)
    with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
        GroupFilter(max_num_gen_batches=2).check_bound(judged=4, passed=1, batch_groups=2)


def test_judged_state_survives_a_checkpoint() -> None:
    """A judged group stays ready after a restore (its rewards are checkpointed); an unjudged one is judged again."""
    shape = dict(group_size=2, batch_groups=1, response_length=4, group_filter=GroupFilter())
    pool: RolloutPool = RolloutPool(PartialConfig(extra_groups=1, staleness_policy="restart"), **shape)
    pool.begin_step(1, 0)
    for key in ("a", "b"):
        group_id = pool.admit(key, key)
        for index in range(2):
            sample = pool.groups[group_id].samples[index]
            sample.token_ids = np.arange(4, dtype=np.int32)
            sample.finished = True
        pool._sort_finished()
    assert not pool.ready_groups() and len(pool.awaiting_scores()) == 2
    assert pool.record_scores(0, [SampleScore(0.0), SampleScore(1.0)])
    restored: RolloutPool = RolloutPool(PartialConfig(extra_groups=1, staleness_policy="restart"), **shape)
    restored.load_state_dict(pool.state_dict())
    assert [group.key for group in restored.ready_groups()] == ["a"]
    assert [group.key for group in restored.awaiting_scores()] == ["b"]
    assert not restored.record_scores(1, [SampleScore(1.0), SampleScore(1.0)])
    assert restored.counters.filtered_groups == 1 and 1 not in restored.groups
