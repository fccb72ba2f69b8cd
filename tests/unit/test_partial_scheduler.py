"""Invariants 1-6 and 9-12 of partial rollout, over randomised schedules, on the real pool and scheduler.

A simulated engine stands in for the server: each sample has a fixed target length drawn from a
heavy-tailed distribution, token ids and log-probs are pure functions of (prompt, sample, position,
version), so any lost, duplicated, re-granted or mis-versioned token is detectable. Generation yields
to the event loop once per token, which makes whole runs deterministic and lets abort cut a segment
in the middle.
"""

from __future__ import annotations

import asyncio
import hashlib
import pickle
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_partial.core.partial_config import PartialConfig
from verl_partial.core.pool import GroupState, RolloutPool, SegmentRequest
from verl_partial.core.scheduler import OutOfPrompts, SegmentResult, run_step

EOS = -1


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def target_length(key: str, index: int, seed: int, response_length: int) -> int:
    """Heavy tail: most samples short, a few ~10x longer, some past response_length (truncated)."""
    u = (_h(seed, key, index) % 10_000) / 10_000
    length = int(4 / max(1e-3, 1 - u) ** 0.9)
    return max(1, min(length, response_length + 5))


def token_at(key: str, index: int, position: int) -> int:
    return _h(key, index, position) % 997


def log_prob_at(position: int, version: int) -> float:
    # Encodes the generating version so a test can tell which weights produced each token.
    return -(version + 1) * 1e-3 - position * 1e-7


@dataclass(frozen=True)
class TrainedRow:
    """Stands in for verl's output row: a dataclass payload, which checkpointing must keep intact."""

    key: str


@dataclass
class FakeEngine:
    """Token-by-token engine: deterministic content, abortable, with injectable failures and hangs."""

    seed: int
    response_length: int
    fail_rate: float = 0.0
    hang_rate: float = 0.0
    version: int = 0
    aborting: bool = False
    calls: dict[str, int] = field(default_factory=dict)
    tokens_generated: int = 0

    async def generate(self, group: GroupState, request: SegmentRequest) -> SegmentResult:
        attempt = self.calls.get(request.request_id, 0)
        self.calls[request.request_id] = attempt + 1
        draw = (_h(self.seed, "fault", request.request_id, attempt) % 10_000) / 10_000
        if draw < self.fail_rate:
            raise RuntimeError("injected failure")
        if draw < self.fail_rate + self.hang_rate:
            await asyncio.sleep(3600)
        key, index = group.key, request.ref.index
        length = target_length(key, index, self.seed, self.response_length)
        start = len(request.prefix_ids)
        assert request.prefix_ids == [token_at(key, index, p) if p != length - 1 else EOS for p in range(start)]
        new_ids: list[int] = []
        for position in range(start, start + request.max_new_tokens):
            if self.aborting:
                break
            await asyncio.sleep(0)
            is_eos = position == length - 1
            new_ids.append(EOS if is_eos else token_at(key, index, position))
            self.tokens_generated += 1
            if is_eos:
                break
        log_probs = [log_prob_at(start + i, self.version) for i in range(len(new_ids))]
        return SegmentResult(
            new_ids,
            log_probs,
            eos=bool(new_ids) and new_ids[-1] == EOS,
            prompt_ids=[_h(key) % 97],
            output=TrainedRow(key),
        )

    async def abort_all(self) -> None:
        self.aborting = True

    async def resume(self) -> None:
        self.aborting = False


class ListSource:
    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.position = 0

    def next_prompt(self) -> tuple[str, str] | None:
        if self.position >= len(self.keys):
            return None
        key = self.keys[self.position]
        self.position += 1
        return key, key


@dataclass
class Run:
    trained_per_step: list[list[str]]
    pool: RolloutPool
    engine: FakeEngine
    source: ListSource
    metrics: list[dict[str, float]]
    trained: list[list[GroupState]]


def simulate(
    config: PartialConfig,
    *,
    n: int,
    batch: int,
    steps: int,
    response_length: int,
    seed: int,
    fail_rate: float = 0.0,
    hang_rate: float = 0.0,
    prompts: int | None = None,
    resume_at: int | None = None,
) -> Run:
    keys = [f"p{i}" for i in range(prompts if prompts is not None else batch * steps + config.extra_groups + 64)]
    source = ListSource(keys)
    engine = FakeEngine(seed, response_length, fail_rate, hang_rate)
    pool: RolloutPool = RolloutPool(config, group_size=n, batch_groups=batch, response_length=response_length)
    trained, metrics = [], []

    async def main() -> None:
        nonlocal pool
        for step in range(1, steps + 1):
            if resume_at is not None and step == resume_at:
                # A crash after the checkpoint of step resume_at - 1: rebuild from serialised state only.
                state = pickle.loads(pickle.dumps((pool.state_dict(), source.position)))
                pool = RolloutPool(config, group_size=n, batch_groups=batch, response_length=response_length)
                pool.load_state_dict(state[0])
                source.position = state[1]
            engine.version = step - 1
            result = await run_step(pool, engine, source, step=step, version=step - 1)
            trained.append(result.trained)
            metrics.append(result.metrics)

    asyncio.run(main())
    return Run([[g.key for g in step] for step in trained], pool, engine, source, metrics, trained)


