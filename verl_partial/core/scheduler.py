"""One partial-rollout step: keep the pool full, run segments, stop once enough whole groups are done.

The loop is pure asyncio over two small protocols, so the very code the trainer runs is what the
property tests drive with a simulated engine (random lengths, latencies, failures, hangs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from verl_partial.core.pool import GroupState, RolloutPool, SampleRef, SegmentRequest

P = TypeVar("P")


@dataclass(frozen=True)
class SegmentResult:
    """What one generate call produced: new tokens only, never the prefix it was given."""

    new_ids: list[int]
    new_log_probs: list[float]
    eos: bool
    prompt_ids: list[int] | None = None
    output: Any = None
    route: str | None = None


class SegmentBackend(Protocol[P]):
    async def generate(self, group: GroupState[P], request: SegmentRequest) -> SegmentResult: ...

    async def abort_all(self) -> None:
        """Make every in-flight ``generate`` return promptly with the tokens it has."""

    async def resume(self) -> None:
        """Accept requests again after ``abort_all``."""


class PromptSource(Protocol[P]):
    def next_prompt(self) -> tuple[P, str] | None:
        """The next prompt and its unique key, or None when the source is exhausted."""


class OutOfPrompts(RuntimeError):
    """The step cannot assemble its groups: the source is empty and too few groups are left."""


@dataclass
class StepResult(Generic[P]):
    trained: list[GroupState[P]]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


async def run_step(
    pool: RolloutPool[P],
    backend: SegmentBackend[P],
    source: PromptSource[P],
    *,
    step: int,
    version: int,
    clock: Callable[[], float] | None = None,
) -> StepResult[P]:
    """Generate until ``pool.batch_groups`` groups are finished; park the rest; hand those groups over."""
    clock = clock or asyncio.get_running_loop().time
    started = clock()
    pool.begin_step(step, version)
    tasks: dict[asyncio.Task, SampleRef] = {}
    source_empty = False
    timeout = pool.config.request_timeout_s

    def fill() -> None:
        nonlocal source_empty
        while not source_empty and pool.free_slots() > 0:
            item = source.next_prompt()
            if item is None:
                source_empty = True
            else:
                pool.admit(*item)

    def launch() -> None:
        for ref in pool.runnable():
            request = pool.start(ref)
            group = pool.groups[ref.group_id]
            call: Awaitable[SegmentResult] = backend.generate(group, request)
            tasks[asyncio.ensure_future(asyncio.wait_for(call, timeout))] = ref

    def record(task: asyncio.Task) -> None:
        ref = tasks.pop(task)
        if task.cancelled() or task.exception() is not None:
            pool.fail_segment(ref)
            return
        result: SegmentResult = task.result()
        pool.finish_segment(
            ref,
            result.new_ids,
            result.new_log_probs,
            eos=result.eos,
            prompt_ids=result.prompt_ids,
            output=result.output,
            route=result.route,
        )

    try:
        while True:
            fill()
            if pool.step_done():
                break
            launch()
            if not tasks:
                if pool.needs_budget_round(can_admit=not source_empty):
                    pool.grant_budget_round()
                    continue
                raise OutOfPrompts(
                    f"step {step} needs {pool.batch_groups} finished groups but only {len(pool.ready_groups())} "
                    f"can be assembled: the prompt source is exhausted and {len(pool.groups)} groups remain "
                    "(groups dropped or failed near the end of training exceed partial.extra_groups)"
                )
            done, _ = await asyncio.wait(list(tasks), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                record(task)
        if tasks:
            if pool.config.abort_on_done:
                await backend.abort_all()
            finished, _ = await asyncio.wait(list(tasks))
            for task in finished:
                record(task)
    finally:
        if pool.config.abort_on_done:
            await backend.resume()
        for task in list(tasks):
            task.cancel()
            pool.fail_segment(tasks.pop(task))
    trained = pool.take_ready()
    metrics = pool.step_metrics(trained)
    return StepResult(trained=trained, metrics=metrics, seconds=clock() - started)
