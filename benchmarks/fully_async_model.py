"""verl fully_async's rollouter and trainer, run against the simulated vLLM servers (the simulator's validation).

Benchmark code, not product: it serves ``benchmarks/sim_validate_fully_async.py`` and is checked by
``tests/bench/test_fully_async_model.py``.

The published staleness ablation we validate against (verl ``docs/advance/fully_async.md``) comes from verl's
``fully_async_policy``, not from a step-synchronous colocated loop like ours. Its rollouter streams: it keeps at most
``servers x 16`` prompts (groups of ``n`` answers) in flight and starts a new one as soon as one finishes; it admits
at most ``(1 + staleness_threshold) x required x trigger_parameter_sync_step`` prompts per parameter version (minus
what it carried over); the trainer takes ``required`` finished prompts per local update and, after
``trigger_parameter_sync_step`` updates, pauses the rollouter (with ``partial_rollout`` the running answers are
aborted and resumed on the new weights, first in line; without, they are waited for), syncs the weights (which
resets vLLM's prefix cache) and resumes it. The published "gen" time is the trainer's wait for samples, summed over
the local updates of one version.

This module reproduces that control flow (``verl/experimental/fully_async_policy/fully_async_rollouter.py``
``_processor_worker`` / ``_should_pause_generation`` / ``pause`` / ``update_param_version``, and
``fully_async_trainer.py`` ``fit`` / ``_trigger_parameter_sync_after_step``) in virtual time, so the engine model is
compared with the published figures under the scheduler that produced them. The trainer's compute time per local
update is an input (the published ``update_actor`` and the rest of its step), not something the engine model predicts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from verl_partial.core.partial.finish import Finish
from verl_partial.sim.clock import run_virtual
from verl_partial.sim.engine import ServerSpec, SimServer
from verl_partial.sim.workload import Workload

# fully_async_rollouter.py: max_concurrent_samples = len(server_handles) * 16; the monitor loop re-checks a paused
# rollouter every check_interval = 10.0 s.
_GROUPS_IN_FLIGHT_PER_SERVER = 16
_MONITOR_INTERVAL_S = 10.0


@dataclass(frozen=True)
class FullyAsyncSetup:
    """The fully_async knobs of one run, and the trainer's own time per local update (an input)."""

    required_groups: int  # ppo_mini_batch_size x require_batches (prompts per local update)
    trigger_parameter_sync_step: int
    staleness_threshold: float
    partial_rollout: bool
    train_seconds_per_update: float  # published (step - gen) / trigger_parameter_sync_step
    param_sync_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.required_groups < 1 or self.trigger_parameter_sync_step < 1 or self.staleness_threshold < 0:
            raise ValueError(
                "async_training: need required_groups >= 1, trigger_parameter_sync_step >= 1 and "
                f"staleness_threshold >= 0; got {self.required_groups}, {self.trigger_parameter_sync_step}, "
                f"{self.staleness_threshold}"
            )

    @property
    def max_required_groups(self) -> int:
        return int(self.required_groups * (self.staleness_threshold + 1) * self.trigger_parameter_sync_step)


@dataclass
class FullyAsyncRun:
    """Per parameter version: the trainer's wait for samples ("gen"), its wall time, tokens generated, prompts admitted.

    ``resumed_answers``: answers continued after an abort (partial rollout); ``max_groups_in_flight``: the most
    prompts the rollouter had running at once.
    """

    gen_seconds: list[float] = field(default_factory=list)
    version_seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    resumed_answers: int = 0
    max_groups_in_flight: int = 0


@dataclass(eq=False)
class _Group:
    prompt: int
    key: str
    done: list[int]  # tokens generated so far, per answer
    finished: list[bool]


