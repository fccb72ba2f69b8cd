"""Our continuous-batching engine on a GPU: decode step time vs running requests, beside the roofline; rollout phase
sync vs ``default`` vs ``tail`` on the same engine. Measured, our PyTorch engine, not vLLM.

    python -m benchmarks.gpu_engine_curve --device cuda --out "$OUT/gpu_engine_curve.jsonl"   # 4-7 min (H100)
    python -m benchmarks.gpu_engine_curve --smoke --out /tmp/gpu_engine_curve.jsonl           # CPU, tiny model
    python -m benchmarks.gpu_engine_curve --from-results benchmarks/results/gpu_engine_curve_h100.jsonl \
        --plot docs/img/gpu_h100.png                                                       # here: report and plot

Why: every GPU figure elsewhere in this project is emulated or simulated (docs/method/gpu-simulator.md). This runs
the very engine of ``verl_partial.cpu_backend`` (``CpuBatchedEngine(model, device="cuda")``, a bf16 model) on a
real accelerator, so its step-time curve can be put beside the roofline the simulator is built from, and the
scheduler's modes can be compared on a real step-time curve instead of a modelled one. The engine is eager PyTorch
(one kernel per op, no CUDA graphs, no paged or fused attention): its small-batch steps are bound by launch and
Python overhead, which vLLM removes. Its figures are ours, never vLLM's, and every line says so.

It runs on PyTorch + transformers alone (no verl, no Ray, no vLLM, no network): a random-initialised Llama of
about 1.1 B parameters (TinyLlama's shape, built from a ``LlamaConfig``), bf16 on CUDA.

1. ``decode_step``: one engine step (``SlotKVModel.decode`` + the engine's ``sample``) for ``n`` running requests at
   context ``ctx``, median of ``--repeats`` after ``--warmup``, timed between ``torch.cuda.synchronize`` calls;
   beside it the roofline (``ServerSpec.step_seconds`` at 100 % of peak bandwidth and FLOP/s) and the simulator's
   vLLM model (the same at ``Efficiency()``: 70 % MBU, 50 % MFU), from ``verl_partial.sim.hardware``.
   ``prefill``: ms per prompt token for a batch of prompts, with its roofline.
2. ``rollout_step`` / ``rollout_mode``: ``run_step`` + ``RolloutPool`` (what the trainer runs) over
   ``benchmarks.bench_partial_rollout.EngineSegmentBackend`` on one engine, modes ``sync`` / ``default`` /
   ``tail`` as ``verl_partial.sim.run.mode_configs`` defines them, steps interleaved across modes. Answer lengths
   are imposed (``ignore_eos``) by ``verl_partial.sim.workload.Workload``: lognormal, p99/p50 = 8, capped, half the
   log-variance shared by a prompt's samples. ``tail`` orders a window of prompts by their earlier epochs' lengths;
   a run this short has no earlier epoch, so every mode's length estimator would start empty and ``tail`` would
   equal ``default``: the estimator of every mode that has one is given one imposed earlier epoch (the mean imposed
   length of each prompt's samples at admission key ``e-1``), as after one epoch of training.
   Slot occupancy = trained tokens / (slots x rollout seconds / the measured full-batch step time at the workload's
   mean running context): the share of what an engine kept full would have produced.

Each measurement is appended to ``--out`` as one JSON line as soon as it is taken (flushed), so a run cut short
still returns its results; ``--budget-s`` stops starting new measurements when the next would not fit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks._machine import git_commit
from benchmarks.bench_partial_rollout import EngineSegmentBackend, Prompt
from benchmarks.evidence import last_run, runs
from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.length_batching import LengthBatcher
from verl_partial.core.partial.on_policy import LengthEstimator, length_estimator
from verl_partial.core.partial.pool import RolloutPool
from verl_partial.core.partial.scheduler import run_step
from verl_partial.cpu_backend.engine import CpuBatchedEngine, SamplingParams, sample
from verl_partial.cpu_backend.kv_model import SlotKVModel
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import H100_SXM, H200_SXM, Efficiency, GpuSpec, ModelSpec
from verl_partial.sim.run import mode_configs
from verl_partial.sim.workload import PromptCycle, Workload

LABEL = "measured, our PyTorch engine, not vLLM"
REPO = Path(__file__).resolve().parent.parent
MODES = ("sync", "default", "tail")


@dataclass(frozen=True)
class Plan:
    """Everything a run measures; ``--smoke`` swaps in a tiny CPU-sized plan with the same code paths."""

    hidden: int = 2048
    layers: int = 22
    heads: int = 32
    kv_heads: int = 4
    intermediate: int = 5632
    vocab: int = 32000
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    contexts: tuple[int, ...] = (512, 2048)
    prefill_shapes: tuple[tuple[int, int], ...] = ((8, 512), (2, 2048))  # (prompts, tokens each)
    warmup: int = 2
    repeats: int = 5
    in_flight: tuple[int, ...] = (128, 256)  # requests per step = batch groups x group size
    group_size: int = 8
    max_num_seqs: int = 256
    prompt_len: int = 128
    p50: float = 64.0
    p99_over_p50: float = 8.0
    response_length: int = 512
    rollout_steps: int = 4  # one window of ``tail`` (length_window_steps=4): every mode over the same prompts
    budget_s: float = 420.0


SMOKE = Plan(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=512,
    batch_sizes=(1, 2, 4),
    contexts=(32, 64),
    prefill_shapes=((2, 32),),
    warmup=1,
    repeats=2,
    in_flight=(8,),
    group_size=4,
    max_num_seqs=8,
    prompt_len=16,
    p50=8.0,
    response_length=64,
    rollout_steps=2,
    budget_s=120.0,
)


class Recorder:
    """Appends one JSON line per measurement (flushed at once) and stops new ones when the budget runs out."""

    def __init__(self, path: Path, common: dict[str, Any], budget_s: float, started: float) -> None:
        self.path = path
        self.common = common
        self.budget_s = budget_s
        self.started = started
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def fits(self, estimate_s: float) -> bool:
        """Whether a measurement expected to take ``estimate_s`` still ends inside the budget."""
        return self.elapsed() + estimate_s <= self.budget_s

    def write(self, kind: str, **fields: Any) -> None:
        line = {"kind": kind, **fields, **self.common, "elapsed_s": round(self.elapsed(), 2)}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        print(json.dumps({k: v for k, v in line.items() if k not in self.common}), flush=True)

    def close(self) -> None:
        self._file.close()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(plan: Plan, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A random Llama built on the device (no download, no host copy of 4 GB of fp32 init)."""
    config = LlamaConfig(
        vocab_size=plan.vocab,
        hidden_size=plan.hidden,
        intermediate_size=plan.intermediate,
        num_hidden_layers=plan.layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.kv_heads,
        max_position_embeddings=max(plan.contexts) + plan.prompt_len + plan.response_length + 256,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype).eval()


