"""The scheduler soak: random schedules on real-engine semantics, per engine profile (issue 19, item 4).

Each schedule drives the real pool and scheduler against :mod:`sim_engine` servers of one engine -- vLLM (queue
beyond ``max_num_seqs``, the 60 s abort barrier, nothing back to a cancelled call) or SGLang (one more token at an
abort, its finish order, the pause gate, cancel that does not stop decoding unless our server fix is on) -- with
random configs (every staleness policy, refill, chunks, token budgets, abort or not), aborts landing on calls in
transit, slow, failing and hanging calls, wedged and dying servers, pauses that land late (an abort outliving the
step end, and the next step's start), and checkpoint/restore at random steps.

Per schedule, ``test_partial_scheduler.simulate`` checks after every step that nothing generates once the step
returned, that the double saw no violation (a resume after an EOS, a prefix-matched abort hitting another call, a
resume landing before its server's abort returned, a call launched to a server not resumed yet), and that every
token handed back is trained, parked or counted as discarded; the run is under the virtual clock's busy-loop
watchdog. The soak then counts, over all schedules: prompts lost, groups trained twice, stalls (a step end over 6 x
``abort_grace_s``), busy loops -- each must be 0 --, checks that the tokens lost with cancelled calls stay within
``partial/cancelled_tokens_max``, and reports the rest.

CI runs ``VERL_PARTIAL_SOAK`` schedules per profile (default 100, ~20 s each). The full soak (issue 19 asks >= 10,000
per profile; minutes of CPU, so under the shared lock)::

    VERL_PARTIAL_SOAK=10000 pytest tests/unit/test_scheduler_soak.py -q -s

``VERL_PARTIAL_SOAK_FIRST_SEED`` shifts the seeds; a failing schedule names its seed and profile.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, fields

import pytest
from sim_engine import SimEngine, SimServer
from test_partial_scheduler import StepStalled, check_groups, simulate

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.scheduler import OutOfPrompts
from verl_partial.sim.clock import BusyLoop, run_virtual

PROFILES = ("vllm", "sglang")


@dataclass(frozen=True)
class ServerDraw:
    """One server of a schedule; a fresh :class:`SimServer` is built from it for every run."""

    engine: str
    token_latency: float
    dies_at: float
    stuck: bool
    max_num_seqs: int
    cancel_aborts: bool
    pause_delay_s: float

    def build(self, name: str) -> SimServer:
        return SimServer(name, **{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(frozen=True)
class Schedule:
    profile: str
    config: PartialConfig
    n: int
    batch: int
    steps: int
    response_length: int
    seed: int
    servers: tuple[ServerDraw, ...]
    fail_rate: float
    hang_rate: float
    slow_rate: float
    max_transit: float
    reject_request: bool
    cancel_raises: bool
    restore_at: frozenset[int]


def random_config(rng: random.Random, batch: int) -> PartialConfig:
    """A valid config drawn from every knob the scheduler reads (``PartialConfig``'s own checks decide valid)."""
    policy, refill = rng.choice(["restart", "drop", "keep", "wait"]), rng.random() < 0.5
    max_staleness = rng.randint(1 if policy == "wait" else 0, 3)
    if policy == "wait":
        extra = 0 if refill else rng.randint(0, min(6, max_staleness * batch))
    else:
        extra = rng.randint(0, 6)
    return PartialConfig(
        extra_groups=extra,
        step_token_budget=None if policy == "wait" else rng.choice([None, rng.randint(1, 24)]),
        chunk_tokens=rng.choice([None, rng.randint(1, 16)]),
        abort_on_done=rng.random() < 0.8,
        max_staleness=max_staleness,
        staleness_policy=policy,
        refill=refill,
        max_retries=rng.randint(0, 3),
        request_timeout_s=rng.choice([0.5, 2.0, 5.0]),
        abort_grace_s=rng.choice([0.2, 0.5, 1.0]),
        max_calls_per_server=rng.randint(1, 24),
    )


def random_schedule(seed: int, profile: str) -> Schedule:
    rng = random.Random(f"{profile}/{seed}")
    # Its own stream, so adding it kept every other draw of a seed as it was.
    pauses = random.Random(f"{profile}/{seed}/pause_delay_s")
    steps, batch = rng.randint(1, 6), rng.randint(1, 4)
    sglang = profile == "sglang"
    cancel_aborts = sglang and rng.random() < 0.5  # SGLang with or without our server fix
    servers = tuple(
        ServerDraw(
            engine=profile,
            token_latency=rng.choice([0.001, 0.01, 0.05]),
            # Server 0 never dies nor wedges (else no step could finish); the others may.
            dies_at=rng.uniform(0, 20) if i and rng.random() < 0.2 else float("inf"),
            stuck=bool(i) and rng.random() < 0.05,
            max_num_seqs=rng.choice([1, 2, 4, 1_000]),
            cancel_aborts=cancel_aborts,
            # Late pauses: an abort returning after the step end; beyond TRAIN_S (30 s), after the next step started.
            # Server 0 reopens in time, so every step has a server to run on.
            pause_delay_s=pauses.choice([0.0, 0.0, 0.0, 0.1, 1.0] + ([40.0] if i else [])),
        )
        for i in range(rng.randint(1, 4))
    )
    return Schedule(
        profile=profile,
        config=random_config(rng, batch),
        n=rng.randint(1, 4),
        batch=batch,
        steps=steps,
        response_length=rng.randint(4, 48),
        seed=seed,
        servers=servers,
        fail_rate=rng.choice([0.0, 0.0, 0.05, 0.2]),
        hang_rate=rng.choice([0.0, 0.0, 0.02, 0.1]),
        slow_rate=rng.choice([0.0, 0.1]),
        max_transit=rng.choice([0.0, 0.05, 0.5, 2.0]),
        reject_request=rng.random() < 0.7,
        cancel_raises=rng.random() < 0.5,
        restore_at=frozenset(rng.sample(range(2, steps + 1), k=min(steps - 1, rng.randint(0, 2)))),
    )


@dataclass
class SoakFigures:
    schedules: int = 0
    steps: int = 0
    lost: int = 0  # drawn prompts neither trained, taken out (counted) nor in the pool
    duplicated: int = 0  # groups trained more than once
    stalls: int = 0  # step ends over 6 x abort_grace_s (when aborting), steps over STALL_S virtual seconds
    busy_loops: int = 0  # the virtual clock's watchdog fired
    out_of_prompts: int = 0
    max_step_end_s: float = 0.0
    max_step_s: float = 0.0
    failed_groups: int = 0
    stalled_calls: int = 0
    taken_back_calls: int = 0
    cancelled_calls: int = 0
    cancelled_tokens_max: int = 0  # the scheduler's bound on tokens lost with cancelled calls
    abandoned_calls: int = 0
    control_timeouts: int = 0
    servers_closed: int = 0  # servers that sat a step out: their abort outlived the last step end
    tokens_discarded: int = 0
    tokens_lost_to_cancel: int = 0  # generated, then lost with a cancelled call (counted as cancelled_calls)
    zombie_tokens: int = 0  # decoded by cancelled SGLang requests without our server fix
    leaked_states: int = 0  # SGLang requests cancelled at its pause gate without our server fix
    restores: int = 0


def run_schedule(s: Schedule, figures: SoakFigures) -> SimEngine:
    engine = SimEngine(
        s.seed,
        s.response_length,
        [server.build(f"s{i}") for i, server in enumerate(s.servers)],
        fail_rate=s.fail_rate,
        hang_rate=s.hang_rate,
        slow_rate=s.slow_rate,
        max_transit=s.max_transit,
        reject_request=s.reject_request,
        cancel_raises=s.cancel_raises,
    )
    try:
        run = simulate(
            s.config,
            n=s.n,
            batch=s.batch,
            steps=s.steps,
            response_length=s.response_length,
            seed=s.seed,
            engine=engine,
            prompts=(s.batch + s.config.extra_groups) * s.steps * 20 + 64,
            restore_at=s.restore_at,
        )
    except OutOfPrompts:
        figures.out_of_prompts += 1  # failures used up the prompt supply: a clean, named error, not a stall
        return engine
    except BusyLoop:
        figures.busy_loops += 1
        return engine
    except StepStalled:
        figures.stalls += 1
        return engine
    check_groups(run.trained, s.config, s.n, s.batch, s.response_length, s.seed)  # exact tokens and versions
    keys = [key for step in run.trained_per_step for key in step]
    figures.duplicated += len(keys) - len(set(keys))
    drawn = run.source.keys[: run.source.position]
    accounted = set(keys) | {g.key for g in run.pool.groups.values()}
    accounted |= {key for event, key in run.pool.events if event in ("dropped", "failed")}
    figures.lost += len(set(drawn) - accounted)
    if s.config.abort_on_done:
        ends = [m["partial/step_end_s"] for m in run.metrics]
        figures.stalls += sum(end > 6 * s.config.abort_grace_s + 1e-6 for end in ends)
        figures.max_step_end_s = max(figures.max_step_end_s, *ends)
    figures.steps += len(run.metrics)
    figures.max_step_s = max(figures.max_step_s, *run.seconds)
    figures.restores += len(s.restore_at)
    figures.failed_groups += run.pool.totals.failed_groups
    for name in (
        "stalled_calls",
        "taken_back_calls",
        "cancelled_calls",
        "cancelled_tokens_max",
        "abandoned_calls",
        "control_timeouts",
        "tokens_discarded",
    ):
        setattr(figures, name, getattr(figures, name) + int(sum(m.get(f"partial/{name}", 0.0) for m in run.metrics)))
    figures.servers_closed += int(sum(m["partial/server_load/closed"] for m in run.metrics))
    # A cancelled call returns nothing: what it generated (SGLang without our fix: also after the cancel) is lost,
    # and only bounded by the scheduler.
    bound = int(sum(m["partial/cancelled_tokens_max"] for m in run.metrics))
    assert engine.tokens_lost + engine.zombie_tokens <= bound, (engine.tokens_lost, engine.zombie_tokens, bound)
    figures.tokens_lost_to_cancel += engine.tokens_lost
    figures.zombie_tokens += engine.zombie_tokens
    figures.leaked_states += engine.leaked_states
    return engine


@pytest.mark.parametrize("profile", PROFILES)
def test_soak_random_schedules(profile):
    """0 lost, 0 duplicated, 0 stalls, 0 busy loops over ``VERL_PARTIAL_SOAK`` random schedules (CI: 100)."""
    count = int(os.environ.get("VERL_PARTIAL_SOAK", "100"))
    first = int(os.environ.get("VERL_PARTIAL_SOAK_FIRST_SEED", "0"))
    figures = SoakFigures()
    broken: list[str] = []  # schedules whose run broke an invariant ``simulate`` checks: seed and first line
    started = time.perf_counter()
    for seed in range(first, first + count):
        try:
            run_schedule(random_schedule(seed, profile), figures)
        except Exception as error:
            broken.append(f"seed={seed}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
        figures.schedules += 1
    kinds = Counter(re.sub(r"\d+", "N", line.split(": ", 1)[1])[:100] for line in broken)
    print(f"\nsoak[{profile}]: {figures} broken={dict(kinds)} wall={time.perf_counter() - started:.1f}s")
    # Replay one with: run_schedule(random_schedule(seed, profile), SoakFigures())
    examples = "\n".join(broken[:5])
    assert not broken, f"{len(broken)} of {count} {profile} schedules broke an invariant, e.g.\n{examples}"
    assert (figures.lost, figures.duplicated, figures.stalls, figures.busy_loops) == (0, 0, 0, 0), figures
    assert figures.schedules == count and figures.steps > 0
    assert figures.out_of_prompts <= max(1, count // 20)  # injected failures rarely exhaust the prompt supply


# ------------------------------------------------------------------------------------------- the watchdog
def test_watchdog_fails_a_driver_that_never_yields():
    """Issue 19, 3b: e63bcb5's run_step looped needs_budget_round -> grant -> continue without awaiting anything,
    so the event loop never ran again. The watcher thread raises BusyLoop inside the spinning code."""

    async def spin_without_awaiting() -> None:
        await asyncio.sleep(1.0)
        while True:
            pass

    with pytest.raises(BusyLoop, match="ran no iteration"):
        run_virtual(spin_without_awaiting(), watchdog_s=0.5)


def test_watchdog_fails_a_driver_that_yields_without_time_advancing():
    """A driver that awaits only what is already done (virtual time never moves) spins just the same."""

    async def spin_awaiting_nothing() -> None:
        while True:
            await asyncio.sleep(0)

    with pytest.raises(BusyLoop, match="without the clock moving"):
        run_virtual(spin_awaiting_nothing(), max_still_iterations=10_000)


def test_watchdog_lets_long_virtual_runs_and_bursts_at_one_instant_pass():
    """Neither hours of virtual time nor many wake-ups at one instant (a burst of answers) are a busy loop."""

    async def busy_but_progressing() -> int:
        answers = [asyncio.get_running_loop().create_future() for _ in range(5_000)]
        for future in answers:
            asyncio.get_running_loop().call_soon(future.set_result, 1)
        total = sum([await future for future in answers])
        await asyncio.sleep(3_600.0)
        return total

    assert run_virtual(busy_but_progressing(), watchdog_s=5.0, max_still_iterations=20_000) == 5_000
