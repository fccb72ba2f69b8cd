"""An engine model of one vLLM server on GPUs, run in virtual time (see docs/method/gpu-simulator.md).

What it models, and why each piece matters for partial rollout:

* **Continuous batching.** Every engine step decodes one token for every running request; requests
  join at step boundaries and leave when they finish, so a short request's slot is refilled at once.
* **Roofline step cost, per phase.** A step runs two kinds of kernels one after the other: the linear layers
  (read the weights once, 2 x params FLOPs per token) and attention (read the KV cache of every running token,
  4 x layers x heads x head_dim FLOPs per cached token). Each phase takes the larger of its bytes / bandwidth
  and its FLOPs / peak (derated by a stated efficiency); the step is their sum. A single max over the summed
  bytes and FLOPs would let attention's KV reads hide under the linear layers' compute, which no kernel does.
  This is what makes a GPU decode step at 200 requests cost little more than one at 8 -- the idle capacity a
  synchronous step wastes on its tail.
* **KV-cache capacity.** (HBM x gpu_memory_utilization - weights - activation reserve) / KV bytes per
  token caps the tokens held; requests wait for room and the newest running request is preempted
  (recomputed later, vLLM's default) when decoding would overflow it. ``max_num_seqs`` caps requests.
* **Prefill.** Chunked (vLLM V1): each step carries the decodes plus up to ``max_num_batched_tokens``
  prompt tokens; compute bound for large chunks.
* **Aborts as verl's vLLM server does them.** ``abort_all_requests`` closes the gate and first waits (up to 60 s)
  for every admitted request to produce an output, so requests queued behind ``max_num_seqs`` or the KV cache hold
  the step end while running ones keep decoding; ``abort_request`` ends one request with its tokens so far (none
  while queued). A cancelled call gets nothing back (``SimBackend.cancel``).
* **Prefix cache wiped at each weight update.** A resumed sample re-prefills its prompt and all its
  tokens on the new weights; siblings of a group share their prompt's cached blocks, whole 16-token blocks only, the
  last token always computed (:func:`verl_partial.core.engines.prefix_cache.cached_tokens`).

The server is event driven: between two events (a request finishing, a request arriving, an abort,
the KV cache filling up) the running set is constant, so the cost of the next k decode steps is a
closed-form array and the simulator jumps to the first event instead of stepping token by token.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from verl_partial.core.engines.prefix_cache import cached_tokens
from verl_partial.core.partial.finish import Finish
from verl_partial.sim.hardware import Efficiency, GpuSpec, ModelSpec, compute_knee

# Longest run of decode steps planned at once; a bound on the numpy arrays, not a model parameter.
_MAX_PLANNED_STEPS = 1 << 16
# verl 0.9.1 ``vllm_async_server._GATE_BARRIER_TIMEOUT_S``: how long an abort waits for queued requests' first output.
GATE_BARRIER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server: ``tp`` GPUs holding one copy of the model, with vLLM's memory and batch limits.

    Defaults are verl 0.9.1's rollout defaults (``max_num_seqs=256``, ``max_num_batched_tokens=8192``)
    except ``gpu_memory_utilization``, 0.80 as in verl's DAPO/fully-async recipes (verl's own default is
    0.5). ``activation_reserve_bytes`` per GPU stands for vLLM's profiled activation peak and CUDA graphs.
    ``step_overhead_s``: fixed time added to every engine step (CPU scheduling, kernel launches, tensor-parallel
    all-reduce latency). 0 in the model we validated and project with; a what-if knob (docs/method/gpu-simulator.md).
    ``prefix_cache``: vLLM's (on in verl): a group's samples share their prompt's prefill, and a request re-admitted
    on the same weights keeps what it held. ``False`` prefills every request's whole context, as our emulated engine
    does with ``rollout.enable_prefix_caching=false`` (and did before it modelled the cache), for checking the
    simulator against such runs.
    ``keep_cache_on_update``: a what-if no verl server runs (verl clears the cache at the abort, after the weight
    update and on wake-up): the cache survives the weight update, so a resumed sample prefills only the part of its
    last block its earlier segment left, decoding on over keys and values of older weights (vLLM's pause mode "keep",
    where the engine is not put to sleep). It prices what the re-prefill after a weight sync costs partial rollout.
    The cache is not evicted in either case.
    """

    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    efficiency: Efficiency = field(default_factory=Efficiency)
    gpu_memory_utilization: float = 0.80
    activation_reserve_bytes: float = 3e9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_overhead_s: float = 0.0
    prefix_cache: bool = True
    keep_cache_on_update: bool = False

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name} at gpu_memory_utilization="
                f"{self.gpu_memory_utilization}: raise the tensor-parallel degree"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the server holds: (usable HBM - weights - activation reserve) / KV bytes per token."""
        usable = self.tp * (self.gpu.hbm_bytes * self.gpu_memory_utilization - self.activation_reserve_bytes)
        return int((usable - self.model.weight_bytes) // self.model.kv_bytes_per_token)

    @property
    def compute_knee(self) -> int:
        """Most decoding requests a step serves at the cost of the weights' read alone; past it the linear layers are
        compute-bound, and each request adds step time rather than throughput (tensor parallelism divides both
        alike). Where it is below the server's slots, calls per server capped near it end steps sooner."""
        return compute_knee(self.gpu, self.efficiency, self.model.bytes_per_param)

    def step_seconds(
        self, decode_requests: int, decode_context: float, prefill_tokens: int = 0, prefill_attention: float = 0.0
    ) -> float:
        """Time of one engine step: roofline of each phase (linear layers, attention) over the ``tp`` GPUs.

        ``decode_context``: cached tokens the running requests attend to (sum of their lengths).
        ``prefill_attention``: query x key pairs of the prefill chunk (c x (p + c/2) for a chunk of c
        tokens after p already computed ones).
        """
        return (
            self.step_overhead_s
            + self._linear_seconds(decode_requests + prefill_tokens)
            + float(self._attention_seconds(decode_context + prefill_tokens, decode_context + prefill_attention))
        )

    def _linear_seconds(self, tokens: int) -> float:
        """The linear layers: the weights are read once per step, 2 x params FLOPs per token."""
        model, gpu, eff = self.model, self.gpu, self.efficiency
        return max(
            model.weight_bytes / (self.tp * gpu.hbm_bandwidth * eff.bandwidth),
            model.linear_flops_per_token * tokens / (self.tp * gpu.bf16_flops * eff.compute),
        )

    def _attention_seconds(self, kv_tokens: float | np.ndarray, pairs: float | np.ndarray) -> float | np.ndarray:
        """Attention: the KV cache of ``kv_tokens`` tokens is read (or written), ``pairs`` query-key products."""
        model, gpu, eff = self.model, self.gpu, self.efficiency
        return np.maximum(
            model.kv_bytes_per_token * kv_tokens / (self.tp * gpu.hbm_bandwidth * eff.bandwidth),
            model.attention_flops_per_context_token * pairs / (self.tp * gpu.bf16_flops * eff.compute),
        )

    def decode_seconds(self, requests: int, context: float, steps: int) -> np.ndarray:
        """Cumulative time after each of ``steps`` decode steps of a fixed running set.

        The context grows by ``requests`` tokens a step; the array is closed form, so a run of decode steps
        between two events costs one numpy call.
        """
        ctx = context + requests * np.arange(steps, dtype=np.float64)
        return np.cumsum(self._attention_seconds(ctx, ctx) + (self._linear_seconds(requests) + self.step_overhead_s))

    def throughput_limit(self, mean_context: float) -> float:
        """Decode tokens/s of the server at full concurrency with requests of ``mean_context`` tokens on average.

        Full concurrency = ``max_num_seqs`` or what the KV cache holds at that mean length, whichever is less.
        """
        concurrency = max(1, min(self.max_num_seqs, int(self.kv_capacity_tokens // max(1.0, mean_context))))
        return concurrency / self.step_seconds(concurrency, concurrency * mean_context)


@dataclass
class EngineOutcome:
    """What one request produced: ``tokens`` new tokens, and why it ended."""

    tokens: int
    finish: Finish


@dataclass(eq=False)
class EngineRequest:
    """One generate call: ``prefix`` tokens already exist (prompt + earlier segments); EOS after ``eos_after`` more.

    ``prompt_key`` names the shared prompt (siblings hit its cached blocks); ``sample_key`` the sample,
    whose own blocks are cached after a segment ends (valid until the next weight update).
    """

    prompt_key: str
    sample_key: str
    prompt_len: int
    prefix: int
    eos_after: int
    max_new: int
    future: asyncio.Future[EngineOutcome]
    generated: int = 0
    to_prefill: int = 0
    prefill_done: int = 0
    cancelled: bool = False

    @property
    def context(self) -> int:
        return self.prefix + self.generated

    @property
    def remaining(self) -> int:
        return min(self.eos_after, self.max_new) - self.generated


@dataclass
class EngineStats:
    """Counters of one server, for the 'where the time goes' tables."""

    decode_steps: int = 0
    prefill_steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    busy_seconds: float = 0.0
    running_token_seconds: float = 0.0


class SimServer:
    """One vLLM server in virtual time; ``submit`` returns a future resolved when the request ends."""

    def __init__(self, spec: ServerSpec, name: str) -> None:
        self.spec = spec
        self.name = name
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.cache: dict[str, int] = {}
        self.gate_open = True
        self.aborting = False
        self.stats = EngineStats()
        self._timer: asyncio.TimerHandle | None = None
        self._segment_start = 0.0
        self._segment_cum: np.ndarray | None = None
        self._segment_apply: Callable[[int], None] | None = None
        self._segment_steps = 0
        self._changed = asyncio.Event()  # set at every step boundary: the abort barrier re-checks the queue

    # ------------------------------------------------------------------ control
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def load(self) -> tuple[int, int]:
        """(requests, tokens) on this server: the router's least-loaded key."""
        requests = [*self.waiting, *self.prefilling, *self.running]
        return len(requests), sum(r.context for r in requests)

    def submit(
        self, prompt_key: str, sample_key: str, prompt_len: int, prefix: int, eos_after: int, max_new: int
    ) -> asyncio.Future[EngineOutcome]:
        if max_new < 1 or eos_after < 1:
            raise ValueError(f"{sample_key}: max_new ({max_new}) and eos_after ({eos_after}) must be >= 1")
        future: asyncio.Future[EngineOutcome] = self.loop.create_future()
        if not self.gate_open:
            future.set_result(EngineOutcome(0, Finish.ABORTED))
            return future
        self.waiting.append(EngineRequest(prompt_key, sample_key, prompt_len, prefix, eos_after, max_new, future))
        self._poke()
        return future

    def abort_all(self, *, close_gate: bool = True) -> None:
        """vLLM's ``pause_generation``: every request ends ABORTED at the next step boundary, running ones with their
        tokens, queued ones with none (or what they held before a preemption)."""
        self.gate_open = not close_gate
        self.aborting = True
        self._poke()

    async def abort_all_requests(self) -> None:
        """verl's ``vLLMHttpServer.abort_all_requests(reject_request=True)``: close the gate, then wait -- up to
        ``_GATE_BARRIER_TIMEOUT_S`` -- while an admitted request has no output yet (``_admitting > 0``: queued
        behind ``max_num_seqs`` or the KV cache, or prefilling), running requests decoding meanwhile; then pause."""
        loop = self.loop
        self.gate_open = False
        deadline = loop.time() + GATE_BARRIER_TIMEOUT_S
        while any(r.generated == 0 for r in (*self.waiting, *self.prefilling)) and loop.time() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        self.abort_all()

    def abort_request(self, future: asyncio.Future[EngineOutcome]) -> None:
        """vLLM's ``abort_request(request_id)``: a request the engine holds ends ABORTED at the next step boundary
        with every token it generated (none while it waited for its first step); an unknown one is unaffected."""
        for queue in (self.waiting, self.prefilling, self.running):
            for request in queue:
                if request.future is future:
                    request.cancelled = True  # resolved ABORTED at the next boundary
                    self._poke()
                    return

    def tokens_so_far(self) -> dict[asyncio.Future[EngineOutcome], int]:
        """Tokens each held request generated so far, by its future (the stall check's reading): the steps of a
        decode segment under way count, so a segment longer than ``request_timeout_s`` still shows progress."""
        done = 0
        cum = self._segment_cum
        if cum is not None and not self.prefilling:  # a decode segment: every running request gains one a step
            done = int(np.searchsorted(cum[: self._segment_steps], self.loop.time() - self._segment_start, "right"))
        held = {request.future: request.generated for request in (*self.waiting, *self.prefilling)}
        return held | {request.future: request.generated + done for request in self.running}

    def resume(self) -> None:
        self.gate_open = True

    def update_weights(self) -> None:
        """New policy weights: every cached block is stale (vLLM resets its prefix cache on weight sync), unless the
        what-if ``ServerSpec.keep_cache_on_update`` keeps it."""
        if self.running or self.prefilling or self.waiting:
            raise RuntimeError(f"{self.name}: weight update with requests in flight")
        if not self.spec.keep_cache_on_update:
            self.cache.clear()

    # ------------------------------------------------------------------ event handling
    def _poke(self) -> None:
        """Something changed: act now if idle, or end the current multi-step segment at its next step."""
        if self._timer is None:
            self._timer = self.loop.call_soon(self._boundary)
            return
        cum = self._segment_cum
        if cum is None or self._segment_steps <= 1:
            return
        elapsed = self.loop.time() - self._segment_start
        done = int(np.searchsorted(cum, elapsed, side="right"))
        steps = min(self._segment_steps, done + 1)
        if steps < self._segment_steps:
            self._timer.cancel()
            self._segment_steps = steps
            self._timer = self.loop.call_at(self._segment_start + float(cum[steps - 1]), self._boundary)

    def _boundary(self) -> None:
        """A step boundary: apply the finished segment, resolve ended requests, admit, plan the next segment."""
        self._timer = None
        if self._segment_apply is not None:
            elapsed = float(self._segment_cum[self._segment_steps - 1]) if self._segment_cum is not None else 0.0
            self.stats.busy_seconds += elapsed
            self._segment_apply(self._segment_steps)
            self._segment_apply, self._segment_cum = None, None
        self._resolve_ended()
        if self.aborting:
            for request in [*self.running, *self.prefilling, *self.waiting]:
                self._end(request, Finish.ABORTED)
            self.running, self.prefilling, self.waiting = [], [], deque()
            self.aborting = False
        self._admit()
        self._plan()
        self._changed.set()

    def _end(self, request: EngineRequest, finish: Finish) -> None:
        if request.context > request.prompt_len and request in self.running:
            self.cache[request.sample_key] = request.context
        if not request.future.done():
            request.future.set_result(EngineOutcome(request.generated, finish))

    def _resolve_ended(self) -> None:
        still = []
        for request in self.running:
            if request.generated >= request.eos_after:
                self._end(request, Finish.EOS)
            elif request.generated >= request.max_new:
                self._end(request, Finish.LENGTH)
            elif request.cancelled:
                self._end(request, Finish.ABORTED)
            else:
                still.append(request)
        self.running = still
        for queue in (self.prefilling, self.waiting):
            for request in [r for r in queue if r.cancelled]:
                queue.remove(request)
                self._end(request, Finish.ABORTED)

    def _kv_used(self) -> int:
        return sum(r.context for r in self.running) + sum(r.context for r in self.prefilling)

    def _admit(self) -> None:
        spec = self.spec
        used = self._kv_used()
        while self.waiting and len(self.running) + len(self.prefilling) < spec.max_num_seqs:
            request = self.waiting[0]
            need = request.context + 1
            if used + need > spec.kv_capacity_tokens:
                if not self.running and not self.prefilling:
                    raise RuntimeError(
                        f"{self.name}: one request of {need} tokens exceeds the KV cache of "
                        f"{spec.kv_capacity_tokens} tokens"
                    )
                break
            self.waiting.popleft()
            cached = (
                max(self.cache.get(request.sample_key, 0), min(self.cache.get(request.prompt_key, 0), request.prefix))
                if spec.prefix_cache
                else 0
            )
            cached = cached_tokens(request.context, cached)  # whole blocks, never the last token (vLLM's rule)
            # A resumed or preempted request re-prefills everything it holds, its generated tokens included.
            request.to_prefill = request.context - cached
            request.prefill_done = 0
            self.stats.cached_tokens += cached
            self.cache[request.prompt_key] = request.prompt_len  # siblings share the prompt's blocks
            self.prefilling.append(request)
            used += need

    # ------------------------------------------------------------------ planning
    def _plan(self) -> None:
        if self.prefilling:
            self._plan_prefill_step()
        elif self.running:
            self._plan_decode_segment()

    def _start_segment(self, cum: np.ndarray, steps: int, apply: Callable[[int], None]) -> None:
        self._segment_start = self.loop.time()
        self._segment_cum, self._segment_steps, self._segment_apply = cum, steps, apply
        self._timer = self.loop.call_at(self._segment_start + float(cum[steps - 1]), self._boundary)

    def _plan_prefill_step(self) -> None:
        """One mixed step: all decodes plus a chunk of pending prefill within the token budget."""
        spec = self.spec
        budget = max(1, spec.max_num_batched_tokens - len(self.running))
        chunks: list[tuple[EngineRequest, int]] = []
        attention = 0.0
        for request in self.prefilling:
            if budget <= 0:
                break
            chunk = min(budget, request.to_prefill - request.prefill_done)
            start = request.context - request.to_prefill + request.prefill_done
            attention += chunk * (start + chunk / 2)
            chunks.append((request, chunk))
            budget -= chunk
        context = sum(r.context for r in self.running)
        tokens = sum(c for _, c in chunks)
        cost = spec.step_seconds(len(self.running), context, tokens, attention)
        decoding = list(self.running)

        def apply(_steps: int) -> None:
            self.stats.prefill_steps += 1
            self.stats.prefill_tokens += tokens
            self.stats.running_token_seconds += len(decoding) * cost
            for request in decoding:
                request.generated += 1
            self.stats.tokens += len(decoding)
            for request, chunk in chunks:
                request.prefill_done += chunk
                if request.prefill_done >= request.to_prefill:
                    self.prefilling.remove(request)
                    self.running.append(request)
                    request.generated += 1  # the step that completes a prefill samples its first token
                    self.stats.tokens += 1

        self._start_segment(np.array([cost]), 1, apply)

    def _plan_decode_segment(self) -> None:
        spec = self.spec
        n = len(self.running)
        context = sum(r.context for r in self.running)
        headroom = (spec.kv_capacity_tokens - self._kv_used()) // n
        while headroom < 1:
            victim = self.running.pop()  # newest admitted first, as vLLM's recompute preemption
            self.stats.preemptions += 1
            self.waiting.appendleft(victim)
            n = len(self.running)
            if n == 0:
                self._admit()
                self._plan()
                return
            context = sum(r.context for r in self.running)
            headroom = (spec.kv_capacity_tokens - self._kv_used()) // n
        steps = int(min(min(r.remaining for r in self.running), headroom, _MAX_PLANNED_STEPS))
        cum = spec.decode_seconds(n, context, steps)
        running = list(self.running)

        def apply(done: int) -> None:
            self.stats.decode_steps += done
            self.stats.tokens += done * len(running)
            self.stats.running_token_seconds += len(running) * float(cum[done - 1])
            for request in running:
                request.generated += done

        self._start_segment(cum, steps, apply)


def lognormal_sigma(p99_over_p50: float) -> float:
    """Sigma of a lognormal whose 99th percentile is ``p99_over_p50`` times its median (z_0.99 = 2.3263)."""
    if p99_over_p50 <= 1:
        raise ValueError(f"p99/p50 must be > 1, got {p99_over_p50}")
    return math.log(p99_over_p50) / 2.3263478740408408