def model_spec(model: LlamaForCausalLM, dtype: torch.dtype) -> ModelSpec:
    """The roofline's view of the model: every weight but the embedding (its rows are gathered) is read per step."""
    config = model.config
    read = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    head_dim = config.hidden_size // config.num_attention_heads
    return ModelSpec(
        f"random-llama-{read / 1e9:.2f}B",
        float(read),
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        bytes_per_param=torch.finfo(dtype).bits // 8,
    )


def roofline_gpu(name: str) -> GpuSpec:
    """The data-sheet GPU the roofline uses: the device's own where ``verl_partial.sim.hardware`` has it, else
    (a CPU smoke run) the H100 SXM, named in every line."""
    return H200_SXM if "H200" in name else H100_SXM


@dataclass(frozen=True)
class Roofline:
    """Step time of the same model on the data-sheet GPU: at 100 % of peak, and as the simulator models vLLM."""

    peak: ServerSpec
    vllm_model: ServerSpec

    @classmethod
    def of(cls, gpu: GpuSpec, model: ModelSpec) -> Roofline:
        return cls(ServerSpec(gpu, model, efficiency=Efficiency(1.0, 1.0)), ServerSpec(gpu, model))

    def decode(self, n: int, ctx: int) -> dict[str, float]:
        kv = n * (ctx + 1)
        return {
            "roofline_ms": 1e3 * self.peak.step_seconds(n, kv),
            "sim_vllm_ms": 1e3 * self.vllm_model.step_seconds(n, kv),
        }

    def prefill(self, prompts: int, length: int) -> dict[str, float]:
        tokens, pairs = prompts * length, prompts * length * (length + 1) / 2
        return {
            "roofline_ms": 1e3 * self.peak.step_seconds(0, 0.0, tokens, pairs),
            "sim_vllm_ms": 1e3 * self.vllm_model.step_seconds(0, 0.0, tokens, pairs),
        }


