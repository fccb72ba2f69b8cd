"""Continuous-batching CPU decoding engine: a small stand-in for vLLM on machines without a GPU.

What makes it behave like a real serving engine (and so makes partial rollout's benefit measurable on CPU):

* **One batched forward per decode step** over every running request, with a per-slot KV cache
  (:class:`~verl_partial.cpu_backend.kv_model.SlotKVModel`). A decode step's cost is dominated by per-layer fixed
  overhead and weight reads, so it grows sub-linearly with the number of running requests.
* **Continuous batching**: a finished or aborted request leaves the batch before the next step; waiting requests join
  it (prefill, then decode) without the batch draining first. At most ``max_num_seqs`` run at once.
* **KV-cache capacity** (``kv_capacity_tokens=``, off by default): the tokens of KV cache a GPU server holds,
  with vLLM v1's rules, as the simulator applies them (``verl_partial.sim.engine.SimServer``): a waiting request
  is admitted only while the running requests' context plus its own context + 1 fits (first come, first served: the
  queue's head that does not fit stops admission); when the running requests' context + 1 token each would not fit
  a decode step, the newest admitted is preempted (recompute preemption: its KV is dropped, it goes back to the front
  of the queue with its tokens, and on readmission its prompt and every token it generated are prefilled again).
  The newest goes (vllm/v1/core/sched/scheduler.py@0.24.0:562 "preempted_req = self.running.pop()"), and a
  step that preempts admits no one (vllm/v1/core/sched/scheduler.py@0.24.0:626 "if not preempted_reqs and").
  SGLang retracts decoding requests when its memory runs out too; both semantics apply the same rule.
* **Responsive control**: the model runs in a single worker thread (torch releases the GIL inside its kernels) while
  the asyncio loop owns all scheduling state. ``abort`` resolves the request's ``generate`` immediately with the
  tokens produced so far; the slot is reclaimed before the next step.
* **Two servers' semantics** (``semantics=``), because the scheduler must be tested against what real engines do,
  not against what is convenient:

  - ``"vllm"`` (vLLM 0.24 v1 engine): an abort ends a request at once with its tokens so far (a queued one with
    none, a preempted one with those it had); EOS is checked before the length cap
    (``vllm/v1/core/sched/utils.py``, ``check_stop``).
  - ``"sglang"`` (SGLang 0.5.12): an abort of a *running* request only sets ``to_finish``; the request decodes one
    more token, then ``Req.check_finished`` ends it as aborted (scheduler.py@0.5.12:3651-3655 "Abort method 3: set
    `to_finish`"); a queued one leaves with no tokens (scheduler.py@0.5.12:3567-3570 "self.waiting_queue.pop(i)").
    ``check_finished`` tests ``to_finish`` first (schedule_batch.py@0.5.12:1217 "if self.to_finish:"), then
    ``max_new_tokens`` (schedule_batch.py@0.5.12:1222 "if len(self.output_ids) >=
    self.sampling_params.max_new_tokens:"), then EOS (schedule_batch.py@0.5.12:1236
    "if self._check_token_based_finish(new_accepted_tokens):"); a length finish keeps ``finished_len =
    max_new_tokens`` tokens (schedule_batch.py@0.5.12:1226 "self.finished_len = self.sampling_params.max_new_tokens"),
    so ``max_new_tokens=0`` is allowed and answers 0 tokens with "length". The conformance tier runs the 0.5.12
    wheel's own ``check_finished`` beside this.

Log-prob semantics follow verl 0.9.1's vLLM rollout, which starts vLLM with ``logprobs_mode="processed_logprobs"``
(``actor_rollout_ref.rollout.logprobs_mode`` default): the log-prob of the sampled token under the distribution it
was actually sampled from, i.e. after temperature scaling and top-k / top-p truncation (renormalised). For greedy
requests (temperature 0) that is the raw ``log_softmax`` of the logits, as in vLLM. At temperature 1 without
truncation both modes equal the raw policy's log-prob. ``logprobs_mode="raw_logprobs"`` always returns the raw
policy's log-prob.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from verl_partial.core.engines.prefix_cache import PrefixCache
from verl_partial.cpu_backend.kv_model import SlotKVModel

StopReason = Literal["completed", "length", "aborted"]
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
Semantics = Literal["vllm", "sglang"]
SEMANTICS: tuple[Semantics, ...] = ("vllm", "sglang")


# Below this many padded tokens a prefill batch is cheap whatever its padding; above it, lengths are grouped.
_CHEAP_PREFILL_TOKENS = 512


@dataclass
class SamplingParams:
    """Per-request sampling settings (the subset of vLLM's that verl's rollout uses).

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable truncation. ``seed`` makes the
    request's samples independent of whatever else shares the batch. Validated on construction and again when
    ``generate`` snapshots it, so changing a field after submitting a request does not affect that request.
    ``max_tokens == 0`` is SGLang's ``max_new_tokens=0`` (a 0-token "length" answer); the vLLM-semantics engine
    refuses it, as vLLM's ``SamplingParams._verify_args`` does.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationResult:
    """Tokens generated for one request, with one log-prob per token.

    ``stop_reason`` is ``"completed"`` (an EOS id was sampled; it is included in ``token_ids``), ``"length"``
    (``max_tokens`` new tokens, or the sequence reached ``max_model_len``) or ``"aborted"``.
    """

    token_ids: list[int]
    log_probs: list[float]
    stop_reason: StopReason


