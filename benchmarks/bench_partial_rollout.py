"""Rollout-phase time per step, synchronous vs partial rollout, on the real CPU engine, side by side.

    python -m benchmarks.bench_partial_rollout                     # markdown tables on stdout (~2 min)
    python -m benchmarks.bench_partial_rollout --out REPORT.md \\
        --plot docs/img/partial_rollout_benchmark.png              # also refresh the doc's results block + plot
    python -m benchmarks.bench_partial_rollout --quick             # tiny smoke configuration, a few seconds

Why this benchmark: partial rollout's only claim is speed -- a synchronous GRPO step waits for its longest sample,
and while the long tail finishes the engine runs a handful of requests, far below its batched throughput. This
measures that claim on :class:`~verl_partial.cpu_backend.engine.CpuBatchedEngine` (continuous batching, abort,
pause/resume), with the very ``run_step`` / ``RolloutPool`` the trainer runs; no Ray, no verl trainer, nothing
simulated except the response lengths.

Workload (identical for every mode):

* A tiny random Qwen2 (the demo's shape by default); prompts of 16-32 tokens, ids and length a pure function of
  the prompt key.
* Response lengths are imposed, as vLLM's own serving benchmarks do: ``ignore_eos=True`` and a per-sample target
  length. The target is a pure function of (seed, prompt key, sample index), drawn from a lognormal (median
  ``--median-len``, sigma ``--sigma``; sigma 1 gives p99/p50 = e^2.33 = 10.2) and capped at ``--response-length``.
  A resumed sample keeps its target: the sample ends (``Finish.EOS``) when it reaches it.
* Each step trains ``B`` groups of ``n`` samples. The prompt stream is the same for all modes (sync step ``s``
  uses prompts ``sB .. sB+B-1``; partial draws the same stream in order).

Modes (each on its own engine, same model, same ``max_num_seqs``; steps are interleaved round-robin across modes
so a noisy neighbour on the shared machine slows all modes alike):

* ``sync``: verl's synchronous rollout -- the step's ``B*n`` samples are submitted at once and the step waits for
  the longest.
* ``partial``: ``run_step`` over a ``RolloutPool`` with ``extra_groups`` groups in flight beyond ``B``; once ``B``
  whole groups are finished the rest is aborted (``abort_on_done``), parked and resumed next step by re-prefilling
  prompt + partial response (the plain CPU engine keeps no prefix cache, so that re-prefill is paid and counted).
  Staleness: the package default (``max_staleness=1``, ``restart``), so tokens older than one version are thrown
  away and counted as discarded.
* ``partial+budget``: Kimi k1.5-style per-step token budget per sample (``staleness_policy=keep``, as the
  ``kimi`` preset).

Utilisation = (tokens generated during the rollout phase / rollout seconds) / peak, where peak is the engine's
tokens/s with ``max_num_seqs`` requests of the workload's mean response length submitted at once (``ignore_eos``,
best of several runs): the throughput the engine reaches when every slot is busy.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import hashlib
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Protocol

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks._machine import cpu_name
from verl_partial.config.partial import PRESETS, PartialConfig
from verl_partial.core.engines.adapter import finish_mapper
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import GroupState, RolloutPool, SegmentRequest
from verl_partial.core.partial.scheduler import SegmentResult, run_step
from verl_partial.cpu_backend.engine import CpuBatchedEngine, EngineStats, SamplingParams

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
VOCAB = 512


@dataclass(frozen=True)
class Workload:
    """Every knob that defines what is generated; printed verbatim into the report."""

    group_size: int = 8
    batch_groups: int = 8
    response_length: int = 512
    median_len: float = 48.0
    sigma: float = 1.0
    prompt_len_min: int = 16
    prompt_len_max: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    max_num_seqs: int = 64
    steps: int = 10
    warmup: int = 1
    peak_repeats: int = 3
    seed: int = 0

    def target_length(self, key: str, index: int) -> int:
        """Imposed response length of sample ``index`` of prompt ``key``: lognormal, capped, >= 1."""
        z = NormalDist().inv_cdf(_unit(self.seed, "len", key, index))
        return max(1, min(self.response_length, round(self.median_len * math.exp(self.sigma * z))))

    def prompt_ids(self, key: str) -> list[int]:
        span = self.prompt_len_max - self.prompt_len_min + 1
        length = self.prompt_len_min + int(_unit(self.seed, "plen", key) * span)
        return [int(_unit(self.seed, "tok", key, i) * VOCAB) for i in range(length)]

    def length_quantiles(self, draws: int = 20_000) -> dict[str, float]:
        """Empirical quantiles of the capped target length over many (key, index) pairs."""
        lengths = sorted(self.target_length(f"q{i}", 0) for i in range(draws))
        at = {q: lengths[min(draws - 1, int(q * draws))] for q in (0.5, 0.9, 0.99)}
        return {"mean": statistics.fmean(lengths), "p50": at[0.5], "p90": at[0.9], "p99": at[0.99]}


def quick_workload() -> Workload:
    """A configuration small enough for a smoke test (a few seconds), same code paths."""
    return Workload(
        group_size=4,
        batch_groups=2,
        response_length=64,
        median_len=8.0,
        max_num_seqs=8,
        steps=3,
        warmup=1,
        peak_repeats=1,
    )


def _unit(*parts: object) -> float:
    """A uniform in (0, 1) that is a pure function of ``parts`` (so every mode sees the same workload)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