class _FullyAsync:
    def __init__(self, setup: FullyAsyncSetup, workload: Workload, spec: ServerSpec, servers: int) -> None:
        self.setup, self.workload = setup, workload
        self.engines = [SimServer(spec, f"sim{i}") for i in range(servers)]
        self.max_concurrent = min(servers * _GROUPS_IN_FLIGHT_PER_SERVER, setup.max_required_groups)
        self.queue: deque[_Group] = deque()  # finished groups for the trainer (MessageQueue)
        self.cancelled: deque[_Group] = deque()  # partial groups, resumed first (cancel_queue)
        self.active: set[asyncio.Task[None]] = set()
        self.issued = 0
        self.staleness_samples = 0
        self.paused = False
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.produced = asyncio.Event()
        self.monitor_may_resume = True
        self.failures: list[BaseException] = []
        self.tokens = 0
        self.resumed = 0
        self.max_in_flight = 0

    def should_pause(self) -> bool:
        return len(self.queue) >= self.setup.max_required_groups or (
            self.staleness_samples >= self.setup.max_required_groups
        )

    async def answer(self, group: _Group, index: int) -> None:
        engine = min(self.engines, key=lambda e: e.load())
        load = self.workload
        length = min(load.length(group.prompt, group.key, index, 0), load.response_length)
        held = group.done[index]
        outcome = await engine.submit(
            group.key, f"{group.key}/{index}", load.prompt_len, load.prompt_len + held, length - held,
            load.response_length - held,
        )  # fmt: skip
        group.done[index] += outcome.tokens
        self.tokens += outcome.tokens
        group.finished[index] = outcome.finish is not Finish.ABORTED

    async def process(self, group: _Group) -> None:
        pending = [i for i, finished in enumerate(group.finished) if not finished]
        if any(group.done[i] for i in pending):
            self.resumed += sum(1 for i in pending if group.done[i])
        await asyncio.gather(*(self.answer(group, i) for i in pending))
        if all(group.finished):
            self.queue.append(group)
            self.produced.set()
        else:
            self.cancelled.append(group)

    def start(self, group: _Group) -> None:
        task = asyncio.ensure_future(self.process(group))
        self.active.add(task)
        self.max_in_flight = max(self.max_in_flight, len(self.active))
        task.add_done_callback(self.finished)

    def finished(self, task: asyncio.Task[None]) -> None:
        self.active.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())

    async def wait_active(self, below: int) -> None:
        """Wait until fewer than ``below`` groups are in flight (``below=1``: all of them returned)."""
        while len(self.active) >= below:
            await asyncio.wait(list(self.active), return_when=asyncio.FIRST_COMPLETED)

    async def rollouter(self) -> None:
        """``_processor_worker``: stream prompts, at most ``max_concurrent`` in flight, paused by staleness."""
        while True:
            if self.paused or self.should_pause():
                self.paused = True
                self.unpaused.clear()
                await self.wait_active(1)
                await self.unpaused.wait()
                continue
            if self.cancelled:
                group = self.cancelled.popleft()
            else:
                prompt = self.issued % self.workload.prompts
                group = _Group(prompt, f"p{prompt}@{self.issued}", [0] * self.workload.n, [False] * self.workload.n)
                self.issued += 1
                self.staleness_samples += 1
            await self.wait_active(self.max_concurrent)
            await self.unpaused.wait()
            self.start(group)

    async def monitor(self) -> None:
        """``_async_monitor_loop``: a rollouter paused by its own limits resumes once they no longer hold."""
        while True:
            await asyncio.sleep(_MONITOR_INTERVAL_S)
            if self.paused and self.monitor_may_resume and not self.should_pause():
                self.paused = False
                self.unpaused.set()

    async def sync_weights(self) -> None:
        """``ParameterSynchronizer.sync_weights``: pause (abort with partial rollout), new weights, resume."""
        self.paused = True
        self.unpaused.clear()
        self.monitor_may_resume = False
        if self.setup.partial_rollout:
            for engine in self.engines:
                engine.abort_all()
        await self.wait_active(1)
        if self.failures:
            raise self.failures[0]
        for engine in self.engines:
            engine.update_weights()
            engine.resume()
        await asyncio.sleep(self.setup.param_sync_seconds)
        self.staleness_samples = len(self.active) + len(self.cancelled) + len(self.queue)
        self.paused = False
        self.monitor_may_resume = True
        self.unpaused.set()

    async def trainer(self, versions: int) -> FullyAsyncRun:
        loop = asyncio.get_running_loop()
        setup, run = self.setup, FullyAsyncRun()
        for _ in range(versions):
            start, gen, tokens, issued = loop.time(), 0.0, self.tokens, self.issued
            for _ in range(setup.trigger_parameter_sync_step):
                waited = loop.time()
                while len(self.queue) < setup.required_groups:
                    self.produced.clear()
                    await self.produced.wait()
                gen += loop.time() - waited
                for _ in range(setup.required_groups):
                    self.queue.popleft()
                await asyncio.sleep(setup.train_seconds_per_update)
            await self.sync_weights()
            run.gen_seconds.append(gen)
            run.version_seconds.append(loop.time() - start)
            run.tokens.append(self.tokens - tokens)
            run.admitted.append(self.issued - issued)
        run.resumed_answers, run.max_groups_in_flight = self.resumed, self.max_in_flight
        return run


def simulate_fully_async(
    setup: FullyAsyncSetup, workload: Workload, spec: ServerSpec, servers: int, versions: int
) -> FullyAsyncRun:
    """``versions`` parameter versions of verl fully_async on ``servers`` simulated vLLM servers, in virtual time."""

    async def main() -> FullyAsyncRun:
        system = _FullyAsync(setup, workload, spec, servers)
        background = [asyncio.ensure_future(system.rollouter()), asyncio.ensure_future(system.monitor())]
        try:
            return await system.trainer(versions)
        finally:
            for task in background:
                task.cancel()
            for task in list(system.active):
                task.cancel()

    return run_virtual(main())