def check_groups(trained_steps, config: PartialConfig, n: int, batch: int, response_length: int, seed: int) -> None:
    for step_index, groups in enumerate(trained_steps, start=1):
        version = step_index - 1
        assert len(groups) == batch  # invariant 1: exactly train_batch_size groups
        for group in groups:
            assert len(group.samples) == n
            for index, sample in enumerate(group.samples):
                assert sample.finished and not sample.in_flight
                assert sample.output == TrainedRow(group.key)
                length = target_length(group.key, index, seed, response_length)
                expected = [token_at(group.key, index, p) if p != length - 1 else EOS for p in range(length)]
                # invariant 3: exact continuation, never beyond response_length
                assert sample.token_ids == expected[:response_length]
                assert len(sample.token_ids) <= response_length
                # invariant 4: every token carries the version that generated it
                for position, (log_prob, tag) in enumerate(zip(sample.log_probs, sample.versions, strict=True)):
                    assert log_prob == log_prob_at(position, tag)
                    assert 0 <= tag <= version
                # invariant 5: bounded staleness unless the policy keeps stale tokens
                if config.staleness_policy != "keep":
                    assert all(version - tag <= config.max_staleness for tag in sample.versions)


configs = st.builds(
    PartialConfig,
    extra_groups=st.integers(0, 6),
    step_token_budget=st.one_of(st.none(), st.integers(1, 24)),
    chunk_tokens=st.one_of(st.none(), st.integers(1, 16)),
    abort_on_done=st.booleans(),
    max_staleness=st.integers(0, 3),
    staleness_policy=st.sampled_from(["restart", "drop", "keep"]),
    max_retries=st.integers(0, 3),
    request_timeout_s=st.just(0.5),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    n=st.integers(1, 4),
    batch=st.integers(1, 4),
    steps=st.integers(1, 6),
    response_length=st.integers(4, 48),
    seed=st.integers(0, 10_000),
)
def test_invariants_over_random_schedules(config, n, batch, steps, response_length, seed):
    run = simulate(config, n=n, batch=batch, steps=steps, response_length=response_length, seed=seed)
    check_groups(run.trained, config, n, batch, response_length, seed)
    keys = [key for step in run.trained_per_step for key in step]
    # invariant 2: trained once; every drawn prompt is trained, dropped (counted) or still in flight
    assert len(keys) == len(set(keys))
    drawn = run.source.keys[: run.source.position]
    in_flight = [group.key for group in run.pool.groups.values()]
    dropped = [key for event, key in run.pool.events if event == "dropped"]
    assert sorted(keys + in_flight + dropped) == sorted(drawn)
    assert run.pool.totals.dropped_groups == len(dropped)
    totals = run.pool.totals
    assert totals.admitted_groups == totals.trained_groups + totals.dropped_groups + len(in_flight) == len(drawn)
    assert run.metrics[-1]["partial/total/trained_groups"] == len(keys)
    assert len(run.pool.groups) <= batch + config.extra_groups  # invariant 12: bounded parked state
    for metrics in run.metrics:
        assert metrics["partial/parked_bytes"] == 12 * metrics["partial/parked_tokens"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    n=st.integers(1, 3),
    batch=st.integers(1, 3),
    steps=st.integers(2, 6),
    response_length=st.integers(4, 40),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_resume_from_checkpoint_trains_the_same_prompts(config, n, batch, steps, response_length, seed, data):
    """Invariant 6: a run restored from serialised state trains exactly what an uninterrupted run trains."""
    resume_at = data.draw(st.integers(2, steps))
    kwargs = dict(n=n, batch=batch, steps=steps, response_length=response_length, seed=seed)
    straight = simulate(config, **kwargs)
    resumed = simulate(config, resume_at=resume_at, **kwargs)
    assert resumed.trained_per_step == straight.trained_per_step
    check_groups(resumed.trained, config, n, batch, response_length, seed)
    assert [g.key for g in resumed.pool.groups.values()] == [g.key for g in straight.pool.groups.values()]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 3),
    batch=st.integers(1, 3),
    seed=st.integers(0, 1000),
    fail_rate=st.floats(0.0, 0.3),
    hang_rate=st.floats(0.0, 0.1),
    max_retries=st.integers(0, 2),
)
def test_failures_are_retried_then_counted_and_never_hang(n, batch, seed, fail_rate, hang_rate, max_retries):
    """Invariant 11: failing or hanging calls are retried, then their group is replaced; the step completes."""
    config = PartialConfig(extra_groups=2, max_retries=max_retries, request_timeout_s=0.02, staleness_policy="keep")
    run = simulate(
        config,
        n=n,
        batch=batch,
        steps=3,
        response_length=16,
        seed=seed,
        fail_rate=fail_rate,
        hang_rate=hang_rate,
        prompts=400,
    )
    check_groups(run.trained, config, n, batch, 16, seed)
    failed = [key for event, key in run.pool.events if event == "failed"]
    trained_keys = {key for step in run.trained_per_step for key in step}
    assert not trained_keys & set(failed)
    assert run.pool.totals.failed_groups == len(failed)
    assert sum(m["partial/failed_groups"] for m in run.metrics) <= len(failed)


