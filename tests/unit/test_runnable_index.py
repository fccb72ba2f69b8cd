"""The pool's index of runnable samples against the predicate it caches, after every operation.

``RolloutPool`` keeps the runnable samples (not finished, not in flight, token budget left) in an index updated at
every mutation, so that a launch does not rescan every sample (docs/evidence.md#scheduler-driver-cpu). A mutation
site that forgets to update it launches a sample twice or never again; :class:`CheckedPool` recomputes the answer by
brute force after every mutating call and compares, over random operation sequences on the pool alone and over the
real scheduler on the simulated engines of ``test_partial_scheduler``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import test_partial_scheduler
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_partial_scheduler import configs, make_engine, simulate, wait_fits

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.on_policy import LengthEstimator
from verl_partial.core.partial.pool import RolloutPool, SampleRef, SegmentResult
from verl_partial.core.partial.scheduler import run_step

# Every RolloutPool method that can change whether a sample is runnable.
MUTATIONS = (
    "admit",
    "begin_step",
    "start",
    "finish_segment",
    "release",
    "fail_segment",
    "grant_budget_round",
    "take_ready",
    "load_state_dict",
)


def brute_force_runnable(pool: RolloutPool) -> list[SampleRef]:
    """What ``runnable()`` answered before the index: every sample scanned, oldest group first, then sorted by
    ``priority`` when one is set."""
    refs = [
        SampleRef(group.group_id, index)
        for group in sorted(pool.groups.values(), key=lambda g: g.group_id)
        for index, sample in enumerate(group.samples)
        if not sample.finished
        and not sample.in_flight
        and pool.config.max_new_tokens(len(sample.token_ids), sample.tokens_this_step, pool.response_length) > 0
    ]
    if pool.priority is not None:
        priority = pool.priority
        refs.sort(key=lambda ref: priority(pool.groups[ref.group_id], pool.groups[ref.group_id].samples[ref.index]))
    return refs


class CheckedPool(RolloutPool):
    """A pool that checks its index against :func:`brute_force_runnable` after every mutating call."""

    checks = 0

    def check(self) -> None:
        expected = brute_force_runnable(self)
        assert self.runnable() == expected, "the index of runnable samples disagrees with the predicate"
        assert list(self.iter_runnable()) == expected
        assert self.has_runnable() == bool(expected)
        open_samples = sum(not sample.finished for group in self.groups.values() for sample in group.samples)
        assert self.open_samples() == open_samples, "the count of unfinished samples (fill_engine) drifted"
        CheckedPool.checks += 1


def _checked(name: str) -> Callable[..., Any]:
    unchecked = getattr(RolloutPool, name)

    def method(self: CheckedPool, *args: Any, **kwargs: Any) -> Any:
        result = unchecked(self, *args, **kwargs)
        self.check()
        return result

    method.__name__ = name
    return method


for _name in MUTATIONS:
    setattr(CheckedPool, _name, _checked(_name))


# ---------------------------------------------------------------- random operations on the pool alone
OPERATIONS = ("admit", "start", "finish", "release", "fail", "late", "budget_round", "next_step", "checkpoint")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    longest_first=st.booleans(),
    n=st.integers(1, 4),
    batch=st.integers(1, 3),
    response_length=st.integers(1, 24),
    data=st.data(),
)
def test_index_matches_the_predicate_over_random_operations(config, longest_first, n, batch, response_length, data):
    assume(wait_fits(config, batch))
    estimator = None
    if longest_first:
        config = PartialConfig(**{**config.__dict__, "schedule": "longest_first"})
        estimator = LengthEstimator(identity=lambda prompt: prompt % 3)

    engine_slots = data.draw(st.integers(1, 3 * n * batch))

    def new_pool() -> CheckedPool:
        priority = estimator.priority if estimator is not None else None
        return CheckedPool(
            config, group_size=n, batch_groups=batch, response_length=response_length, priority=priority,
            engine_slots=engine_slots,
        )  # fmt: skip

    pool = new_pool()
    prompts = iter(range(10_000))
    step = version = 0
    pool.begin_step(step, version)
    gone: list[SampleRef] = []  # calls whose group was taken out while they ran
    for _ in range(data.draw(st.integers(1, 80))):
        in_flight = [
            SampleRef(group.group_id, index)
            for group in pool.groups.values()
            for index, sample in enumerate(group.samples)
            if sample.in_flight
        ]
        operation = data.draw(st.sampled_from(OPERATIONS))
        if operation == "admit" and pool.free_slots():
            prompt = next(prompts)
            pool.admit(prompt, f"p{prompt}")
        elif operation == "start" and pool.has_runnable():
            pool.start(data.draw(st.sampled_from(pool.runnable())), data.draw(st.sampled_from(["s0", "s1"])))
        elif operation in ("finish", "release", "fail") and in_flight:
            ref = data.draw(st.sampled_from(in_flight))
            if operation == "finish":
                budget = pool._budget(pool.sample(ref))
                tokens = data.draw(st.integers(0, budget))
                finish = data.draw(st.sampled_from(list(Finish)))
                result = SegmentResult(np.arange(tokens), np.zeros(tokens), finish, "s0")
                pool.finish_segment(ref, result)
            elif operation == "release":
                pool.release(ref)
            else:
                group = pool.groups[ref.group_id]
                if pool.fail_segment(ref):
                    gone.extend(SampleRef(group.group_id, i) for i, s in enumerate(group.samples) if s.in_flight)
        elif operation == "late" and gone:  # the answer of a call whose group is gone: thrown away
            ref = gone.pop()
            pool.finish_segment(ref, SegmentResult(np.arange(1), np.zeros(1), Finish.EOS, "s0"))
        elif operation == "budget_round" and config.step_token_budget is not None:
            pool.grant_budget_round()
        elif operation == "next_step" and not in_flight:
            if len(pool.ready_groups()) >= batch:
                trained = pool.take_ready()
                if estimator is not None:
                    estimator.record(trained)
                version += 1
            step += 1
            pool.begin_step(step, version)
        elif operation == "checkpoint" and not in_flight:
            state = pickle.loads(pickle.dumps(pool.state_dict()))
            pool = new_pool()
            pool.load_state_dict(state)
        pool.check()


# ---------------------------------------------------------------- the real scheduler over simulated engines
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    n=st.integers(1, 4),
    batch=st.integers(1, 3),
    steps=st.integers(1, 4),
    response_length=st.integers(4, 40),
    seed=st.integers(0, 10_000),
    servers=st.integers(1, 3),
    restore_at=st.frozensets(st.integers(2, 4), max_size=1),
)
def test_index_matches_the_predicate_under_the_scheduler(
    config, n, batch, steps, response_length, seed, servers, restore_at
):
    assume(wait_fits(config, batch))
    engine = make_engine(seed, response_length, servers, max_transit=0.05)
    before = CheckedPool.checks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_partial_scheduler, "RolloutPool", CheckedPool)
        run = simulate(
            config, n=n, batch=batch, steps=steps, response_length=response_length, seed=seed, engine=engine,
            restore_at=restore_at,
        )  # fmt: skip
    assert isinstance(run.pool, CheckedPool) and CheckedPool.checks > before


def test_lazy_iteration_skips_nothing_while_its_samples_are_started():
    """The scheduler starts each sample ``iter_runnable`` yields before asking for the next: the order is the
    snapshot's, and stopping early leaves the rest runnable."""
    pool = CheckedPool(PartialConfig(), group_size=3, batch_groups=4, response_length=8)
    for key in "abcd":
        pool.admit(key, key)
    pool.begin_step(0, 0)
    pool.start(SampleRef(1, 1), "s0")
    expected = pool.runnable()
    started = []
    for ref in pool.iter_runnable():
        pool.start(ref, "s0")
        started.append(ref)
        if len(started) == 4:
            break
    assert started == expected[:4]
    assert pool.runnable() == expected[4:]


