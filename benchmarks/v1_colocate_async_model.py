"""verl 0.9.1's own partial rollout (v1 trainer, ``trainer.v1.trainer_mode=colocate_async``), run against the
simulated vLLM servers, so the GPU-regime tables can put the peer beside our scheduler like for like.

Benchmark code, not product: it serves ``benchmarks/sim_v1_peer.py`` and is checked by
``tests/bench/test_v1_colocate_async_model.py``. It drives the same engine model as ``verl_partial.sim.run``
(``SimBackend`` over ``SimServer``, the same ``Workload`` answers, ``run_virtual``'s virtual clock); only the control
flow above the engines is v1's instead of our ``run_step``.

Rules modelled, each from verl 0.9.1's source (``verl/trainer/ppo/v1/`` unless a path says otherwise):

* **Step order.** ``trainer_base.py`` ``PPOTrainer.fit``: ``global_steps`` starts at 1; ``on_train_begin`` then, per
  step, ``step`` -> ``prepare_step`` (``_add_batch_to_generate``: ``train_batch_size`` new prompt groups, tagged
  with the current ``global_steps`` by ``_next_train_batch`` / ``_submit_batch_to_rollout``) -> ``_step_once``
  (``replay_buffer.sample``, then ``on_sample_end``) -> training -> ``on_step_end``. ``parameter_sync_step`` is 1
  for colocate_async (no key under ``trainer.v1.colocate_async``), so one sample per step.
* **Warm-up batches.** ``trainer_colocate_async.py`` ``on_train_begin`` -> ``trainer_base.py``
  ``_add_async_warmup_batches``: ``floor(num_warmup_batches x train_batch_size / gen_batch_size) x gen_batch_size``
  groups (``gen_batch_size`` forced to 1 for async, ``_init_dataloader``), default ``num_warmup_batches`` 1
  (``trainer/config/_generated_ppo_trainer.yaml``). They are submitted once, before step 1, so every phase
  generates about one batch ahead of the one it trains.
* **All of a batch runs at once.** ``agent_loop_tq.py`` ``AgentLoopWorkerTQ.generate_sequences`` fires one task per
  prompt and ``_run_prompt`` one per sample (``n``); nothing caps the groups in flight, the engines queue what does
  not fit (``max_num_seqs``, the KV cache). A group is ``finished`` when all ``n`` sessions have returned.
* **Routing.** ``workers/rollout/router.py`` ``GlobalRequestLoadBalancer.acquire_server``: sticky by request id
  (an LRU of 10,000 ids), else the server with the fewest in-flight calls, ties at random; ``release_server`` after
  each call (``workers/rollout/llm_server.py`` ``LLMServerClient.generate``). A sample keeps its request id across
  retries (``FullyAsyncLLMServerClient.generate`` passes the same ``request_id``), so it returns to its server.
* **Sampling.** ``replay_buffer.py`` ``ReplayBufferAsync.sample`` / ``wait_for_sampleable``: look at the
  finished groups; evict the stale ones (below) and refill exactly as many fresh groups (``refill_fn`` =
  ``_add_prompts_to_generate``, tagged with the current step) and look again at once; otherwise, if
  ``_has_enough_samples``, take the ``train_batch_size`` finished groups with the oldest submission tag
  (``_select_prompt_uids``; ties in set order, here a fixed pseudo-random order); otherwise sleep
  ``poll_interval`` = 2.0 s (``_wait_for_next_poll``; the trainer passes no value, ``_build_replay_buffer``) and
  look again.
* **Staleness.** ``max_off_policy_threshold`` (default 8) counts the versions a group spans **from its submission**:
  ``global_steps - prompt global_steps + 1`` (the prompt's tag, not the trajectories' min/max ``global_steps``,
  which only feed metrics: ``trainer_base.py`` ``_compute_metrics``). ``drop`` (default,
  ``_stale_terminal_keys``): a *finished* group over the threshold is evicted and its tokens thrown away; an
  unfinished one keeps generating until it finishes. ``wait`` (``_has_enough_samples``): no batch is taken while
  any unfinished group has reached the threshold (``>=``). Threshold 2 + ``wait`` is our ``max_staleness: 1``.
* **Step end.** ``trainer_colocate_async.py`` ``on_sample_end``: ``abort_replicas()`` (``checkpoint_engine/base.py``
  -> ``vllm_async_server.py`` ``abort_all_requests(reject_request=False)``: close the gate, wait -- up to 60 s --
  while an admitted request has no output, then ``pause_generation``, every running request ends ``aborted`` with
  its tokens) and ``sleep_replicas``. The phase ends when every call has returned (vLLM drains before it pauses).
  ``SimBackend.abort`` of every server is that same barrier and abort.
* **Resume.** ``on_step_end``: ``update_weights(global_steps)`` (the engines' version becomes the step number;
  ``on_init_end`` set 0, so step ``k`` generates on version ``k - 1``; waking the replicas resets the prefix
  cache: ``SimBackend.update_weights``) and ``resume_generation_replicas``.
* **Aborted requests keep their tokens.** ``workers/rollout/llm_server.py`` ``FullyAsyncLLMServerClient.generate``:
  the output's tokens are appended, ``max_tokens`` becomes ``response_length`` minus all tokens so far, and after
  ``await asyncio.sleep(1)`` the call is retried with prompt + tokens so far; ``min_global_steps`` is the version
  of its first output, ``max_global_steps`` of its last. A retry that reaches a closed gate parks until the resume
  (``vllm_async_server.py`` ``_park_until_admitted``, ``reject_request=False``): so the 1 s costs generation time
  only when the update between abort and resume is shorter than 1 s (``V1Setup.update_s``).

Left out, and why:

* **Training and weight-sync time** (``V1Setup.update_s`` only says how long the gate stays closed; it is not part
  of the rollout phase), like ``verl_partial.sim.run``: the tables compare rollout phases.
* **Driver and TransferQueue latency** (``kv_list`` per poll, ``kv_batch_put``, Ray calls, the dataloader, metrics
  between the resume and the next ``prepare_step``, during which v1's engines already generate): milliseconds to a
  second per step, not modelled on either side; the tables hold minutes-long phases.
* **DAPO group filtering, failed groups, validation, checkpoint resume** (``_dapo_filtered_keys``, failure
  eviction, ``_reissue_inflight_prompts``): off by default and not part of the comparison.
* **Multi-turn agent loops**: one turn per sample, as in the projection.
* **The 1 s retry of an empty load balancer** (``_acquire_server`` with ``only_hybrid``): colocated replicas never
  leave the balancer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import GroupState, SampleRef, SegmentRequest, SegmentResult
from verl_partial.sim.backend import SimBackend
from verl_partial.sim.clock import run_virtual
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.run import ModeRun
from verl_partial.sim.workload import PromptCycle, Workload

# replay_buffer.py ReplayBuffer.__init__: poll_interval default; llm_server.py FullyAsyncLLMServerClient.generate:
# asyncio.sleep(1) before a retry; router.py DEFAULT_ROUTING_CACHE_SIZE.
POLL_INTERVAL_S = 2.0
RETRY_DELAY_S = 1.0
ROUTING_CACHE_SIZE = 10_000
STRATEGIES = ("drop", "wait")


@dataclass(frozen=True)
class V1Setup:
    """The colocate_async knobs (``trainer.v1.*``; defaults are verl 0.9.1's) and what the model needs beside them.

    ``max_off_policy_threshold`` None disables staleness control (verl's ``null``). ``update_s``: virtual seconds
    between the drained abort and the resume (training and weight sync; not counted in the rollout phase). It
    matters only below ``retry_delay_s``: a retry arriving earlier parks at the gate until the resume.
    ``trace``: record every call's launch and return (tests read the delays from it).
    """

    max_off_policy_threshold: int | None = 8
    max_off_policy_strategy: str = "drop"
    num_warmup_batches: float = 1.0
    poll_interval_s: float = POLL_INTERVAL_S
    retry_delay_s: float = RETRY_DELAY_S
    update_s: float = 0.0
    seed: int = 0
    trace: bool = False

    def __post_init__(self) -> None:
        if self.max_off_policy_threshold is not None and self.max_off_policy_threshold < 1:
            raise ValueError(f"max_off_policy_threshold must be >= 1 or None, got {self.max_off_policy_threshold}")
        if self.max_off_policy_strategy not in STRATEGIES:
            raise ValueError(f"max_off_policy_strategy must be one of {STRATEGIES}, got {self.max_off_policy_strategy}")
        if min(self.num_warmup_batches, self.update_s) < 0 or min(self.poll_interval_s, self.retry_delay_s) <= 0:
            raise ValueError(f"warm-up batches and update_s must be >= 0, poll and retry delays > 0: {self}")


@dataclass(frozen=True)
class CallEvent:
    """One engine call of one sample: when it was launched, when it returned, with how many tokens and why."""

    sample: str
    launched: float
    returned: float
    tokens: int
    finish: Finish


@dataclass
class V1Run:
    """Per-step records of one colocate_async run; ``record`` holds what ``verl_partial.sim.run.summarize`` reads.

    ``record.staleness_*`` are per token in our units (versions between a token's policy and the step that trains
    it: v1's ``trajectory_staleness_worst`` for a trajectory's oldest token); ``record.group_waits`` are steps from
    a group's submission to its training. ``threshold_span_max``: the largest ``global_steps - tag + 1`` trained
    (what ``max_off_policy_threshold`` bounds); ``trajectory_span_max``: v1's ``trajectory_spans/max`` (versions
    one answer was generated on). ``sample_s``: from the phase start to the poll that took the batch.
    """

    record: ModeRun = field(default_factory=ModeRun)
    sample_s: list[float] = field(default_factory=list)
    polls: list[int] = field(default_factory=list)
    evicted_groups: list[int] = field(default_factory=list)
    threshold_span_max: list[int] = field(default_factory=list)
    trajectory_span_max: list[int] = field(default_factory=list)
    trained_keys: list[list[str]] = field(default_factory=list)
    evicted_keys: list[str] = field(default_factory=list)
    submitted_keys: list[str] = field(default_factory=list)
    outstanding_keys: list[str] = field(default_factory=list)
    resumed_calls: int = 0
    phase_starts: list[float] = field(default_factory=list)
    resumes: list[float] = field(default_factory=list)
    calls: list[CallEvent] = field(default_factory=list)

    def steady(self, warmup: int, steps: int | None = None) -> V1Run:
        """The per-step records of ``steps`` steps after the first ``warmup`` (run-wide lists are kept whole)."""
        end = None if steps is None else warmup + steps
        per_step = ("sample_s", "polls", "evicted_groups", "threshold_span_max", "trajectory_span_max", "trained_keys")
        cut = {name: getattr(self, name)[warmup:end] for name in per_step}
        return dataclasses.replace(self, record=self.record.steady(warmup, steps), **cut)


class _Router:
    """``GlobalRequestLoadBalancer``: sticky by request id (LRU), else fewest in-flight calls, ties at random."""

    def __init__(self, servers: list[str], rng: random.Random) -> None:
        self.inflight = dict.fromkeys(servers, 0)
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.rng = rng

    def acquire(self, request_id: str) -> str:
        server = self.sticky.get(request_id)
        if server is not None:
            self.sticky.move_to_end(request_id)  # cachetools.LRUCache: a read refreshes the entry
        else:
            least = min(self.inflight.values())
            server = self.rng.choice([s for s, count in self.inflight.items() if count == least])
            self.sticky[request_id] = server
            if len(self.sticky) > ROUTING_CACHE_SIZE:
                self.sticky.popitem(last=False)
        self.inflight[server] += 1
        return server

    def release(self, server: str) -> None:
        self.inflight[server] = max(0, self.inflight[server] - 1)


@dataclass(eq=False)
class _Group:
    """A prompt group in TransferQueue: its tag (``global_steps`` at submission) and, per sample, the tokens it holds
    by the weight version that generated them, and the versions of its first and last outputs."""

    state: GroupState[int]
    tag: int
    tie: int
    tokens: list[int]
    by_version: list[dict[int, int]]
    first_version: list[int | None]
    last_version: list[int | None]
    sessions_done: int = 0

    @property
    def key(self) -> str:
        return self.state.key

    def finished(self, n: int) -> bool:
        return self.sessions_done == n


class _ColocateAsync:
    def __init__(self, setup: V1Setup, workload: Workload, spec: ServerSpec, servers: int) -> None:
        self.setup, self.workload = setup, workload
        self.backend = SimBackend(spec, servers, workload)
        self.router = _Router(list(self.backend.servers), random.Random(setup.seed))
        self.source = PromptCycle(workload)
        self.groups: dict[str, _Group] = {}  # submitted, neither trained nor evicted (TransferQueue's prompts)
        self.calls_in_flight = 0
        self.drained = asyncio.Event()
        self.sessions: set[asyncio.Task[None]] = set()
        self.failures: list[BaseException] = []
        self.global_steps = 0
        self.paused = False  # the servers' submission gate (vLLMHttpServer._submission_paused)
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.run = V1Run()
        self.step_generated = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # ------------------------------------------------------------------ rollout side
    def submit(self, count: int) -> None:
        """``_add_prompts_to_generate``: ``count`` new groups tagged with the current step, every session started."""
        n = self.workload.n
        for _ in range(count):
            prompt, key = self.source.next_prompt()
            tie = int.from_bytes(hashlib.blake2b(f"{self.setup.seed}/{key}".encode(), digest_size=8).digest(), "big")
            state: GroupState[int] = GroupState(group_id=len(self.run.submitted_keys), key=key, prompt=prompt,
                                                samples=[])  # fmt: skip
            group = _Group(state, self.global_steps, tie, [0] * n, [{} for _ in range(n)], [None] * n, [None] * n)
            self.groups[key] = group
            self.run.submitted_keys.append(key)
            for index in range(n):
                task = asyncio.ensure_future(self.session(group, index))
                self.sessions.add(task)
                task.add_done_callback(self._session_done)

    def _session_done(self, task: asyncio.Task[None]) -> None:
        self.sessions.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())

    async def session(self, group: _Group, index: int) -> None:
        """``FullyAsyncLLMServerClient.generate``: call, keep the tokens, retry an aborted call 1 s later."""
        limit = self.workload.response_length
        request_id = f"{group.key}/{index}"
        calls = 0
        while True:
            while self.paused:  # _park_until_admitted: a closed gate parks the request until the resume
                await self.resumed.wait()
            server = self.router.acquire(request_id)
            held = group.tokens[index]
            request = SegmentRequest(SampleRef(group.state.group_id, index), f"{request_id}/{calls}#", held,
                                     limit - held, server)  # fmt: skip
            calls += 1
            future = self.backend.launch([(group.state, request)])[0]
            self.calls_in_flight += 1
            # Registered before this coroutine awaits the future, so the tokens are counted before anyone who waits
            # on the drain (or this session) sees the call as returned.
            future.add_done_callback(partial(self._returned, group, index, server, self.loop.time()))
            result = await future
            if group.tokens[index] >= limit or result.finish is not Finish.ABORTED:
                break
            self.run.resumed_calls += 1
            await asyncio.sleep(self.setup.retry_delay_s)
        group.sessions_done += 1

    def _returned(
        self, group: _Group, index: int, server: str, launched: float, future: asyncio.Future[SegmentResult]
    ) -> None:
        """A call came back: release its server, keep its tokens and the version that made them (min/max
        ``global_steps``: the first output's version and the last's), and tell the drain when none is left."""
        self.router.release(server)
        self.calls_in_flight -= 1
        if self.calls_in_flight == 0:
            self.drained.set()
        if future.cancelled():
            return
        result = future.result()
        got = len(result.new_ids)
        if self.setup.trace:
            self.run.calls.append(CallEvent(f"{group.key}/{index}", launched, self.loop.time(), got, result.finish))
        version = int(result.server_version or 0)
        group.tokens[index] += got
        self.step_generated += got
        if got:
            group.by_version[index][version] = group.by_version[index].get(version, 0) + got
        if group.first_version[index] is None:
            group.first_version[index] = version
        group.last_version[index] = version

    # ------------------------------------------------------------------ trainer side
    def _stale(self, group: _Group) -> bool:
        threshold = self.setup.max_off_policy_threshold
        return threshold is not None and self.global_steps - group.tag + 1 > threshold

    def _has_enough(self, finished: list[_Group]) -> bool:
        """``ReplayBufferAsync._has_enough_samples``."""
        threshold, n = self.setup.max_off_policy_threshold, self.workload.n
        if threshold is not None and self.setup.max_off_policy_strategy == "wait":
            for group in self.groups.values():
                if not group.finished(n) and self.global_steps - group.tag + 1 >= threshold:
                    return False
        return len(finished) >= self.workload.batch

    async def sample(self) -> tuple[list[_Group], int, int]:
        """``ReplayBufferAsync.sample``: (the batch, groups evicted meanwhile, tokens they held); polls are recorded."""
        n, drop = self.workload.n, self.setup.max_off_policy_strategy == "drop"
        evicted = discarded = polls = 0
        while True:
            if self.failures:
                raise self.failures[0]
            finished = [g for g in self.groups.values() if g.finished(n)]
            stale = [g for g in finished if drop and self._stale(g)]
            if stale:  # _evict_terminal_groups, then refill_fn(len(evicted)) and look again at once
                for group in stale:
                    del self.groups[group.key]
                    self.run.evicted_keys.append(group.key)
                    discarded += sum(group.tokens)
                evicted += len(stale)
                self.submit(len(stale))
                continue
            if self._has_enough(finished):
                break
            polls += 1
            await asyncio.sleep(self.setup.poll_interval_s)
        batch = sorted(finished, key=lambda g: (g.tag, g.tie))[: self.workload.batch]
        for group in batch:
            del self.groups[group.key]
        self.run.polls.append(polls)
        return batch, evicted, discarded

    async def abort_and_drain(self) -> None:
        """``on_sample_end``: abort every replica (gate closed, barrier, abort), wait until every call returned."""
        self.paused = True
        self.resumed.clear()
        await asyncio.gather(*(self.backend.abort(server) for server in self.backend.servers))
        while self.calls_in_flight:
            self.drained.clear()
            await self.drained.wait()

    async def resume(self) -> None:
        """``on_step_end``: new weights (version = the step), prefix caches reset, generation resumed."""
        self.backend.update_weights(self.global_steps)
        await asyncio.gather(*(self.backend.resume(server) for server in self.backend.servers))
        self.paused = False
        self.resumed.set()

    def record_step(self, batch: list[_Group], seconds: float, evicted: int, discarded: int) -> None:
        trained_version = self.global_steps - 1  # step k generates on version k - 1 and trains version k
        lengths, lags, weights = [], [], []
        spans, trajectory_spans = [0], [0]
        for group in batch:
            spans.append(self.global_steps - group.tag + 1)
            for index in range(self.workload.n):
                lengths.append(group.tokens[index])
                for version, tokens in group.by_version[index].items():
                    lags.append(trained_version - version)
                    weights.append(tokens)
                first, last = group.first_version[index], group.last_version[index]
                trajectory_spans.append(int(last) - int(first) + 1)
        record = self.run.record
        record.seconds.append(seconds)
        record.tokens_generated.append(float(self.step_generated))
        record.tokens_trained.append(float(sum(lengths)))
        record.tokens_discarded.append(float(discarded))
        total = float(sum(weights))
        record.staleness_mean.append(float(np.dot(lags, weights)) / total if total else 0.0)
        record.staleness_max.append(float(max(lags, default=0)))
        record.trained_lengths.append(np.array(lengths))
        record.group_waits.append(np.array([self.global_steps - g.tag for g in batch]))
        self.run.evicted_groups.append(evicted)
        self.run.threshold_span_max.append(max(spans))
        self.run.trajectory_span_max.append(max(trajectory_spans))
        self.run.trained_keys.append([g.key for g in batch])

    async def fit(self, steps: int) -> V1Run:
        loop = asyncio.get_running_loop()
        batch_size = self.workload.batch
        self.global_steps = 1  # fit(): "we start from step 1"; the engines hold version 0 (on_init_end)
        self.source.step = 1
        self.submit(math.floor(self.setup.num_warmup_batches * batch_size))  # on_train_begin
        for step in range(1, steps + 1):
            self.global_steps = self.source.step = step
            started = loop.time()
            self.run.phase_starts.append(started)
            self.step_generated = 0
            self.submit(batch_size)  # prepare_step
            batch, evicted, discarded = await self.sample()
            self.run.sample_s.append(loop.time() - started)
            await self.abort_and_drain()
            self.record_step(batch, loop.time() - started, evicted, discarded)
            await asyncio.sleep(self.setup.update_s)  # training and weight sync: not part of the rollout phase
            await self.resume()
            self.run.resumes.append(loop.time())
        self.run.outstanding_keys = list(self.groups)
        self.run.record.prefill_tokens = sum(e.stats.prefill_tokens for e in self.backend.engines.values())
        self.run.record.preemptions = sum(e.stats.preemptions for e in self.backend.engines.values())
        return self.run


def simulate_v1(setup: V1Setup, workload: Workload, spec: ServerSpec, servers: int, steps: int) -> V1Run:
    """``steps`` training steps of verl's v1 colocate_async on ``servers`` simulated vLLM servers, in virtual time."""

    async def main() -> V1Run:
        system = _ColocateAsync(setup, workload, spec, servers)
        try:
            return await system.fit(steps)
        finally:
            for task in list(system.sessions):
                task.cancel()

    return run_virtual(main())