# The step shape a step-time model is given: (decode requests, their summed context, prefill tokens, prefill
# query x key pairs), the arguments of ``verl_partial.sim.engine.ServerSpec.step_seconds``.
StepTimeModel = Callable[[int, float, int, float], float]
# Engine steps between two rewrites of ``stats_file`` (a few ms of JSON every few seconds of decoding).
STATS_FILE_EVERY = 200


@dataclass
class EngineStats:
    """Cumulative counters, e.g. for throughput and mean batch size (``decode_tokens / decode_steps``).

    ``generated_tokens`` counts tokens handed to requests; ``decode_tokens`` counts rows of decode forwards (it also
    includes rows whose request was aborted while the step ran). ``dataclasses.asdict`` gives a plain dict.

    Time (seconds on the engine loop's clock): ``step_s`` inside steps, ``idle_s`` waiting with nothing to run
    (or paused). ``decode_context_tokens`` sums the context every decode row attended to. With a step-time model
    (``backend.emulate_gpu``): ``modelled_s`` is the modelled time of the steps, ``compute_s`` the real compute
    inside them, ``overruns`` the steps whose compute took longer than modelled (they last their compute time) and
    ``overrun_s`` by how much in all: what a benchmark weighs when it decides whether an emulated run still stands
    for its GPU; ``modelled_prefill_s`` the part of ``modelled_s`` the steps' prefill added (each step's modelled
    time less that of the same step without its prefill), so a benchmark can tell the prefill partial rollout adds
    (a parked answer's whole sequence again, after a weight sync) from the decode every trainer pays.
    With a KV-cache capacity: ``preemptions`` counts running requests sent back to the queue to make room; their
    re-prefill is in ``prefill_tokens``. With a prefix cache (``prefix_caching``): ``cached_tokens`` counts the
    joiners' tokens found cached, which ``prefill_tokens`` leaves out.
    """

    generated_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    steps: int = 0
    step_s: float = 0.0
    idle_s: float = 0.0
    decode_context_tokens: int = 0
    modelled_s: float = 0.0
    compute_s: float = 0.0
    overruns: int = 0
    overrun_s: float = 0.0
    modelled_prefill_s: float = 0.0
    preemptions: int = 0


@dataclass(eq=False)
class EngineRequest:
    """One submitted request. ``future`` resolves with its result; ``first_output`` is set at its first token or
    when it ends without one (when vLLM's output stream yields its first ``RequestOutput``, the moment verl's
    ``vLLMHttpServer.generate`` lowers ``_admitting``). ``to_finish``: SGLang's pending abort (one more token).
    ``admitted``: when it last joined the batch (an engine-wide count), so the newest running request is the one
    preempted whatever slot compaction did to the slots' order."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerationResult]
    generator: torch.Generator | None
    first_output: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    to_finish: bool = False
    done: bool = False
    admitted: int = 0

    @property
    def context_len(self) -> int:
        """Tokens of its sequence: the prompt and every token generated so far."""
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def sequence(self) -> list[int]:
        """What a prefill runs: the prompt, then the tokens a preempted request had generated before it left."""
        return self.prompt_ids + self.token_ids

    @property
    def cached_len(self) -> int:
        """Positions whose K/V sit in the slot: everything but the last sampled token, which the next step feeds."""
        return len(self.prompt_ids) + len(self.token_ids) - 1


@dataclass(frozen=True)
class _StepPlan:
    """Everything the worker thread needs for one step; built on the loop thread so the worker reads no live state.

    Rows are slots ``0..len(decode_tokens)-1`` (decode) followed by the newly admitted requests (prefill of their
    whole sequence: the prompt, plus the tokens a preempted request had generated).
    """

    moves: list[tuple[int, int, int]]  # (src slot, dst slot, cached length)
    decode_tokens: list[int]
    decode_positions: list[int]
    prefill_prompts: list[list[int]]  # each joiner's sequence
    prefill_cached: list[int]  # each joiner's leading tokens a GPU server's prefix cache holds (not prefilled)
    samplers: list[tuple[SamplingParams, torch.Generator | None]]
    max_len: int

    @property
    def decode_context(self) -> int:
        """Tokens the decode rows attend to: each row's cache plus the token it feeds."""
        return sum(self.decode_positions) + len(self.decode_positions)

    @property
    def prefill_tokens(self) -> int:
        """Tokens a GPU server would prefill: each joiner's sequence but its cached prefix."""
        return sum(len(p) - cached for p, cached in zip(self.prefill_prompts, self.prefill_cached, strict=True))

    def shape(self) -> tuple[int, float, int, float]:
        """Arguments of a :data:`StepTimeModel`; c tokens prefilled after k cached ones make c x (k + c/2)
        query-key pairs."""
        pairs = sum(
            (len(p) - k) * (k + (len(p) - k) / 2)
            for p, k in zip(self.prefill_prompts, self.prefill_cached, strict=True)
        )
        return len(self.decode_tokens), float(self.decode_context), self.prefill_tokens, pairs