def test_scheduler_launches_in_the_brute_force_order():
    """One step of the real scheduler with max_calls_per_server binding: every launch takes a prefix of what the old
    full scan would have returned at that moment, in its order."""
    config = PartialConfig(max_calls_per_server=3)
    engine = make_engine(3, 16, servers=2, max_transit=0.05)
    pool = CheckedPool(config, group_size=4, batch_groups=2, response_length=16, engine_slots=12)
    source = test_partial_scheduler.ListSource([f"p{i}" for i in range(16)])
    waves: list[tuple[list[SampleRef], list[SampleRef]]] = []  # (the full scan's answer, what the launch took)
    lazy = pool.iter_runnable

    def iter_runnable() -> Iterator[SampleRef]:
        taken: list[SampleRef] = []
        waves.append((brute_force_runnable(pool), taken))
        for ref in lazy():
            taken.append(ref)
            yield ref

    pool.iter_runnable = iter_runnable  # type: ignore[method-assign]

    async def main() -> None:
        engine.version = 0
        await run_step(pool, engine, source, step=1, version=0, server_version=0)

    try:
        test_partial_scheduler.run_virtual(main(), watchdog_s=30.0)
    finally:
        engine.shutdown()
    assert len(waves) > 1
    for expected, taken in waves:
        assert taken == expected[: len(taken)]
    assert any(len(taken) < len(expected) for expected, taken in waves)  # the cap stopped a launch early
