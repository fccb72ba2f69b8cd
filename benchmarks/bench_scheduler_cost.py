"""Driver CPU cost of the partial-rollout scheduler itself at job size.

    python -m benchmarks.bench_scheduler_cost 512          # prompts per step; n = 16, extra groups = prompts / 8
    python -m benchmarks.bench_scheduler_cost 512 --prof   # with a profile of the top functions
    python -m benchmarks.bench_scheduler_cost 512 --default  # the +partial=default settings (wait + refill)

The real ``run_step`` and ``RolloutPool`` (pure core) drive a backend that answers each call after a virtual delay
proportional to its length (lognormal, median 6k tokens, cap 16k, 30 tokens/s per request, 8 servers) on a
virtual-clock event loop. No model and no Ray: the process CPU time of a step is the scheduler's own bookkeeping,
which runs on the trainer's driver thread.
"""

from __future__ import annotations

import asyncio
import cProfile
import dataclasses
import pstats
import sys
import time

import numpy as np

from verl_partial.config.partial import PRESETS
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import GroupState, RolloutPool, SegmentRequest, SegmentResult
from verl_partial.core.partial.scheduler import run_step
from verl_partial.sim.clock import run_virtual

N, RESPONSE_LENGTH, TOKENS_PER_S, SERVERS, STEPS = 16, 16384, 30.0, 8, 3
PROMPT_IDS = np.arange(3, 13, dtype=np.int32)  # every segment reports the same tokenised prompt, as engines do


class InstantBackend:
    """Answers every call after ``length / TOKENS_PER_S`` virtual seconds; abort and take-back return the tokens so
    far, a cancelled call gets nothing (as on every real engine)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.servers = [f"s{i}" for i in range(SERVERS)]
        self.pending: dict[str, tuple[asyncio.Future, asyncio.TimerHandle, SegmentRequest, int, float]] = {}

    def launch(self, wave: list[tuple[GroupState, SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        loop = asyncio.get_running_loop()
        futures = []
        for _group, request in wave:
            future = loop.create_future()
            length = int(min(RESPONSE_LENGTH, self.rng.lognormal(np.log(6000), 0.9)))
            length = max(1, min(length, request.max_new_tokens))
            handle = loop.call_later(length / TOKENS_PER_S, self._answer, request.request_id, length, Finish.EOS)
            self.pending[request.request_id] = (future, handle, request, length, loop.time())
            futures.append(future)
        return futures

    def _answer(self, request_id: str, tokens: int, finish: Finish) -> None:
        future, handle, request, _, _ = self.pending.pop(request_id)
        handle.cancel()
        if not future.done():
            ids = np.arange(tokens, dtype=np.int32) % 100 + 3
            result = SegmentResult(ids, np.zeros(tokens, np.float32), finish, request.server, None, PROMPT_IDS)
            future.set_result(result)

    def _abort(self, request_id: str) -> None:
        _, _, _, length, started = self.pending[request_id]
        done = int(min(length, (asyncio.get_running_loop().time() - started) * TOKENS_PER_S))
        self._answer(request_id, done, Finish.ABORTED)

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        for request in requests:
            if request.request_id in self.pending:
                self._abort(request.request_id)

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        for request in requests:
            if request.request_id in self.pending:
                self._answer(request.request_id, 0, Finish.ABORTED)

    async def abort_all(self) -> None:
        for request_id in list(self.pending):
            self._abort(request_id)

    async def resume(self) -> None:
        return None


class EndlessPrompts:
    def __init__(self) -> None:
        self.drawn = 0

    def next_prompt(self) -> tuple[int, str]:
        self.drawn += 1
        return self.drawn, f"p{self.drawn}"


async def measure(prompts: int, default: bool) -> None:
    if default:  # +partial=default: wait + refill, staleness <= 1
        config = PRESETS["default"]
    else:  # the restart preset's pool (groups admitted at the step start) with keep, an eighth extra
        config = dataclasses.replace(PRESETS["restart"], extra_groups=prompts // 8, staleness_policy="keep")
    pool: RolloutPool[int] = RolloutPool(config, group_size=N, batch_groups=prompts, response_length=RESPONSE_LENGTH)
    backend, source = InstantBackend(), EndlessPrompts()
    for step in range(1, STEPS + 1):
        started = time.process_time()
        result = await run_step(pool, backend, source, step=step, version=step - 1)
        cpu = time.process_time() - started
        print(f"{prompts} x {N}, step {step}: scheduler CPU {cpu:.2f} s for {result.seconds:.0f} virtual s of rollout")


def main() -> None:
    prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    profile = cProfile.Profile() if "--prof" in sys.argv else None
    if profile is not None:
        profile.enable()
    run_virtual(measure(prompts, "--default" in sys.argv))
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumtime").print_stats(18)


if __name__ == "__main__":
    main()
