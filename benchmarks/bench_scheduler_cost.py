"""Driver cost of the partial-rollout scheduler per step at job size: CPU seconds, wake-ups and Ray calls.

    python -m benchmarks.bench_scheduler_cost --json benchmarks/results/scheduler_cost.json  # 512 prompts x 16, 3 steps
    python -m benchmarks.bench_scheduler_cost --prompts 64 --steps 1 --prof  # with a profile of the top functions

The real ``run_step`` and ``RolloutPool`` (pure core, as verl's driver thread runs them; ``+partial=default`` unless
``--preset``) drive a stand-in engine on a virtual-clock event loop (``verl_partial.sim.clock``): a call answers after
``length / 30`` virtual seconds, lengths lognormal (median 6k tokens, cap 16k); take-back and abort return the tokens
so far, cancel none. No model, no Ray.

Measured: the process CPU time (``time.process_time``: other processes do not count) of each ``run_step``, i.e. the
scheduler's bookkeeping plus the stand-in's (one timer per call), an upper bound on the driver thread's share.
Counted per step: scheduler wake-ups (``_Step.wait`` calls), calls launched and answered, launch waves, and the Ray
calls the glue (verl_partial/glue/partial/segment_backend.py) would make for them with ``--workers`` AgentLoopWorkers
(a group's calls go to worker ``group_id % workers``):

* launch: the glue's :class:`~verl_partial.core.partial.launch_window.LaunchWindow` (at most one flush per
  ``LAUNCH_WINDOW_S``, the first at once), one streaming ``run_segments`` call per worker a flush touches (``_flush``);
* take-back / cancel: one ``take_back_segments`` / ``cancel_segments`` per worker holding sent calls among them (a call
  still in its launch window is dropped there, no Ray call: ``_sent_by_worker``);
* abort / resume / progress of a server: one Ray call per control server of its replica (``EngineAdapter``), counted
  as one (one server per replica);
* score: the groups that finished since the last scoring call go to their workers' ``score``, one Ray call per
  worker they touch (the glue's ``WorkerGroupScorer``, on whenever verl has reward loop workers); a call answers after
  ``SCORE_S`` virtual seconds.

verl's own: ``AgentLoopManager.generate_sequences`` (verl 0.9.1, verl/experimental/agent_loop/agent_loop.py) sends one
``generate_sequences`` Ray call per AgentLoopWorker per step, i.e. ``--workers`` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import pstats
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._machine import git_commit, machine
from verl_partial.config.partial import PRESETS
from verl_partial.core.partial import scheduler
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.group_filter import SampleScore
from verl_partial.core.partial.launch_window import LAUNCH_WINDOW_S, LaunchWindow
from verl_partial.core.partial.on_policy import length_estimator
from verl_partial.core.partial.pool import GroupState, RolloutPool, SegmentRequest, SegmentResult
from verl_partial.sim.clock import run_virtual

RESPONSE_LENGTH, MEDIAN_TOKENS, TOKENS_PER_S = 16384, 6000, 30.0
PROMPT_IDS = np.arange(3, 13, dtype=np.int32)  # every segment reports the same tokenised prompt, as engines do
CONTROLS = ("take_back_segments", "cancel_segments", "abort", "resume", "progress", "score")
SCORE_S = 1.0  # virtual seconds a scoring call takes (a rule-based reward on verl's reward loop workers)
VERL_SOURCE = "verl/experimental/agent_loop/agent_loop.py:AgentLoopManager.generate_sequences (verl 0.9.1)"


class StandInEngine:
    """The scheduler's backend: answers each call after ``length / TOKENS_PER_S`` virtual seconds, and counts."""

    def __init__(self, servers: int, workers: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.servers = [f"s{i}" for i in range(servers)]
        self.workers = workers
        self.pending: dict[str, tuple[asyncio.Future[SegmentResult], asyncio.TimerHandle, SegmentRequest, int, float]]
        self.pending = {}
        self.count: Counter[str] = Counter()
        self.window: set[str] = set()  # calls of the open launch window (not sent yet, as in the glue)
        self.window_workers: set[int] = set()
        self.launch_window = LaunchWindow(self._flush)  # the glue's rule, the glue's class

    def begin_step(self) -> None:  # the glue's: a step's loop ends with it, and its unfired flush
        self.launch_window.reset()
        self.window.clear()
        self.window_workers.clear()

    def launch(self, wave: list[tuple[GroupState, SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        loop = asyncio.get_running_loop()
        self.count["waves"] += 1
        self.count["launched"] += len(wave)
        futures = []
        for group, request in wave:
            future = loop.create_future()
            length = int(min(RESPONSE_LENGTH, self.rng.lognormal(np.log(MEDIAN_TOKENS), 0.9)))
            length = max(1, min(length, request.max_new_tokens))
            handle = loop.call_later(length / TOKENS_PER_S, self._answer, request.request_id, length, Finish.EOS)
            self.pending[request.request_id] = (future, handle, request, length, loop.time())
            self.window.add(request.request_id)
            self.window_workers.add(group.group_id % self.workers)
            futures.append(future)
        self.launch_window.request()
        return futures

    def _flush(self) -> None:
        self.count["run_segments"] += len(self.window_workers)
        self.window.clear()
        self.window_workers.clear()

    def _answer(self, request_id: str, tokens: int, finish: Finish) -> None:
        if request_id not in self.pending:  # answered already (an abort and a take-back of the same call)
            return
        future, handle, request, _, _ = self.pending.pop(request_id)
        handle.cancel()
        self.window.discard(request_id)
        self.count["answered"] += 1
        ids = np.arange(tokens, dtype=np.int32) % 100 + 3
        future.set_result(SegmentResult(ids, np.zeros(tokens, np.float32), finish, request.server, None, PROMPT_IDS))

    def _end(self, request_id: str, tokens_so_far: bool) -> None:
        """A control call ends this call: its answer arrives a moment later (the glue's comes back through its
        stream), so a take-back sent right after an abort still finds it out, as the glue's does."""
        tokens = self._so_far(request_id) if tokens_so_far else 0
        asyncio.get_running_loop().call_soon(self._answer, request_id, tokens, Finish.ABORTED)

    def _so_far(self, request_id: str) -> int:
        _, _, _, length, started = self.pending[request_id]
        return int(min(length, (asyncio.get_running_loop().time() - started) * TOKENS_PER_S))

    def _sent(self, requests: list[SegmentRequest], ray_call: str) -> list[str]:
        """The calls still out; one Ray call per worker holding sent ones; those in the launch window end here."""
        out = [request for request in requests if request.request_id in self.pending]
        for request in out:
            if request.request_id in self.window:
                self._answer(request.request_id, 0, Finish.ABORTED)
        sent = [request for request in out if request.request_id in self.pending]
        self.count[ray_call] += len({request.ref.group_id % self.workers for request in sent})
        return [request.request_id for request in sent]

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        for request_id in self._sent(requests, "take_back_segments"):
            self._end(request_id, tokens_so_far=True)

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        for request_id in self._sent(requests, "cancel_segments"):
            self._end(request_id, tokens_so_far=False)

    async def abort(self, server: str) -> None:
        self.count["abort"] += 1
        for request_id, (_, _, request, _, _) in list(self.pending.items()):
            if request.server == server:
                self._end(request_id, tokens_so_far=True)

    async def resume(self, server: str) -> None:
        self.count["resume"] += 1

    def reopening(self) -> dict[str, Any]:
        return {}

    async def progress(self, server: str) -> dict[str, int]:
        self.count["progress"] += 1
        return {
            rid: self._so_far(rid) for rid, (_, _, request, _, _) in self.pending.items() if request.server == server
        }


class StandInScorer:
    """The glue's ``WorkerGroupScorer``: one ``score`` Ray call per worker holding groups of the batch (a group's
    worker is ``group_id % workers``), answered after ``SCORE_S`` virtual seconds."""

    def __init__(self, count: Counter[str], workers: int) -> None:
        self.count, self.workers = count, workers

    async def score(self, groups: list[GroupState]) -> list[list[SampleScore]]:
        self.count["score"] += len({group.group_id % self.workers for group in groups})
        await asyncio.sleep(SCORE_S)
        return [[SampleScore(0.0, {}) for _ in group.samples] for group in groups]


class EndlessPrompts:
    def __init__(self) -> None:
        self.drawn = 0

    def next_prompt(self) -> tuple[int, str]:
        self.drawn += 1
        return self.drawn, f"p{self.drawn}"


@contextlib.contextmanager
def counting_wakeups(count: Counter[str]) -> Iterator[None]:
    """Counts the scheduler's wake-ups: every turn of its loop awaits ``_Step.wait`` once."""
    original = scheduler._Step.wait

    async def wait(self: Any, timeout: float | None) -> float:
        count["wakeups"] += 1
        return await original(self, timeout)

    scheduler._Step.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        scheduler._Step.wait = original  # type: ignore[method-assign]


async def _steps(prompts: int, n: int, steps: int, servers: int, workers: int, preset: str) -> list[dict[str, Any]]:
    config = PRESETS[preset]
    # longest_first (on_policy) and length windows need the estimator the glue builds; prompts are their own identity.
    estimator = length_estimator(config, identity=lambda prompt: prompt)
    pool: RolloutPool[int] = RolloutPool(config, group_size=n, batch_groups=prompts, response_length=RESPONSE_LENGTH,
                                         priority=estimator.priority if estimator else None)  # fmt: skip
    # The stand-in decodes every call it holds at once, up to the router's cap (no GPU, so no knee): its slots.
    pool.engine_slots = servers * pool.calls_cap()
    engine, source, out = StandInEngine(servers, workers), EndlessPrompts(), []
    scorer = StandInScorer(engine.count, workers)
    with counting_wakeups(engine.count):
        for step in range(1, steps + 1):
            engine.begin_step()
            before = Counter(engine.count)
            started = time.process_time()
            result = await scheduler.run_step(pool, engine, source, step=step, version=step - 1, scorer=scorer)
            cpu = time.process_time() - started
            if estimator is not None:
                estimator.record(result.trained)
            counts = {key: engine.count[key] - before[key] for key in engine.count}
            ray = {key: counts.get(key, 0) for key in ("run_segments", *CONTROLS)}
            out.append({"step": step, "cpu_s": round(cpu, 3), "virtual_s": round(result.seconds, 1),
                        "trained_groups": len(result.trained), "outstanding_after": len(engine.pending),
                        **{key: counts.get(key, 0) for key in ("wakeups", "waves", "launched", "answered")},
                        "ray_calls": ray, "ray_calls_total": sum(ray.values())})  # fmt: skip
            print(f"{prompts} x {n}, step {step}: driver CPU {cpu:.2f} s for {result.seconds:.0f} virtual s; "
                  f"{out[-1]['wakeups']} wake-ups, {out[-1]['waves']} waves, Ray calls {ray}", flush=True)  # fmt: skip
    return out


def measure(prompts: int = 512, n: int = 16, steps: int = 3, servers: int = 8, workers: int = 8,
            preset: str = "default") -> dict[str, Any]:  # fmt: skip
    """Every step's CPU seconds and counts, and verl's Ray calls per step for the same workers."""
    workload = {"prompts": prompts, "n": n, "steps": steps, "servers": servers, "workers": workers, "preset": preset,
                "response_length": RESPONSE_LENGTH, "median_tokens": MEDIAN_TOKENS, "tokens_per_s": TOKENS_PER_S,
                "launch_window_s": LAUNCH_WINDOW_S}  # fmt: skip
    rows = run_virtual(_steps(prompts, n, steps, servers, workers, preset))
    return {"workload": workload, "steps": rows, "verl_ray_calls_per_step": workers, "verl_source": VERL_SOURCE}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8, help="AgentLoopWorkers (verl's default num_workers)")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS))
    parser.add_argument("--json", type=Path, help="write the results (with date, command and commit) here")
    parser.add_argument("--prof", action="store_true", help="print a profile of the top functions")
    args = parser.parse_args(argv)
    profile = cProfile.Profile() if args.prof else None
    if profile is not None:
        profile.enable()
    results = measure(args.prompts, args.n, args.steps, args.servers, args.workers, args.preset)
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumtime").print_stats(18)
    if args.json is not None:
        command = "python -m benchmarks.bench_scheduler_cost " + " ".join(argv if argv is not None else sys.argv[1:])
        head = {"command": command.strip(), "machine": machine(), "commit": git_commit(), "label": "simulated"}
        args.json.write_text(json.dumps(head | results, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
