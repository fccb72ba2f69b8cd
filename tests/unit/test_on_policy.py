"""On-policy tail cutting: the length estimator, the pool's launch order, and the ``on_policy`` preset."""

from __future__ import annotations

import numpy as np
import pytest
from test_plugin_and_config import compose

from verl_partial.config.job import validate_root_config
from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.on_policy import LengthEstimator
from verl_partial.core.partial.pool import GroupState, RolloutPool, SampleRef


def _finish(group: GroupState, index: int, length: int) -> None:
    sample = group.samples[index]
    sample.token_ids = np.zeros(length, dtype=np.int32)
    sample.finished = True


def _pool(schedule: str = "longest_first", estimator: LengthEstimator | None = None) -> RolloutPool:
    config = PartialConfig(extra_groups=2, max_staleness=0, staleness_policy="restart", refill=False, schedule=schedule)
    priority = estimator.priority if estimator is not None else None
    return RolloutPool(config, group_size=2, batch_groups=1, response_length=100, priority=priority)


def test_estimate_comes_from_finished_siblings_then_prompt_history():
    estimator = LengthEstimator(identity=lambda prompt: prompt, smoothing=1.0)
    pool = _pool(estimator=estimator)
    group = pool.groups[pool.admit("q1", "q1@e0")]
    assert estimator.estimate(group) is None
    _finish(group, 0, 30)
    assert estimator.estimate(group) == 30
    _finish(group, 1, 50)
    estimator.record([group])
    fresh = pool.groups[pool.admit("q1", "q1@e1")]  # the same prompt in a later epoch
    assert estimator.estimate(fresh) == 40


def test_history_is_a_running_mean_across_epochs():
    estimator = LengthEstimator(identity=lambda prompt: prompt, smoothing=0.5)
    pool = _pool(estimator=estimator)
    for epoch, length in enumerate((40, 80)):
        group = pool.groups[pool.admit("q", f"q@e{epoch}")]
        _finish(group, 0, length)
        _finish(group, 1, length)
        estimator.record([group])
    assert estimator.history["q"] == pytest.approx(60.0)


def test_runnable_starts_unknown_then_longest_expected_first():
    estimator = LengthEstimator(identity=lambda prompt: prompt)
    estimator.history = {"short": 10.0, "long": 90.0}
    pool = _pool(estimator=estimator)
    short, long_, new = (pool.admit(prompt, f"{prompt}@e1") for prompt in ("short", "long", "new"))
    pool.begin_step(0, 0)
    order = [ref.group_id for ref in pool.runnable()]
    assert order == [new, new, long_, long_, short, short]
    # A sample that already holds tokens is ranked by what it still has to generate.
    pool.groups[long_].samples[0].token_ids = np.zeros(85, dtype=np.int32)
    refs = pool.runnable()
    assert refs.index(SampleRef(long_, 1)) < refs.index(SampleRef(short, 0)) < refs.index(SampleRef(long_, 0))


def test_fifo_keeps_oldest_group_first():
    pool = _pool(schedule="fifo")
    ids = [pool.admit(prompt, prompt) for prompt in ("a", "b", "c")]
    pool.begin_step(0, 0)
    assert [ref.group_id for ref in pool.runnable()] == [ids[0], ids[0], ids[1], ids[1], ids[2], ids[2]]


def test_longest_first_without_an_estimator_is_refused():
    with pytest.raises(ValueError, match="partial.schedule=longest_first needs a launch priority"):
        _pool(schedule="longest_first")


def test_bad_schedule_names_the_key():
    with pytest.raises(ValueError, match=r"partial.schedule must be one of \['fifo', 'longest_first'\]"):
        PartialConfig(schedule="shortest_first")
    with pytest.raises(ValueError, match="partial.schedule"):
        validate_root_config(compose("partial/on_policy", partial__schedule="random"))


def test_on_policy_preset_validates_and_is_strictly_on_policy():
    config = compose("partial/on_policy")
    validate_root_config(config)
    assert config.partial.max_staleness == 0 and config.partial.extra_groups == 0
    assert config.partial.schedule == "longest_first"