def build_model(workload: Workload) -> Qwen2ForCausalLM:
    """Qwen2, 4 heads / 2 KV heads, tied embeddings (the demo's architecture family)."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=workload.hidden_size,
        intermediate_size=2 * workload.hidden_size,
        num_hidden_layers=workload.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=workload.response_length + workload.prompt_len_max + 64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(workload.seed)
    return Qwen2ForCausalLM(config).eval()


def new_engine(model: Qwen2ForCausalLM, workload: Workload) -> CpuBatchedEngine:
    return CpuBatchedEngine(model, eos_token_ids=set(), max_num_seqs=workload.max_num_seqs, seed=workload.seed)


# ---------------------------------------------------------------------------------------------- partial plumbing


@dataclass(frozen=True)
class Prompt:
    key: str
    ids: list[int]


class StreamSource:
    """The prompt stream ``p0, p1, ...``; partial mode draws from it in order (sync indexes it directly)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.position = 0

    def next_prompt(self) -> tuple[Prompt, str]:
        key = f"p{self.position}"
        self.position += 1
        return Prompt(key, self.workload.prompt_ids(key)), key


class EngineSegmentBackend:
    """``SegmentBackend`` over the CPU engine (one server): one engine call per segment, lengths imposed by
    ``ignore_eos``.

    A segment may produce at most ``min(request.max_new_tokens, target - tokens so far)``, so a resumed sample never
    overshoots its target and the pool's ``response_length`` bound is respected. The engine's stop reason is put in
    verl's vLLM server's words and mapped by the production mapper; a segment that reaches its sample's target ends
    where the model would have sampled EOS (``ignore_eos`` stands in for it), so that ``LENGTH`` becomes ``EOS``
    unless the target is the ``response_length`` cap itself (a truncated answer).
    """

    servers = ("cpu-engine",)

    def __init__(self, engine: CpuBatchedEngine, workload: Workload) -> None:
        self.engine = engine
        self.workload = workload
        self.to_finish = finish_mapper("cpu")
        self.calls: dict[str, asyncio.Future[SegmentResult]] = {}

    def launch(self, wave: list[tuple[GroupState[Prompt], SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        futures = []
        for group, request in wave:
            task = asyncio.ensure_future(self._segment(group, request))
            self.calls[request.request_id] = task
            task.add_done_callback(lambda _, rid=request.request_id: self.calls.pop(rid, None))
            futures.append(task)
        return futures

    async def _segment(self, group: GroupState[Prompt], request: SegmentRequest) -> SegmentResult:
        prefix = group.samples[request.ref.index].token_ids.tolist()
        target = self.workload.target_length(group.key, request.ref.index)
        max_tokens = min(request.max_new_tokens, target - len(prefix))
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        result = await self.engine.generate(request.request_id, group.prompt.ids + prefix, params)
        # verl's vLLM server reports EOS and max_tokens both as "completed".
        stop_reason = "aborted" if result.stop_reason == "aborted" else "completed"
        finish = self.to_finish(stop_reason, result.token_ids, max_tokens, frozenset()).finish  # no EOS: nothing to cut
        total = len(prefix) + len(result.token_ids)
        if finish is Finish.LENGTH and total == target < self.workload.response_length:
            finish = Finish.EOS
        return SegmentResult(
            new_ids=np.asarray(result.token_ids, dtype=np.int32),
            new_log_probs=np.asarray(result.log_probs, dtype=np.float32),
            finish=finish,
            server=request.server,
            prompt_ids=np.asarray(group.prompt.ids, dtype=np.int32),
        )

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        for request in requests:
            await self.engine.abort(request.request_id)  # its generate returns the tokens so far as "aborted"

    async def progress(self, server: str) -> dict[str, int]:
        return {request_id: self.engine.tokens_so_far(request_id) for request_id in self.engine.request_ids}

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        """Drop the calls: the engine stops them and the caller gets nothing back, as a Ray cancel does."""
        for request in requests:
            call = self.calls.get(request.request_id)
            if call is not None:
                call.cancel()
            await self.engine.abort(request.request_id)

    async def abort(self, server: str) -> None:
        # Pause first so nothing queued is scheduled between the abort and the step's end (vLLM's pause_generation).
        self.engine.pause()
        await self.engine.abort_all()

    async def resume(self, server: str) -> None:
        self.engine.resume()

    def reopening(self) -> dict[str, Awaitable[None]]:
        """None: the engine's abort returns once every call has answered and its resume is immediate."""
        return {}


# ---------------------------------------------------------------------------------------------- modes


@dataclass
class StepRecord:
    """One rollout phase: wall time, engine counters and (partial only) the pool's accounting."""

    seconds: float
    generated: int  # tokens handed to requests by the engine during the phase
    trained: int  # response tokens of the B groups handed to training
    discarded: int = 0
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0
    trace: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the step, running requests)


class Mode(Protocol):
    name: str
    engine: CpuBatchedEngine

    async def step(self, step: int) -> tuple[int, int, dict[str, float]]:
        """Run one rollout phase; return (tokens generated, tokens trained, pool metrics)."""


class SyncMode:
    """verl's synchronous rollout: B fresh groups, all B*n samples submitted at once, wait for the longest."""

    def __init__(self, name: str, engine: CpuBatchedEngine, workload: Workload) -> None:
        self.name, self.engine, self.workload = name, engine, workload

    async def step(self, step: int) -> tuple[int, int, dict[str, float]]:
        wl = self.workload
        calls = []
        for g in range(step * wl.batch_groups, (step + 1) * wl.batch_groups):
            key = f"p{g}"
            ids = wl.prompt_ids(key)
            for i in range(wl.group_size):
                params = SamplingParams(max_tokens=wl.target_length(key, i), temperature=1.0, ignore_eos=True)
                calls.append(self.engine.generate(f"{key}/{i}", ids, params))
        results = await asyncio.gather(*calls)
        tokens = sum(len(r.token_ids) for r in results)
        return tokens, tokens, {}


class PartialMode:
    """The trainer's partial rollout: ``run_step`` over a persistent ``RolloutPool``; version = step."""

    def __init__(self, name: str, engine: CpuBatchedEngine, workload: Workload, config: PartialConfig) -> None:
        self.name, self.engine = name, engine
        self.pool: RolloutPool[Prompt] = RolloutPool(
            config,
            group_size=workload.group_size,
            batch_groups=workload.batch_groups,
            response_length=workload.response_length,
            engine_slots=engine.max_num_seqs,  # one engine
        )
        self.backend = EngineSegmentBackend(engine, workload)
        self.source = StreamSource(workload)

    async def step(self, step: int) -> tuple[int, int, dict[str, float]]:
        result = await run_step(self.pool, self.backend, self.source, step=step, version=step)
        m = result.metrics
        return int(m["partial/tokens_generated"]), int(m["partial/tokens_trained"]), m


async def timed_step(mode: Mode, step: int, trace: bool) -> StepRecord:
    """Time one rollout phase and diff the engine's counters; optionally sample its running-request count."""
    samples: list[tuple[float, int]] = []
    before: EngineStats = mode.engine.stats
    start = time.perf_counter()

    async def sampler() -> None:
        while True:
            samples.append((time.perf_counter() - start, mode.engine.num_running))
            await asyncio.sleep(0.005)

    probe = asyncio.ensure_future(sampler()) if trace else None
    generated, trained, metrics = await mode.step(step)
    seconds = time.perf_counter() - start
    if probe is not None:
        probe.cancel()
        samples.append((seconds, 0))
    after = mode.engine.stats
    return StepRecord(
        seconds=seconds,
        generated=after.generated_tokens - before.generated_tokens,
        trained=trained,
        discarded=int(metrics.get("partial/tokens_discarded", 0)),
        staleness_mean=metrics.get("partial/staleness/mean", 0.0),
        staleness_max=metrics.get("partial/staleness/max", 0.0),
        decode_steps=after.decode_steps - before.decode_steps,
        decode_rows=after.decode_tokens - before.decode_tokens,
        prefill_tokens=after.prefill_tokens - before.prefill_tokens,
        trace=samples,
    )


async def measure_peak(model: Qwen2ForCausalLM, workload: Workload, length: int) -> float:
    """Engine tokens/s with every slot busy: ``max_num_seqs`` requests of ``length`` tokens, best of N runs."""
    engine = new_engine(model, workload)
    await engine.generate("warmup", workload.prompt_ids("warmup"), SamplingParams(max_tokens=8, ignore_eos=True))
    best = 0.0
    for repeat in range(workload.peak_repeats):
        params = SamplingParams(max_tokens=length, temperature=1.0, ignore_eos=True)
        calls = [
            engine.generate(f"peak{repeat}/{i}", workload.prompt_ids(f"peak{i}"), params)
            for i in range(workload.max_num_seqs)
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*calls)
        best = max(best, sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))
    await engine.close()
    return best


def build_modes(model: Qwen2ForCausalLM, workload: Workload) -> list[Mode]:
    b = workload.batch_groups
    budget = max(1, workload.response_length // 4)
    # Over-provisioning rows: the `restart` preset (extra groups admitted at the step start, no refill) with more
    # extra groups; +partial=default (wait + refill) takes no extra groups.
    restart = PRESETS["restart"]
    configs = {
        f"partial extra={max(1, b // 2)}": replace(restart, extra_groups=max(1, b // 2)),
        f"partial extra={b}": replace(restart, extra_groups=b),
        # A deep pool keeps the engine full through the tail; staleness then exceeds 1, so keep it
        # (bounded by the pool depth) and leave the gap to rollout correction.
        f"partial extra={3 * b} keep": replace(restart, extra_groups=3 * b, staleness_policy="keep"),
        f"partial extra={b} budget={budget}": replace(
            restart,
            extra_groups=b,
            step_token_budget=budget,
            max_staleness=math.ceil(workload.response_length / budget),
            staleness_policy="keep",
        ),
    }
    modes: list[Mode] = [SyncMode("sync", new_engine(model, workload), workload)]
    modes += [PartialMode(name, new_engine(model, workload), workload, cfg) for name, cfg in configs.items()]
    return modes


@dataclass
class Report:
    workload: Workload
    quantiles: dict[str, float]
    peak: float
    peak_length: int
    records: dict[str, list[StepRecord]]
    total_seconds: float


async def run(workload: Workload) -> Report:
    """Peak first, then all modes step by step, interleaved, then peak again (best of both kept)."""
    started = time.perf_counter()
    model = build_model(workload)
    quantiles = workload.length_quantiles()
    peak_length = max(1, round(quantiles["mean"]))
    peak = await measure_peak(model, workload, peak_length)
    modes = build_modes(model, workload)
    for mode in modes:  # first-call costs (thread start, cache allocation) outside any timed step
        await mode.engine.generate("warmup", workload.prompt_ids("warmup"), SamplingParams(max_tokens=4))
    records: dict[str, list[StepRecord]] = {mode.name: [] for mode in modes}
    for step in range(workload.steps):
        for mode in modes:
            record = await timed_step(mode, step, trace=step == workload.steps - 1)
            records[mode.name].append(record)
    for mode in modes:
        await mode.engine.close()
    peak = max(peak, await measure_peak(model, workload, peak_length))
    return Report(workload, quantiles, peak, peak_length, records, time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------- report


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def tables(report: Report) -> str:
    wl = report.workload
    measured = {name: recs[wl.warmup :] for name, recs in report.records.items()}
    sync_mean = statistics.fmean(r.seconds for r in measured["sync"])
    main = [
        "| mode | rollout s/step (mean ± std) | speed-up vs sync | tokens/s | % of peak (reference) "
        "| staleness mean / max | tokens discarded / step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    detail = [
        "| mode | tokens generated / step | tokens trained / step | prefill tokens / step | decode steps / step "
        "| mean running requests | ms / decode step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, recs in measured.items():
        mean, std = _mean_std([r.seconds for r in recs])
        seconds = sum(r.seconds for r in recs)
        rate = sum(r.generated for r in recs) / seconds
        staleness = statistics.fmean(r.staleness_mean for r in recs)
        main.append(
            f"| {name} | {mean:.3f} ± {std:.3f} | {sync_mean / mean:.2f}x | {rate:,.0f} "
            f"| {100 * rate / report.peak:.0f} % | {staleness:.2f} / {max(r.staleness_max for r in recs):.0f} "
            f"| {statistics.fmean(r.discarded for r in recs):,.0f} |"
        )
        decode_steps = sum(r.decode_steps for r in recs)
        detail.append(
            f"| {name} | {statistics.fmean(r.generated for r in recs):,.0f} | "
            f"{statistics.fmean(r.trained for r in recs):,.0f} | "
            f"{statistics.fmean(r.prefill_tokens for r in recs):,.0f} | "
            f"{decode_steps / len(recs):,.0f} | {sum(r.decode_rows for r in recs) / max(1, decode_steps):.1f} | "
            f"{1e3 * seconds / max(1, decode_steps):.2f} |"
        )
    per_step = ["| step | " + " | ".join(report.records) + " |", "|---:|" + "---:|" * len(report.records)]
    for step in range(wl.steps):
        cells = " | ".join(f"{recs[step].seconds:.3f}" for recs in report.records.values())
        per_step.append(f"| {step}{' (warm-up)' if step < wl.warmup else ''} | {cells} |")
    return "\n".join(
        [
            *main,
            "",
            "Where the time goes (same measured steps):",
            "",
            *detail,
            "",
            "Rollout seconds of every step:",
            "",
            *per_step,
        ]
    )


def header(report: Report, command: str) -> str:
    wl, q = report.workload, report.quantiles
    cpu = cpu_name()
    params = sum(p.numel() for p in build_model(wl).parameters())
    return "\n".join(
        [
            f"Run {_dt.date.today().isoformat()} on {cpu}, {os.cpu_count()} cores shared with other jobs, "
            f"torch {torch.__version__} with {torch.get_num_threads()} thread, Python {platform.python_version()}; "
            f"whole run {report.total_seconds:.0f} s. Command: `{command}`",
            "",
            f"* Model: random Qwen2, hidden {wl.hidden_size}, {wl.num_layers} layers, 4 heads / 2 KV heads, "
            f"vocab {VOCAB}, {params / 1e6:.2f} M parameters; `CpuBatchedEngine(max_num_seqs={wl.max_num_seqs})`, "
            "temperature 1, `ignore_eos=True`.",
            f"* Step: B = {wl.batch_groups} groups x n = {wl.group_size} samples = "
            f"{wl.batch_groups * wl.group_size} trained samples; prompts {wl.prompt_len_min}-{wl.prompt_len_max} "
            f"tokens; {wl.steps} steps per mode, interleaved, the first {wl.warmup} excluded.",
            f"* Response length: lognormal(median {wl.median_len:g}, sigma {wl.sigma:g}) capped at "
            f"{wl.response_length}, a pure function of (seed {wl.seed}, prompt, sample index): mean {q['mean']:.0f}, "
            f"p50 {q['p50']:.0f}, p90 {q['p90']:.0f}, p99 {q['p99']:.0f} (p99/p50 = {q['p99'] / q['p50']:.1f}).",
            f"* Peak = {report.peak:,.0f} tokens/s: {wl.max_num_seqs} requests x {report.peak_length} tokens "
            f"(the mean response length) submitted at once, best of {2 * wl.peak_repeats} runs.",
            "* Partial rows: the `restart` preset (abort on done, `max_staleness=1`, no refill) except the "
            "fields named; the budget row uses `staleness_policy=keep`, `max_staleness=ceil(response_length / "
            "budget)` like the `kimi` preset.",
        ]
    )


def plot(report: Report, path: Path) -> bool:
    """Per-step rollout time of each mode, and running requests during the last step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, recs in report.records.items():
        steps = list(range(len(recs)))
        left.plot(steps, [r.seconds for r in recs], marker="o", label=name)
        trace = recs[-1].trace
        right.step([t for t, _ in trace], [n for _, n in trace], where="post", label=name)
    left.axvspan(-0.5, report.workload.warmup - 0.5, color="0.9", label="warm-up")
    left.set(xlabel="training step", ylabel="rollout phase (s)", title="Rollout time per step", ylim=(0, None))
    right.set(
        xlabel="seconds into the step",
        ylabel="running requests",
        title=f"Engine concurrency during step {len(recs) - 1}",
        ylim=(0, report.workload.max_num_seqs + 4),
    )
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_block(path: Path, text: str) -> None:
    """Replace the block between the bench markers (the prose around it is kept), or create the file."""
    block = f"{START}\n{text}\n{END}"
    if path.exists() and START in (old := path.read_text()):
        new = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, old, flags=re.S)
    else:
        new = f"# Partial rollout benchmark\n\n{block}\n"
    path.write_text(new)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration (a few seconds)")
    parser.add_argument("--steps", type=int, help="steps per mode (default 10, quick 3)")
    parser.add_argument("--batch-groups", type=int, help="B, groups trained per step (default 8)")
    parser.add_argument("--group-size", type=int, help="n, samples per group (default 8)")
    parser.add_argument("--median-len", type=float, help="median imposed response length (default 48)")
    parser.add_argument("--sigma", type=float, help="lognormal sigma of the response length (default 1.0)")
    parser.add_argument("--response-length", type=int, help="cap on response length (default 512)")
    parser.add_argument("--hidden-size", type=int, help="model hidden size (default 64)")
    parser.add_argument("--num-layers", type=int, help="model layers (default 2)")
    parser.add_argument("--max-num-seqs", type=int, help="engine concurrency (default 64)")
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--out", type=Path, help="markdown file whose bench block is replaced (or created)")
    parser.add_argument("--plot", type=Path, help="PNG path for the plot (needs matplotlib)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = quick_workload() if args.quick else Workload()
    overrides = {
        name: getattr(args, name)
        for name in (
            "steps",
            "batch_groups",
            "group_size",
            "median_len",
            "sigma",
            "response_length",
            "hidden_size",
            "num_layers",
            "max_num_seqs",
            "seed",
        )
        if getattr(args, name) is not None
    }
    workload = replace(workload, **overrides)
    report = asyncio.run(run(workload))
    command = "python -m benchmarks.bench_partial_rollout " + " ".join(argv if argv is not None else sys.argv[1:])
    text = header(report, command.strip()) + "\n\n" + tables(report)
    if args.plot:
        if plot(report, args.plot):
            rel = os.path.relpath(args.plot, args.out.parent) if args.out else str(args.plot)
            text += f"\n\n![rollout time per step and engine concurrency]({rel})"
        else:
            print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
    print(text)
    if args.out:
        write_block(args.out, text)
    return report


if __name__ == "__main__":
    main()
