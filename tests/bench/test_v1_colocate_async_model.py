"""The model of verl's v1 colocate_async (benchmarks/v1_colocate_async_model.py) keeps v1's own rules.

The GPU-regime table that puts verl's own partial rollout beside ours (benchmarks/sim_v1_peer.py) is only as good as
this model: every group trained once or thrown away and counted, the staleness threshold as v1 counts it under
``wait`` and ``drop``, aborted answers resumed with their tokens, and v1's fixed 2 s poll and 1 s retry in virtual
time. The engines are the simulator's real ones (``SimBackend``); nothing here is mocked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from verl_partial.core.partial.finish import Finish
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import H100_SXM, QWEN25_7B
from verl_partial.sim.workload import Workload

SPEC = ServerSpec(H100_SXM, QWEN25_7B)
# A heavy tail on a small batch: groups routinely outlive a step, so staleness and eviction are exercised.
LOAD = Workload(batch=8, n=4, p50=300, p99_over_p50=20, response_length=8192, prompts=64)
STEPS = 8


_RUNS: dict[tuple, object] = {}  # simulated runs shared by the tests (each takes a fraction of a second)


@pytest.fixture
def v1(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("v1_colocate_async_model")


@pytest.fixture
def run(v1: ModuleType) -> Callable[..., object]:
    def get(steps: int = STEPS, **setup: object) -> object:
        key = (steps, tuple(sorted(setup.items())))
        if key not in _RUNS:
            _RUNS[key] = v1.simulate_v1(v1.V1Setup(**setup), LOAD, SPEC, 2, steps)
        return _RUNS[key]

    return get


def _prompt(key: str) -> int:
    return int(key[1 : key.index("@")])


@pytest.mark.parametrize("setup", [{"max_off_policy_threshold": 2, "max_off_policy_strategy": "wait"},
                                   {"max_off_policy_threshold": 2, "max_off_policy_strategy": "drop"},
                                   {}])  # fmt: skip
def test_every_group_is_trained_once_or_evicted_or_still_in_flight(run: Callable[..., object], setup: dict) -> None:
    got = run(**setup)
    trained = [key for step in got.trained_keys for key in step]
    assert all(len(step) == LOAD.batch for step in got.trained_keys)  # each step trains train_batch_size groups
    assert len(trained) == len(set(trained))  # none twice
    evicted, outstanding = set(got.evicted_keys), set(got.outstanding_keys)
    assert not (set(trained) & evicted) and not (set(trained) & outstanding) and not (evicted & outstanding)
    assert set(trained) | evicted | outstanding == set(got.submitted_keys)  # none lost
    # one warm-up batch, one batch per step, one fresh group per evicted one (ReplayBufferAsync's refill)
    assert len(got.submitted_keys) == LOAD.batch * (1 + STEPS) + len(evicted)


@pytest.mark.parametrize("threshold", [2, 3])
def test_wait_holds_the_threshold_and_throws_nothing_away(run: Callable[..., object], threshold: int) -> None:
    got = run(max_off_policy_threshold=threshold, max_off_policy_strategy="wait")
    assert max(got.threshold_span_max) == threshold  # reached, never passed
    # v1 counts versions spanned from submission; in our units a token is at most threshold - 1 versions old
    assert max(got.record.staleness_max) == threshold - 1
    assert sum(got.evicted_groups) == 0 and sum(got.record.tokens_discarded) == 0


def test_threshold_two_with_wait_trains_each_step_the_groups_submitted_before_it(run: Callable[..., object]) -> None:
    """Threshold 2 + wait is our max_staleness 1: from step 2 on, a step waits for every group submitted before it
    and trains exactly those (step 1 trains the first half to finish of the warm-up batch and its own)."""
    got = run(max_off_policy_threshold=2, max_off_policy_strategy="wait")
    earlier: set[str] = set(got.trained_keys[0])
    for step, keys in enumerate(got.trained_keys[1:], start=2):
        before = set(got.submitted_keys[: LOAD.batch * step])  # the warm-up batch, then one batch per step
        assert set(keys) == before - earlier
        earlier |= set(keys)


def test_drop_evicts_finished_groups_over_the_threshold_and_counts_them(run: Callable[..., object]) -> None:
    got = run(max_off_policy_threshold=2, max_off_policy_strategy="drop")
    assert sum(got.evicted_groups) == len(got.evicted_keys) > 0
    assert sum(got.record.tokens_discarded) > 0  # their tokens are thrown away
    assert max(got.threshold_span_max) <= 2  # nothing over the threshold is trained
    # verl's defaults (8, drop): no group can be over 8 versions in 8 steps, so nothing is thrown away
    defaults = run()
    assert sum(defaults.evicted_groups) == 0 and max(defaults.threshold_span_max) > 2


def test_aborted_requests_keep_their_tokens(run: Callable[..., object]) -> None:
    """A call aborted at the step end returns its tokens; the retry continues from them, nothing is regenerated."""
    got = run(max_off_policy_threshold=2, max_off_policy_strategy="wait", trace=True)
    calls = defaultdict(list)
    for call in got.calls:
        calls[call.sample].append(call)
    resumed = [s for s, cs in calls.items() if any(c.finish is Finish.ABORTED and c.tokens > 0 for c in cs[:-1])]
    assert got.resumed_calls > 0 and resumed
    trained = {key for step in got.trained_keys for key in step}
    checked = 0
    for sample in resumed:
        key, index = sample.rsplit("/", 1)
        if key in trained:
            whole = min(LOAD.length(_prompt(key), key, int(index), 0), LOAD.response_length)
            assert sum(c.tokens for c in calls[sample]) == whole  # the answer, once, across its calls
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("poll", [2.0, 0.5])
def test_the_replay_buffer_poll_quantises_the_sample(run: Callable[..., object], poll: float) -> None:
    """ReplayBuffer sleeps poll_interval (2.0 s, fixed in verl) between looks: a batch is taken only on a look."""
    got = run(max_off_policy_threshold=2, max_off_policy_strategy="wait", poll_interval_s=poll)
    assert max(got.polls) > 0
    np.testing.assert_allclose(got.sample_s, np.array(got.polls) * poll, atol=1e-9)


def test_a_retry_waits_one_second_or_for_the_resume(run: Callable[..., object]) -> None:
    """FullyAsyncLLMServerClient sleeps 1 s before retrying an aborted call; a retry that reaches a closed gate
    parks until the resume. With no update time the second shows; with a longer update the resume decides."""
    for update_s in (0.0, 5.0):
        got = run(max_off_policy_threshold=2, max_off_policy_strategy="wait", trace=True, update_s=update_s)
        calls = defaultdict(list)
        for call in got.calls:
            calls[call.sample].append(call)
        pairs = [pair for cs in calls.values() for pair in zip(cs, cs[1:], strict=False)]
        retries = [(a, b) for a, b in pairs if a.finish is Finish.ABORTED]
        assert retries
        gaps = np.array([b.launched - a.returned for a, b in retries])
        if update_s == 0.0:
            assert gaps.min() == pytest.approx(1.0) and np.mean(np.isclose(gaps, 1.0)) > 0.9
        else:
            assert gaps.min() >= update_s - 1e-9
            assert all(min(abs(b.launched - r) for r in got.resumes) < 1e-9 for _, b in retries)


def test_validation_reads_the_peer_benchmark_json(bench_module: Callable[[str], ModuleType]) -> None:
    """sim_v1_peer.validate takes bench_peer's stored runs and sets the model's v1/ours ratio beside the measured."""
    import dataclasses

    peer, sim = bench_module("bench_peer"), bench_module("sim_v1_peer")
    wl = peer.Workload(steps=3)

    def stored(mode: str, gen_s: float, round_: int) -> dict:
        step = {"timing_s/gen": gen_s, "timing_s/step": gen_s + 4.0, "response_length/mean": 60.0,
                "prompt_length/mean": 30.0, "critic/score/mean": 0.0}  # fmt: skip
        return {"mode": mode, "returncode": 0, "peak_rss_bytes": 0, "round": round_,
                "steps": {"1": step, "2": step, "3": step}}  # fmt: skip

    runs = [stored(mode, gen, r) for r in range(2) for mode, gen in
            (("default", 2.0), ("v1_async_bound", 3.0), ("v1_async_defaults", 2.5))]  # fmt: skip
    report = sim.validate({"workload": dataclasses.asdict(wl), "runs": runs}, steps=3)
    assert report["workload"]["batch"] == wl.prompts and report["workload"]["prompt_len"] == 30
    bound = report["ratios"]["v1_bound"]
    assert bound["measured_per_round"] == pytest.approx([1.5, 1.5])
    assert bound["predicted_v1_over_ours_rollout_per_token"] > 0
    assert bound["error"] == pytest.approx(bound["predicted_v1_over_ours_rollout_per_token"] / 1.5 - 1)