def test_partial_rollout_stops_waiting_for_the_long_tail():
    """With abort, the first step trains the short groups and parks the long ones mid-generation."""
    config = PartialConfig(extra_groups=4, staleness_policy="keep")
    run = simulate(config, n=4, batch=2, steps=1, response_length=200, seed=7)
    parked = [s for g in run.pool.groups.values() for s in g.samples if not s.finished and s.token_ids]
    assert parked, "some unfinished samples must be parked with their tokens"
    assert run.metrics[0]["partial/parked_tokens"] > 0
    longest_trained = max(len(s.token_ids) for g in run.trained[0] for s in g.samples)
    longest_target = max(target_length(f"p{i}", j, 7, 200) for i in range(6) for j in range(4))
    assert longest_trained < min(200, longest_target)


@pytest.mark.parametrize("abort_on_done", [True, False])
def test_interruption_overshoot_is_bounded(abort_on_done, monkeypatch):
    """Invariant 9: once the step has its groups, in-flight samples stop at once (abort) or within a chunk."""
    chunk = 3
    config = PartialConfig(extra_groups=4, chunk_tokens=chunk, abort_on_done=abort_on_done, staleness_policy="keep")
    seen: dict[str, int] = {}
    original = RolloutPool.step_done

    def observed_step_done(pool):
        done = original(pool)
        if done and "tokens" not in seen:
            seen["tokens"] = engine_ref["engine"].tokens_generated
            seen["in_flight"] = pool.in_flight()
        return done

    engine_ref: dict[str, FakeEngine] = {}
    original_generate = FakeEngine.generate

    async def tracking_generate(engine, group, request):
        engine_ref["engine"] = engine
        return await original_generate(engine, group, request)

    monkeypatch.setattr(RolloutPool, "step_done", observed_step_done)
    monkeypatch.setattr(FakeEngine, "generate", tracking_generate)
    run = simulate(config, n=2, batch=1, steps=1, response_length=500, seed=3)
    overshoot = run.engine.tokens_generated - seen["tokens"]
    assert seen["in_flight"] > 0
    # Abort: at most the one decode step already under way; chunking: at most one chunk per request.
    assert overshoot <= seen["in_flight"] * (1 if abort_on_done else chunk)


def test_token_budget_caps_each_round_and_counts_extra_rounds():
    config = PartialConfig(extra_groups=0, step_token_budget=2, staleness_policy="keep")
    run = simulate(config, n=2, batch=2, steps=2, response_length=40, seed=11)
    check_groups(run.trained, config, 2, 2, 40, 11)
    assert sum(m["partial/budget_rounds"] for m in run.metrics) > 0


def test_out_of_prompts_is_a_clear_error():
    config = PartialConfig(extra_groups=0)
    with pytest.raises(OutOfPrompts, match="prompt source is exhausted"):
        simulate(config, n=1, batch=2, steps=2, response_length=8, seed=0, prompts=3)


def test_resume_with_another_shape_is_refused():
    config = PartialConfig()
    pool = RolloutPool(config, group_size=2, batch_groups=2, response_length=8)
    other = RolloutPool(config, group_size=4, batch_groups=2, response_length=8)
    with pytest.raises(ValueError, match="same data.train_batch_size"):
        other.load_state_dict(pool.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"extra_groups": -1}, "partial.extra_groups"),
        ({"step_token_budget": 0}, "partial.step_token_budget"),
        ({"chunk_tokens": -3}, "partial.chunk_tokens"),
        ({"max_staleness": -1}, "partial.max_staleness"),
        ({"staleness_policy": "ignore"}, "partial.staleness_policy"),
        ({"max_retries": -1}, "partial.max_retries"),
        ({"request_timeout_s": 0}, "partial.request_timeout_s"),
    ],
)
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        PartialConfig(**kwargs)