class CpuBatchedEngine:
    """Asyncio front end + single worker thread running :class:`SlotKVModel` with continuous batching.

    All public methods must be called from the event loop the engine first ran ``generate`` on, except
    ``load_weights`` and ``resume``, which may also be called from another thread.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_ids: set[int],
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 4096,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        seed: int | None = None,
        semantics: Semantics = "vllm",
        virtual_step_s: float | None = None,
        step_time: StepTimeModel | None = None,
        kv_capacity_tokens: int | None = None,
        prefix_caching: bool = False,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        stats_file: str | None = None,
    ) -> None:
        """
        Args:
            model: a Llama / Qwen2 / Qwen3 ``*ForCausalLM`` (see ``kv_model.SUPPORTED_MODEL_TYPES``); its parameters
                are used in place, so ``load_weights`` and in-place updates of ``model`` are seen by the engine.
            eos_token_ids: sampling any of these ends a request with ``"completed"`` unless ``ignore_eos``.
            max_num_seqs: most requests decoded together; the rest wait.
            max_model_len: prompt + generated tokens cap; defaults to ``config.max_position_embeddings``.
            max_num_batched_tokens: padded prompt tokens prefilled per step (one prompt is always admitted), which
                bounds how long a burst of new requests stalls the running ones.
            logprobs_mode: see the module docstring; the default matches verl's vLLM rollout.
            seed: seeds the generator shared by requests without their own seed.
            semantics: whose abort and finish rules to follow (module docstring).
            virtual_step_s: run the model on the event loop's own thread and let every step last this long on the
                loop's clock. On a :class:`~verl_partial.sim.clock.VirtualClockLoop` that makes the engine
                deterministic in time (tests of aborts, gates and timeouts need no wall-clock sleeps). ``None``:
                the model runs in the worker thread and steps take what they take.
            step_time: a GPU-shaped engine (``backend.emulate_gpu``): the model runs in the worker thread, then the
                engine sleeps the rest of ``step_time(*shape)`` seconds (typically
                ``verl_partial.sim.engine.ServerSpec.step_seconds``), cores idle; a step whose compute exceeds it
                is counted in ``stats.overruns``. Not with ``virtual_step_s``.
            kv_capacity_tokens: tokens of KV cache the engine holds (typically
                ``verl_partial.sim.engine.ServerSpec.kv_capacity_tokens``): admission waits for room and the newest
                running request is preempted when decoding would overflow it (module docstring). A GPU-shaped engine
                must be bound by its GPU's KV cache as well as its step time, or a partial mode that holds more
                context than that GPU could would look better than it would be. ``None``: unlimited (the CPU cache
                grows as needed). A single request that outgrows it fails with a ``ValueError``.
            prefix_caching: charge a step only the prefill a GPU server with vLLM's prefix cache would compute
                (:mod:`verl_partial.core.engines.prefix_cache`: a group's samples share their prompt's whole blocks,
                a preempted request keeps its own until evicted; everything is forgotten at a weight load and at
                :meth:`reset_prefix_cache`). The forward still computes every token: it shapes a ``step_time``
                engine's modelled steps and the counters (``cached_tokens``), not the real compute.
            device: where the model, its KV cache and the sampling run (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
                The model is moved there in place (``nn.Module.to``), so the caller's module is the engine's; one
                engine serves both, the GPU only making each step faster (benchmarks/gpu_engine_curve.py).
            dtype: cast the model's floating-point weights to this dtype (e.g. ``torch.bfloat16`` on a GPU);
                ``None`` keeps the model's own. The KV cache takes the model's dtype.
            stats_file: rewrite the counters (``stats``) as JSON here every ``STATS_FILE_EVERY`` steps and when the
                loop ends, so a benchmark reads every trainer mode's engine steps and overruns, verl's own trainers
                included, which never ask the server for them.
        """
        if virtual_step_s is not None and step_time is not None:
            raise ValueError("virtual_step_s and step_time both set the step time; give one")
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"unsupported logprobs_mode {logprobs_mode!r}")
        if semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {list(SEMANTICS)}, got {semantics!r}")
        if kv_capacity_tokens is not None and kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1 or None, got {kv_capacity_tokens}")
        self.kv_capacity_tokens = kv_capacity_tokens
        self._prefix_cache = PrefixCache(kv_capacity_tokens) if prefix_caching else None
        # Set by a weight load or an abort (any thread); the loop resets the cache before its next admission.
        self._prefix_reset_pending = False
        self.semantics: Semantics = semantics
        self.virtual_step_s = virtual_step_s
        # Real time: the least a step lasts (fault injection's ``step_s``), so a test can make an answer outlast a
        # timeout on purpose, on any machine. 0: steps take what they take.
        self.min_step_s = 0.0
        self.step_time = step_time
        self.stats_file = stats_file
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.max_num_batched_tokens = max_num_batched_tokens
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self.eos_token_ids = frozenset(eos_token_ids)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from exc
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch dtype or None, got {dtype!r}")
        model.to(device=self.device, dtype=dtype)
        self._kv = SlotKVModel(model, max_slots=max_num_seqs, max_model_len=self.max_model_len)
        self._weights = model.state_dict(keep_vars=True)  # includes tied aliases such as lm_head.weight
        self._shared_generator = torch.Generator()
        if seed is None:
            self._shared_generator.seed()
        else:
            self._shared_generator.manual_seed(seed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-engine")
        self._model_lock = threading.Lock()  # a step and a weight load never overlap
        self._waiting: deque[EngineRequest] = deque()
        self._slots: list[EngineRequest] = []  # index == KV slot; may hold finished requests until the next compaction
        self._admissions = itertools.count()  # EngineRequest.admitted
        self._requests: dict[str, EngineRequest] = {}  # unfinished requests, waiting or running
        self._paused = False
        self._stats = EngineStats()
        # ``mark``: (event, trainer step, wall-clock seconds, then so far: modelled engine seconds, the prefill's part
        # of them, engine steps)
        self._marks: list[tuple[str, int | None, float, float, float, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._stepped: asyncio.Event | None = None  # set (and replaced) after every step and every finish

    # ------------------------------------------------------------------ public API

    @property
    def num_running(self) -> int:
        return sum(not r.done for r in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def request_ids(self) -> list[str]:
        """Ids of the requests waiting or running (what an abort-all would end)."""
        return list(self._requests)

    @property
    def is_idle(self) -> bool:
        """Nothing waiting and nothing running (SGLang's ``Scheduler.is_fully_idle``)."""
        return not self._requests

    def tokens_so_far(self, request_id: str) -> int:
        """Tokens an unfinished request has generated; 0 while it is queued or not (or no longer) in the engine."""
        request = self._requests.get(request_id)
        return 0 if request is None else len(request.token_ids)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, re-checked after every engine step and every finished request.

        Lets tests drive the engine by its own progress ("once the request has 3 tokens") instead of wall-clock
        sleeps. Hangs if the engine never makes the predicate true: callers bound it with their test timeout.
        """
        while not predicate():
            if self._stepped is None:
                self._stepped = asyncio.Event()
            await self._stepped.wait()

    def write_stats(self) -> None:
        """``stats`` and ``prefix_caching`` as JSON at ``stats_file``, replaced atomically (a reader never sees half
        a file)."""
        assert self.stats_file is not None
        partial = f"{self.stats_file}.tmp"
        with open(partial, "w") as out:
            record = {**dataclasses.asdict(self._stats), "prefix_caching": self.prefix_caching}
            json.dump({**record, "marks": [list(mark) for mark in self._marks]}, out)
        os.replace(partial, self.stats_file)

    def mark(self, event: str, step: int | None) -> None:
        """Stamp a trainer's control call (``"weights"``: a weight load for ``step``; ``"sleep"``: the rollout's end)
        with the wall clock, and rewrite ``stats_file`` at once.

        Every trainer, ours and verl's v0 and v1, loads weights once per step and puts the engine to sleep once its
        rollout is over, so these stamps time each one's step cycle and rollout window the same way from the engine's
        side, where the trainers' own timers differ: verl's v1 resumes generation inside ``update_weights`` and
        generates on while its driver logs the step, before its next ``gen`` timer starts. Each stamp also carries the
        modelled engine time so far (``stats.modelled_s``), its prefill's part and the engine steps, so the share of a
        rollout window the emulated GPU was busy, and what it was busy with, are exact for every trainer, its steady
        steps apart from its start-up."""
        stats = self._stats
        self._marks.append((event, step, time.time(), stats.modelled_s, stats.modelled_prefill_s, stats.steps))
        if self.stats_file is not None:
            self.write_stats()

    @property
    def prefix_caching(self) -> bool:
        """Whether steps are charged only what a GPU server's prefix cache would not hold (``prefix_caching=``)."""
        return self._prefix_cache is not None

    @property
    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats)

    @property
    def kv_cache_bytes(self) -> int:
        return self._kv.cache_bytes

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate up to ``params.max_tokens`` tokens after ``prompt_ids``.

        ``prompt_ids`` may end with an earlier partial response (resuming an aborted rollout): the whole sequence is
        prefilled and generation continues from its end. Cancelling the awaiting task ends the request at once
        (vLLM's ``AsyncLLM.generate`` aborts on ``CancelledError``) and the caller gets nothing.
        """
        request = self.submit(request_id, prompt_ids, params)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._finish(request, "aborted")
            raise

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> EngineRequest:
        """Queue a request and return its handle without awaiting it: the request then runs whatever happens to
        whoever awaits ``handle.future`` (SGLang's scheduler keeps decoding a request whose caller went away)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        if not 0 < len(prompt_ids) < self.max_model_len:
            raise ValueError(f"prompt length {len(prompt_ids)} must be in [1, max_model_len={self.max_model_len})")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._kv.vocab_size:
            raise ValueError(f"prompt of {request_id!r} has token ids outside [0, {self._kv.vocab_size})")
        params = dataclasses.replace(params)  # snapshot + re-validate
        if params.max_tokens < 1 and self.semantics == "vllm":
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        self._ensure_loop()
        generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        request = EngineRequest(
            request_id, list(prompt_ids), params, asyncio.get_running_loop().create_future(), generator
        )
        self._requests[request_id] = request
        self._waiting.append(request)
        self._wake()
        return request

    async def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; its ``generate`` returns the tokens so far as ``"aborted"`` (a
        preempted request, back in the queue, returns those it generated before it left the batch).

        vLLM semantics: at once. SGLang semantics: a running request after one more token (module docstring).
        Returns whether the request was in flight; unknown or already finished ids are ignored (the request may have
        finished meanwhile).
        """
        return self.abort_nowait(request_id)

    async def abort_all(self) -> int:
        """Abort every waiting and running request (as :meth:`abort`); return how many were aborted."""
        requests = list(self._requests.values())
        for request in requests:
            self._abort(request)
        return len(requests)

    def abort_nowait(self, request_id: str) -> bool:
        """:meth:`abort` for callers that cannot await (SGLang's ``TokenizerManager.abort_request`` is a
        fire-and-forget message to its scheduler)."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._abort(request)
        return True

    def _abort(self, request: EngineRequest) -> None:
        if self.semantics == "sglang" and request in self._slots:
            # scheduler.py@0.5.12:3651 "Abort method 3: set `to_finish`": one more decode step.
            request.to_finish = True
            self._wake()
        else:
            self._finish(request, "aborted")

    def pause(self) -> None:
        """Stop scheduling after the step in flight: running requests keep their state, new ones queue.

        Mirrors vLLM's ``pause_generation``: nothing is failed, everything continues after :meth:`resume`.
        """
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by ``state_dict`` name (dtype converted); blocks until the step in flight ends.

        Tokens sampled after this returns use the new weights. K/V already cached for running requests keep the
        values computed with the old weights, as in vLLM; abort or pause-and-drain first for a clean switch.
        Raises ``KeyError`` / ``ValueError`` on an unknown name or a shape mismatch (tensors before it are loaded).
        """
        with self._model_lock, torch.no_grad():
            for name, tensor in named_tensors:
                target = self._weights.get(name)
                if target is None:
                    raise KeyError(f"unknown weight {name!r}")
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor)
        self.reset_prefix_cache()  # verl resets vLLM's after every weight update (``clear_kv_cache``)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes before the next admission (vLLM's ``reset_prefix_cache``, which verl calls at
        a step-end abort and after a weight update; like it, it leaves the cache alone while a request holds
        blocks). Safe from any thread."""
        self._prefix_reset_pending = True

    async def close(self) -> None:
        """Abort everything, stop the scheduler task and the worker thread; the engine is unusable afterwards."""
        await self.abort_all()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ scheduling (event-loop thread)

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        alive = self._task is not None and not self._task.done() and not self._loop.is_closed()
        if alive and self._loop is not loop:
            raise RuntimeError("CpuBatchedEngine is already running on another event loop")
        if not alive:
            self._loop, self._wakeup = loop, asyncio.Event()
            self._task = loop.create_task(self._run(), name="cpu-engine-scheduler")

    def _wake(self) -> None:
        if self._wakeup is None or self._loop is None or self._loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._wakeup.set()
        else:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                scheduled = self._schedule()
                if scheduled is None:
                    self._wakeup.clear()
                    began = loop.time()
                    await self._wakeup.wait()
                    self._stats.idle_s += loop.time() - began
                    continue
                plan, rows = scheduled
                began = loop.time()
                try:
                    if self.virtual_step_s is not None:
                        tokens, log_probs = self._execute(plan)
                        await asyncio.sleep(self.virtual_step_s)
                    elif self.step_time is not None:
                        tokens, log_probs = await self._emulated_step(loop, plan)
                    else:
                        started = loop.time()
                        tokens, log_probs = await loop.run_in_executor(self._executor, self._execute, plan)
                        if self.min_step_s:
                            await asyncio.sleep(self.min_step_s - (loop.time() - started))
                except Exception as exc:  # a failed step fails its requests, not the engine
                    for request in rows:
                        self._finish(request, exc)
                    continue
                finally:
                    self._stats.steps += 1
                    self._stats.step_s += loop.time() - began
                    if self.stats_file is not None and self._stats.steps % STATS_FILE_EVERY == 0:
                        self.write_stats()
                self._apply(plan, rows, tokens, log_probs)
        finally:
            if self.stats_file is not None:
                self.write_stats()
            # The loop is going away (close() or the event loop shutting down): nothing can be resumed later.
            for request in list(self._requests.values()):
                self._finish(request, "aborted")
            self._slots.clear()

    async def _emulated_step(self, loop: asyncio.AbstractEventLoop, plan: _StepPlan) -> tuple[list[int], list[float]]:
        """The real forward in the worker thread, then idle until the modelled step time has passed."""
        decodes, context, prefill, pairs = plan.shape()
        modelled = self.step_time(decodes, context, prefill, pairs)
        began = time.perf_counter()
        result = await loop.run_in_executor(self._executor, self._execute, plan)
        compute = time.perf_counter() - began
        self._stats.modelled_s += modelled
        if prefill:
            self._stats.modelled_prefill_s += modelled - self.step_time(decodes, context, 0, 0.0)
        self._stats.compute_s += compute
        if compute > modelled:
            self._stats.overruns += 1
            self._stats.overrun_s += compute - modelled
        else:
            await asyncio.sleep(modelled - compute)
        return result

    def _schedule(self) -> tuple[_StepPlan, list[EngineRequest]] | None:
        if self._paused:
            return None
        preempted = self._preempt()
        moves = self._compact(preempted)
        num_decode = len(self._slots)
        # vLLM v1 schedules the waiting queue only in a step without preemptions (else the request just preempted
        # could be readmitted at once); a step that preempted every running request admits, or fails, its head.
        joiners = [] if preempted and self._slots else self._pick_joiners(self.max_num_seqs - len(self._slots))
        if self._prefix_reset_pending and self._prefix_cache is not None:
            self._prefix_cache.reset()
        self._prefix_reset_pending = False
        cached = []
        for request in joiners:
            request.admitted = next(self._admissions)
            cached.append(self._admit_to_prefix_cache(request))
        self._slots.extend(joiners)
        width = max((r.context_len for r in joiners), default=0)
        if not self._slots:
            return None
        decoding = self._slots[:num_decode]
        plan = _StepPlan(
            moves=moves,
            decode_tokens=[r.token_ids[-1] for r in decoding],
            decode_positions=[r.cached_len for r in decoding],
            prefill_prompts=[r.sequence for r in joiners],
            prefill_cached=cached,
            samplers=[(r.params, r.generator) for r in self._slots],
            max_len=max([r.cached_len + 1 for r in decoding] + [width]),
        )
        return plan, list(self._slots)

    def _pick_joiners(self, free_slots: int) -> list[EngineRequest]:
        """Waiting requests to prefill this step: the oldest first, then others of a similar length.

        A prefill batch is padded to its longest sequence; resumed partial rollouts mix 20-token prompts
        with 500-token prompt+prefix ones, so joining strictly in arrival order would mostly compute
        padding. Beyond a small batch (where padding is cheap), admitting only sequences within 2x of the
        first joiner's length bounds that waste; the others keep their place in the queue for the next step.
        With a KV-cache capacity, admission stops at the first request whose context + 1 does not fit beside the
        running requests' context and the joiners' (``SimServer._admit``); one that cannot fit even alone fails.
        """
        if free_slots <= 0 or not self._waiting:
            return []
        capacity = self.kv_capacity_tokens
        used = sum(r.context_len for r in self._slots)
        joiners: list[EngineRequest] = []
        anchor = width = 0
        for request in list(self._waiting):
            if len(joiners) == free_slots:
                break
            length = request.context_len
            padded = max(width, length) * (len(joiners) + 1)
            if joiners and padded > _CHEAP_PREFILL_TOKENS and not anchor / 2 <= length <= anchor * 2:
                continue
            if joiners and padded > self.max_num_batched_tokens:
                break
            if capacity is not None and used + length + 1 > capacity:
                if self._slots or joiners:
                    break  # it waits for room, and so does everyone behind it
                error = ValueError(
                    f"request {request.request_id!r} needs {length + 1} tokens of KV cache, more than the engine's "
                    f"kv_capacity_tokens={capacity}"
                )
                self._finish(request, error)
                continue
            if not joiners:
                anchor = length
            width = max(width, length)
            used += length + 1
            joiners.append(request)
        for request in joiners:
            self._waiting.remove(request)
        return joiners

    def _preempt(self) -> list[EngineRequest]:
        """vLLM's recompute preemption: while the running requests' context + 1 token each (what the next decode
        step needs, ``SimServer._plan_decode_segment``) exceeds the KV capacity, the newest admitted goes back to
        the front of the queue with its tokens (its KV is dropped; it re-prefills all of it when readmitted).
        Returns the preempted requests; they still sit in their slots until :meth:`_compact`."""
        if self.kv_capacity_tokens is None:
            return []
        running = [r for r in self._slots if not r.done]
        need = sum(r.context_len + 1 for r in running)
        preempted: list[EngineRequest] = []
        while need > self.kv_capacity_tokens:
            victim = max(running, key=lambda r: r.admitted)
            running.remove(victim)
            need -= victim.context_len + 1
            preempted.append(victim)
            self._waiting.appendleft(victim)  # the oldest of them ends up first, as in vLLM and the simulator
            self._release_from_prefix_cache(victim, in_use_tokens=need - len(running))  # the victim's room is free
        self._stats.preemptions += len(preempted)
        return preempted

    def _compact(self, preempted: list[EngineRequest]) -> list[tuple[int, int, int]]:
        """Drop finished and preempted requests from the slots; fill each hole with a live request from the tail."""
        stays = [not r.done and r not in preempted for r in self._slots]
        live = sum(stays)
        tail = ((slot, r) for slot, r in enumerate(self._slots) if slot >= live and stays[slot])
        moves = []
        kept = self._slots[:live]
        for dst in range(live):
            if not stays[dst]:
                src, kept[dst] = next(tail)
                moves.append((src, dst, kept[dst].cached_len))
        self._slots = kept
        return moves

    def _apply(self, plan: _StepPlan, rows: list[EngineRequest], tokens: list[int], log_probs: list[float]) -> None:
        self._stats.decode_steps += bool(plan.decode_tokens)
        self._stats.decode_tokens += len(plan.decode_tokens)
        self._stats.decode_context_tokens += plan.decode_context
        self._stats.prefill_tokens += plan.prefill_tokens
        self._stats.cached_tokens += sum(plan.prefill_cached)
        for request, token, log_prob in zip(rows, tokens, log_probs, strict=True):
            if request.done:  # aborted while the step ran: its result was already returned
                continue
            self._stats.generated_tokens += 1
            request.token_ids.append(token)
            request.log_probs.append(log_prob)
            request.first_output.set()
            outcome = self._check_finished(request, token)
            if outcome is not None:
                self._finish(request, outcome)
        self._notify_progress()

    def _check_finished(self, request: EngineRequest, token: int) -> StopReason | None:
        """The engine's stop check after appending ``token``.

        vLLM (``vllm/v1/core/sched/utils.py``, ``check_stop``): EOS before the length cap. SGLang 0.5.12
        (schedule_batch.py@0.5.12:1213 "def check_finished(self, new_accepted_len: int = 1):"): ``to_finish``
        (abort), then ``max_new_tokens`` (keeping ``finished_len = max_new_tokens`` tokens), then EOS -- an EOS that
        is the last allowed token says "length", and the extra token after an abort says "abort" even when it is EOS.
        (0.5.23 checks EOS before the cap: schedule_batch.py@0.5.23:2034 "if self._check_token_based_finish".)
        """
        eos = token in self.eos_token_ids and not request.params.ignore_eos
        at_length = (
            len(request.token_ids) >= request.params.max_tokens
            or len(request.prompt_ids) + len(request.token_ids) >= self.max_model_len
        )
        if self.semantics == "vllm":
            return "completed" if eos else "length" if at_length else None
        if request.to_finish:
            return "aborted"
        if at_length:
            del request.token_ids[request.params.max_tokens :], request.log_probs[request.params.max_tokens :]
            return "length"
        return "completed" if eos else None

    def _admit_to_prefix_cache(self, request: EngineRequest) -> int:
        """A joiner's tokens found in the prefix cache (0 without one); it holds its blocks until it leaves."""
        if self._prefix_cache is None:
            return 0
        return self._prefix_cache.admit(request.request_id, request.sequence, self._context_in_use())

    def _release_from_prefix_cache(self, request: EngineRequest, in_use_tokens: int | None = None) -> None:
        """A request leaves the batch: the KV it computed (all but its last sampled token) becomes reusable.
        ``in_use_tokens``: the running requests' context, where the slots still list the request (a preemption)."""
        if self._prefix_cache is not None:
            in_use = self._context_in_use() if in_use_tokens is None else in_use_tokens
            self._prefix_cache.release(request.request_id, request.sequence[: request.cached_len], in_use)

    def _context_in_use(self) -> int:
        return sum(r.context_len for r in self._slots if not r.done)

    def _notify_progress(self) -> None:
        if self._stepped is not None:
            self._stepped.set()
            self._stepped = None

    def _finish(self, request: EngineRequest, outcome: StopReason | BaseException) -> None:
        """Resolve a request once; a running one keeps its slot until the next compaction. Progress waiters are
        woken last, so they run after the request's own done-callbacks."""
        if request.done:
            return
        request.done = True
        request.first_output.set()
        self._release_from_prefix_cache(request)
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        if request in self._waiting:
            self._waiting.remove(request)
        if not request.future.done():
            if isinstance(outcome, BaseException):
                request.future.set_exception(outcome)
            else:
                request.future.set_result(GenerationResult(list(request.token_ids), list(request.log_probs), outcome))
        self._notify_progress()

    # ------------------------------------------------------------------ model work (worker thread)

    def _execute(self, plan: _StepPlan) -> tuple[list[int], list[float]]:
        with self._model_lock, torch.inference_mode():
            self._kv.reserve(len(plan.samplers), plan.max_len)
            for src, dst, length in plan.moves:
                self._kv.move_slot(src, dst, length)
            logits = []
            if plan.decode_tokens:
                logits.append(self._kv.decode(plan.decode_tokens, plan.decode_positions))
            if plan.prefill_prompts:
                logits.append(self._kv.prefill(plan.prefill_prompts, len(plan.decode_tokens)))
            return sample(torch.cat(logits), plan.samplers, self._shared_generator, self.logprobs_mode)


def sample(
    logits: torch.Tensor,
    samplers: list[tuple[SamplingParams, torch.Generator | None]],
    shared_generator: torch.Generator,
    logprobs_mode: LogprobsMode,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of float32 ``logits`` [n, V]; return the tokens and their log-probs.

    Random rows use inverse-CDF sampling with exactly one uniform draw per token, taken from the request's own
    generator when it has a seed: its tokens then depend only on its own logits, not on its batch neighbours.
    """
    raw = torch.log_softmax(logits, dim=-1)
    tokens = raw.argmax(dim=-1)
    chosen = raw
    random_rows = [row for row, (params, _) in enumerate(samplers) if params.temperature > 0]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        params = [samplers[row][0] for row in random_rows]
        temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        temperatures = temperatures.unsqueeze(1)
        processed = torch.log_softmax(_truncate(logits[index] / temperatures, params), dim=-1)
        probs = processed.double().exp()
        cdf = probs.cumsum(dim=-1)
        uniforms = _uniforms([samplers[row][1] for row in random_rows], shared_generator).to(logits.device)
        picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        # Rounding can push the draw past the last token with mass; fall back to that token.
        last_with_mass = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        tokens[index] = torch.minimum(picked, last_with_mass)
        if logprobs_mode == "processed_logprobs":
            chosen = raw.clone()
            chosen[index] = processed
    log_probs = chosen.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), log_probs.tolist()


def _uniforms(generators: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    shared_rows = [row for row, g in enumerate(generators) if g is None]
    # On the CPU generators' device whatever the model's: a seeded request draws the same uniforms everywhere.
    uniforms = torch.empty(len(generators), dtype=torch.float64, device=shared.device)
    if shared_rows:
        uniforms[shared_rows] = torch.rand(
            len(shared_rows), dtype=torch.float64, generator=shared, device=shared.device
        )
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = torch.rand((), dtype=torch.float64, generator=generator, device=generator.device)
    return uniforms


def _truncate(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask to -inf the logits outside each row's top-k, then outside its top-p nucleus (of the top-k mass)."""
    vocab = scaled.shape[-1]
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1 for p in params)
    if not (use_k or use_p):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=scaled.device)
        remove |= torch.arange(vocab, device=scaled.device).unsqueeze(0) >= top_k.unsqueeze(1)
    if use_p:
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # top_p == 1 must keep everything, whatever the rounding of the cumulative sum.
        top_p = torch.tensor(
            [p.top_p if p.top_p < 1 else float("inf") for p in params], dtype=scaled.dtype, device=scaled.device
        )
        remove |= mass_before >= top_p.unsqueeze(1)
    return scaled.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