def timed(device: torch.device, fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    times = []
    for index in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def decode_step_s(kv: SlotKVModel, device: torch.device, n: int, ctx: int, plan: Plan) -> float:
    """Median seconds of one engine decode step (forward + the engine's sampler) for ``n`` requests at ``ctx``.

    The cache rows hold whatever they hold: attention costs the same whatever the keys are.
    """
    kv.reserve(n, ctx + 1)
    params = SamplingParams(max_tokens=1, temperature=1.0)
    samplers: list[tuple[SamplingParams, torch.Generator | None]] = [(params, None)] * n
    generator = torch.Generator().manual_seed(0)
    tokens = [int(t) for t in torch.randint(0, kv.vocab_size, (n,), generator=generator)]

    def step() -> None:
        sample(kv.decode(tokens, [ctx] * n), samplers, generator, "processed_logprobs")

    with torch.inference_mode():
        return statistics.median(timed(device, step, plan.warmup, plan.repeats))


def check_against_hf(model: LlamaForCausalLM, rec: Recorder, device: torch.device) -> None:
    """The engine's forward (prefill, then one decode step) against the model's own HF forward on the same device:
    the device plumbing is right only if both give the same next-token log-probs (up to the dtype's rounding)."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (33,), generator=generator).tolist()
    kv = SlotKVModel(model, max_slots=1, max_model_len=64)
    with torch.inference_mode():
        kv.reserve(1, 33)
        ours = torch.cat([kv.prefill([ids[:32]], 0), kv.decode([ids[32]], [32])]).log_softmax(-1)
        reference = model(torch.tensor([ids], device=device)).logits[0, 31:33].float().log_softmax(-1)
    rec.write(
        "check",
        what="engine prefill + decode vs HF forward, next-token log-probs",
        max_abs_logprob_diff=float((ours - reference).abs().max()),
        same_argmax=bool(torch.equal(ours.argmax(-1), reference.argmax(-1))),
    )


def measure_curve(model: LlamaForCausalLM, rec: Recorder, plan: Plan, device: torch.device, roof: Roofline) -> None:
    """The decode-step curve, then the prefill cost (the cache goes with the return; the caller frees it)."""
    kv = SlotKVModel(model, max_slots=max(plan.batch_sizes), max_model_len=max(plan.contexts) + 1)
    estimate = 1.0
    for ctx in plan.contexts:
        for n in plan.batch_sizes:
            if not rec.fits(estimate):
                rec.write("skipped", what=f"decode_step n={n} ctx={ctx}", reason="budget")
                continue
            started = time.perf_counter()
            seconds = decode_step_s(kv, device, n, ctx, plan)
            estimate = 2.0 * (time.perf_counter() - started) + 0.5
            roof_ms = roof.decode(n, ctx)
            rec.write(
                "decode_step",
                running=n,
                context=ctx,
                step_ms=1e3 * seconds,
                tokens_per_s=n / seconds,
                **roof_ms,
                measured_over_roofline=1e3 * seconds / roof_ms["roofline_ms"],
                repeats=plan.repeats,
            )
    generator = torch.Generator().manual_seed(1)
    for prompts, length in plan.prefill_shapes:
        if not rec.fits(estimate):
            rec.write("skipped", what=f"prefill {prompts}x{length}", reason="budget")
            continue
        kv.reserve(prompts, length)
        ids = torch.randint(0, kv.vocab_size, (prompts, length), generator=generator).tolist()
        with torch.inference_mode():
            seconds = statistics.median(timed(device, lambda i=ids: kv.prefill(i, 0), plan.warmup, plan.repeats))
        roof_ms = roof.prefill(prompts, length)
        rec.write(
            "prefill",
            prompts=prompts,
            prompt_tokens=length,
            step_ms=1e3 * seconds,
            ms_per_token=1e3 * seconds / (prompts * length),
            **roof_ms,
            measured_over_roofline=1e3 * seconds / roof_ms["roofline_ms"],
            repeats=plan.repeats,
        )


# ---------------------------------------------------------------------------------------------- rollout phase


@dataclass(frozen=True)
class ImposedLengths:
    """What ``EngineSegmentBackend`` asks of a workload: each sample's imposed length and the response cap.

    Lengths follow the simulator's workload (prompt difficulty shared across epochs), capped at the response length.
    """

    workload: Workload

    @property
    def response_length(self) -> int:
        return self.workload.response_length

    def target_length(self, key: str, index: int) -> int:
        return min(self.response_length, self.workload.length(prompt_of(key), key, index, 0))


def prompt_of(key: str) -> int:
    """The data-set index in a ``PromptCycle`` admission key ``p<index>@e<epoch>``."""
    return int(key[1:].split("@", 1)[0])


class TokenPromptCycle(PromptCycle):
    """``PromptCycle`` handing out token prompts: ``Prompt(key="p<index>", ids)``, the key being its identity."""

    def __init__(self, workload: Workload, vocab: int) -> None:
        super().__init__(workload)
        self.vocab = vocab

    def next_prompt(self) -> tuple[Prompt, str]:  # type: ignore[override]
        prompt, key = super().next_prompt()
        rng = np.random.default_rng([self.workload.seed, prompt])
        return Prompt(f"p{prompt}", rng.integers(0, self.vocab, self.workload.prompt_len).tolist()), key


def seed_history(estimator: LengthEstimator, workload: Workload, prompts: int) -> None:
    """One imposed earlier epoch: each prompt's mean capped answer length at admission key ``e-1``."""
    lengths = ImposedLengths(workload)
    for prompt in range(prompts):
        key = f"p{prompt}@e-1"
        estimator.history[f"p{prompt}"] = statistics.fmean(
            lengths.target_length(key, index) for index in range(workload.n)
        )


class ModeRun:
    """One mode's persistent pool, prompt stream and (``tail``) length batcher over the shared engine."""

    def __init__(self, name: str, config: PartialConfig, engine: CpuBatchedEngine, workload: Workload, vocab: int):
        self.name = name
        self.engine = engine
        self.estimator = length_estimator(config, identity=lambda prompt: prompt.key)
        self.pool: RolloutPool[Prompt] = RolloutPool(
            config,
            group_size=workload.n,
            batch_groups=workload.batch,
            response_length=workload.response_length,
            priority=self.estimator.priority if self.estimator else None,
            engine_slots=engine.max_num_seqs,  # one engine
        )
        self.backend = EngineSegmentBackend(engine, ImposedLengths(workload))  # type: ignore[arg-type]
        self.source = TokenPromptCycle(workload, vocab)
        self.batcher: LengthBatcher[Prompt] | None = None
        if self.estimator is not None:
            seed_history(self.estimator, workload, workload.prompts)
            self.batcher = LengthBatcher.for_config(config, self.source, workload.batch, self.estimator.prompt_history)

    async def step(self, step: int) -> dict[str, float]:
        """One rollout phase; returns its wall time, the pool's metrics and the engine's counters."""
        self.source.step = step
        if self.batcher is not None:
            self.batcher.begin_step(step)
        before = self.engine.stats
        start = time.perf_counter()
        result = await run_step(self.pool, self.backend, self.batcher or self.source, step=step, version=step)
        seconds = time.perf_counter() - start
        after = self.engine.stats
        if self.estimator is not None:
            self.estimator.record(result.trained)
        m = result.metrics
        return {
            "seconds": seconds,
            "trained": m["partial/tokens_trained"],
            "generated": after.generated_tokens - before.generated_tokens,
            "discarded": m["partial/tokens_discarded"],
            "staleness_max": m["partial/staleness/max"],
            "decode_steps": after.decode_steps - before.decode_steps,
            "decode_rows": after.decode_tokens - before.decode_tokens,
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        }


def summarize(steps: list[dict[str, float]], slots: int, full_step_s: float) -> dict[str, float]:
    seconds = sum(s["seconds"] for s in steps)
    trained = sum(s["trained"] for s in steps)
    decode_steps = sum(s["decode_steps"] for s in steps)
    return {
        "steps": len(steps),
        "rollout_s": seconds,
        "trained_tokens": trained,
        "generated_tokens": sum(s["generated"] for s in steps),
        "ms_per_trained_token": 1e3 * seconds / max(1.0, trained),
        "trained_tokens_per_s": trained / seconds,
        "slot_occupancy": trained / (slots * seconds / full_step_s),
        "engine_rows_per_slot": sum(s["decode_rows"] for s in steps) / max(1, slots * decode_steps),
        "staleness_max": max(s["staleness_max"] for s in steps),
        "discarded_tokens": sum(s["discarded"] for s in steps),
    }


async def measure_rollout(
    model: LlamaForCausalLM, rec: Recorder, plan: Plan, device: torch.device, in_flight: int
) -> None:
    """``plan.rollout_steps`` steps of each mode at ``in_flight`` requests per step, interleaved step by step."""
    batch = in_flight // plan.group_size
    workload = Workload(
        batch=batch,
        n=plan.group_size,
        p50=plan.p50,
        p99_over_p50=plan.p99_over_p50,
        response_length=plan.response_length,
        prompt_len=plan.prompt_len,
        prompts=batch * (plan.rollout_steps + 4),  # more than any mode draws: no prompt is seen twice
    )
    # The occupancy's yardstick: a full engine's step at the workload's mean running context.
    context = round(workload.mean_running_context())
    kv = SlotKVModel(model, max_slots=plan.max_num_seqs, max_model_len=context + 1)
    full_step_s = decode_step_s(kv, device, plan.max_num_seqs, context, plan)
    del kv
    rec.write("full_step", running=plan.max_num_seqs, context=context, step_ms=1e3 * full_step_s)
    engine = CpuBatchedEngine(
        model,
        eos_token_ids=set(),
        max_num_seqs=plan.max_num_seqs,
        max_model_len=plan.prompt_len + plan.response_length + 1,
        seed=0,
        device=device,
    )
    # Outside any timed step: the worker thread's start and the KV cache grown to every slot at the longest context
    # (one prefill of max_num_seqs maximal prompts), so no mode pays a cache growth the others do not.
    longest = SamplingParams(max_tokens=1, ignore_eos=True)
    await asyncio.gather(
        *(engine.generate(f"warmup{i}", [1] * (engine.max_model_len - 1), longest) for i in range(plan.max_num_seqs))
    )
    configs = mode_configs(batch)
    runs = [ModeRun(name, configs[name], engine, workload, plan.vocab) for name in MODES]
    records: dict[str, list[dict[str, float]]] = {run.name: [] for run in runs}
    shape = {"in_flight": in_flight, "batch_groups": batch, "group_size": plan.group_size}
    for step in range(plan.rollout_steps):
        for run in runs:
            done = records[run.name]
            estimate = 1.5 * max((r["seconds"] for recs in records.values() for r in recs), default=10.0)
            if len(done) < step or not rec.fits(estimate):
                rec.write("skipped", what=f"rollout {run.name} step {step}", reason="budget", **shape)
                continue
            record = await run.step(step)
            done.append(record)
            rec.write("rollout_step", mode=run.name, step=step, **shape, **record)
    await engine.close()
    for run in runs:
        # A mode is compared with sync over the same steps only (a step's length depends on the prompts it draws).
        common = min(len(records[run.name]), len(records["sync"]))
        if common == 0:
            continue
        row = summarize(records[run.name][:common], plan.max_num_seqs, full_step_s)
        base = summarize(records["sync"][:common], plan.max_num_seqs, full_step_s)
        rec.write(
            "rollout_mode",
            mode=run.name,
            **shape,
            **row,
            vs_sync_per_trained_token=base["ms_per_trained_token"] / row["ms_per_trained_token"],
            full_step_ms=1e3 * full_step_s,
            max_num_seqs=plan.max_num_seqs,
            workload=dataclasses.asdict(workload),
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- report


def table(path: Path) -> str:
    """Markdown tables of this run's lines (the last run in the file)."""
    head, lines = last_run(path)
    out = []
    if head:
        out.append(
            f"{LABEL}: {head['device_name']}, torch {head['torch']}, {head['model_params'] / 1e9:.2f} B params "
            f"{head['dtype']}, {head['date']}, commit {head['commit']}; roofline: {head['roofline_gpu']}\n"
        )
    out.append("| running | context | step ms | roofline ms | sim vLLM model ms | measured / roofline | tokens/s |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|")
    for line in lines:
        if line["kind"] == "decode_step":
            out.append(
                f"| {line['running']} | {line['context']} | {line['step_ms']:.2f} | {line['roofline_ms']:.3g} | "
                f"{line['sim_vllm_ms']:.3g} | {line['measured_over_roofline']:.1f}x | {line['tokens_per_s']:,.0f} |"
            )
    for line in lines:
        if line["kind"] == "prefill":
            out.append(
                f"\nprefill {line['prompts']} x {line['prompt_tokens']} tokens: {line['ms_per_token']:.4f} ms/token "
                f"(roofline {line['roofline_ms'] / (line['prompts'] * line['prompt_tokens']):.3g})"
            )
    out.append("\n| in flight | mode | steps | ms / trained token | trained tokens/s | slot occupancy | vs sync |")
    out.append("|---:|---|---:|---:|---:|---:|---:|")
    for line in lines:
        if line["kind"] == "rollout_mode":
            out.append(
                f"| {line['in_flight']} | {line['mode']} | {line['steps']} | {line['ms_per_trained_token']:.3f} | "
                f"{line['trained_tokens_per_s']:,.0f} | {line['slot_occupancy']:.2f} | "
                f"{line['vs_sync_per_trained_token']:.2f}x |"
            )
    return "\n".join(out)


def plot(results: Path, out: Path) -> None:
    """Every run of ``results``: decode step time by running requests beside the roofline and the simulator's vLLM
    model (left), and each mode's rollout ms per trained token by requests in flight, min-max over runs (right).
    Drawn here from the results file (needs the ``bench`` extra: matplotlib); the GPU machine has none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, modes) = plt.subplots(1, 2, figsize=(13, 4.2))
    found = runs(results)
    for number, (_, lines) in enumerate(found, 1):
        steps = [line for line in lines if line["kind"] == "decode_step"]
        for context in sorted({line["context"] for line in steps}):
            at = sorted(((line["running"], line) for line in steps if line["context"] == context), key=lambda a: a[0])
            curve.plot([n for n, _ in at], [line["step_ms"] for _, line in at], marker="o",
                       label=f"run {number}, context {context}")  # fmt: skip
            if number == len(found):  # the data sheet's curves are the same in every run
                for key, style in (("sim_vllm_ms", ":"), ("roofline_ms", "--")):
                    curve.plot([n for n, _ in at], [line[key] for _, line in at], style, color="gray",
                               label=f"{key.removesuffix('_ms').replace('_', ' ')}, context {context}")  # fmt: skip
    curve.set(yscale="log", xlabel="running requests", ylabel="decode step ms")
    curve.set_xscale("log", base=2)
    curve.legend(fontsize=7)
    rows = [line for _, lines in found for line in lines if line["kind"] == "rollout_mode"]
    flights = sorted({row["in_flight"] for row in rows})
    width = 0.8 / len(MODES)
    for offset, mode in enumerate(MODES):
        for x, in_flight in enumerate(flights):
            values = [r["ms_per_trained_token"] for r in rows if r["mode"] == mode and r["in_flight"] == in_flight]
            if values:
                mean = statistics.fmean(values)
                spread = [[mean - min(values)], [max(values) - mean]]
                modes.bar(x + offset * width, mean, width, color=f"C{offset}", label=mode if x == 0 else None)
                modes.errorbar(x + offset * width, mean, yerr=spread, color="black", capsize=3)
    modes.set_xticks(
        [x + width * (len(MODES) - 1) / 2 for x in range(len(flights))], [f"{n} in flight" for n in flights]
    )
    modes.set(ylabel="rollout ms / trained token")
    modes.legend(fontsize=8)
    head = found[-1][0]
    fig.suptitle(f"{LABEL}: {head['device_name']}, {head['model_params'] / 1e9:.1f}B {head['dtype']}, "
                 f"{len(found)} run(s), {head['date'][:10]}; bars: min-max over runs", fontsize=10)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="torch device; default cuda where available, else cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 on cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_engine_curve.jsonl")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting measurements after this long")
    parser.add_argument("--source-commit", help="the commit of the tree the launcher sent (recorded as the commit)")
    parser.add_argument("--smoke", action="store_true", help="tiny model and plan (a CPU check of every path)")
    parser.add_argument("--skip-rollout", action="store_true", help="the curve only")
    parser.add_argument("--in-flight", type=int, nargs="+", help="requests per rollout step (default 128 256)")
    parser.add_argument("--rollout-steps", type=int, help="steps per mode (default 4: one window of tail)")
    parser.add_argument("--response-length", type=int, help="answer length cap (default 512; p99 = 8 x p50)")
    parser.add_argument("--p50", type=float, help="median imposed answer length (default 64)")
    parser.add_argument("--plot", type=Path, help="draw every run of the results file here (PNG) after the run")
    parser.add_argument("--from-results", type=Path, help="a results file to report (and --plot); run nothing")
    args = parser.parse_args(argv)
    if args.from_results:
        print(table(args.from_results))
        if args.plot:
            plot(args.from_results, args.plot)
        return args.from_results
    started = time.perf_counter()
    plan = SMOKE if args.smoke else Plan()
    overrides = {
        "budget_s": args.budget_s,
        "in_flight": None if args.in_flight is None else tuple(args.in_flight),
        "rollout_steps": args.rollout_steps,
        "response_length": args.response_length,
        "p50": args.p50,
    }
    plan = dataclasses.replace(plan, **{key: value for key, value in overrides.items() if value is not None})
    if any(n % plan.group_size or n > plan.max_num_seqs for n in plan.in_flight):
        parser.error(f"--in-flight: multiples of the group size {plan.group_size}, at most {plan.max_num_seqs}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_model(plan, device, dtype)
    spec = model_spec(model, dtype)
    name = device_name(device)
    gpu = roofline_gpu(name)
    now = _dt.datetime.now(_dt.timezone.utc)
    common = {
        "label": LABEL,
        "run_id": f"{now:%Y%m%dT%H%M%SZ}-{os.getpid()}",
        "date": now.isoformat(timespec="seconds"),
        "commit": args.source_commit or git_commit(),
        "checkout_git": git_commit(),
        "command": " ".join(["python -m benchmarks.gpu_engine_curve", *(sys.argv[1:] if argv is None else argv)]),
        "device_name": name,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "model_params": sum(p.numel() for p in model.parameters()),
    }
    rec = Recorder(args.out, common, plan.budget_s, started)
    rec.write(
        "run",
        transformers=transformers.__version__,
        python=sys.version.split()[0],
        model_params_read_per_step=spec.params,
        model_shape=dataclasses.asdict(plan),
        roofline_gpu=gpu.name,
        roofline_source="verl_partial.sim.hardware data sheet; ServerSpec.step_seconds at 100 % and at Efficiency()",
        build_s=round(time.perf_counter() - started, 2),
        smoke=args.smoke,
    )
    check_against_hf(model, rec, device)
    measure_curve(model, rec, plan, device, Roofline.of(gpu, spec))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_rollout:
        for in_flight in plan.in_flight:
            if not rec.fits(20.0):
                rec.write("skipped", what=f"rollout in_flight={in_flight}", reason="budget")
                continue
            asyncio.run(measure_rollout(model, rec, plan, device, in_flight))
    rec.write("done", total_s=round(rec.elapsed(), 2))
    rec.close()
    print("\n" + table(args.out))
    if args.plot:
        plot(args.out, args.plot)
    return args.out


if __name__ == "__main__":
    main()
