"""Generated tokens/s of the CPU engine versus the number of concurrent requests; prints a markdown table.

Why: partial rollout pays off only if an engine's step cost grows sub-linearly with the batch (long-tail requests
then hold the batch small and waste throughput). This shows how much the continuous-batching CPU engine gains from
concurrency, for the demo's model size and a somewhat larger one, on one torch thread.

Each cell: ``n`` requests with random 32-token prompts submitted at once, ``ignore_eos`` so each yields exactly
``--max-tokens`` tokens (sampled at temperature 1), timed end to end (prefill included). Models and concurrency
levels are interleaved within a repeat and the best of ``--repeats`` is kept, so a noisy neighbour on a shared
machine hurts all cells alike rather than one.

    python -m benchmarks.bench_cpu_engine [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_partial.cpu_backend.engine import CpuBatchedEngine, SamplingParams

VOCAB = 512
PROMPT_LEN = 32
CONCURRENCY = (1, 8, 32, 64)
MODELS: dict[str, dict[str, int]] = {
    "demo (h64, 2 layers)": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
    "larger (h256, 4 layers)": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4),
}


@dataclass
class Cell:
    seconds: float
    tokens: int
    decode_steps: int
    decode_tokens: int
    kv_cache_bytes: int


def build_model(sizes: dict[str, int]) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attn_implementation="eager",
        **sizes,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


async def run_cell(model: Qwen2ForCausalLM, concurrency: int, max_tokens: int) -> Cell:
    engine = CpuBatchedEngine(model, eos_token_ids=set(), max_num_seqs=max(CONCURRENCY), seed=0)
    generator = torch.Generator().manual_seed(concurrency)
    prompts = [torch.randint(0, VOCAB, (PROMPT_LEN,), generator=generator).tolist() for _ in range(concurrency)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    await engine.generate("warmup", prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
    before = engine.stats
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    after = engine.stats
    cache_bytes = engine.kv_cache_bytes
    await engine.close()
    return Cell(
        seconds=seconds,
        tokens=sum(len(r.token_ids) for r in results),
        decode_steps=after.decode_steps - before.decode_steps,
        decode_tokens=after.decode_tokens - before.decode_tokens,
        kv_cache_bytes=cache_bytes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {name: build_model(sizes) for name, sizes in MODELS.items()}
    best: dict[tuple[str, int], Cell] = {}
    for _ in range(args.repeats):
        for name, model in models.items():
            for concurrency in CONCURRENCY:
                cell = asyncio.run(run_cell(model, concurrency, args.max_tokens))
                key = (name, concurrency)
                if key not in best or cell.seconds < best[key].seconds:
                    best[key] = cell

    print(
        f"CPU engine, torch {torch.__version__}, {torch.get_num_threads()} thread, Qwen2 vocab {VOCAB}, 4 heads / "
        f"2 KV heads, prompt {PROMPT_LEN} tokens, {args.max_tokens} new tokens per request, best of {args.repeats}\n"
    )
    print("| model | params | concurrent requests | tokens/s | speed-up vs 1 | ms / decode step | KV cache MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, model in models.items():
        params = sum(p.numel() for p in model.parameters())
        single = best[(name, 1)]
        for concurrency in CONCURRENCY:
            cell = best[(name, concurrency)]
            rate = cell.tokens / cell.seconds
            speedup = rate / (single.tokens / single.seconds)
            step_ms = 1e3 * cell.seconds / max(1, cell.decode_steps)
            print(
                f"| {name} | {params / 1e6:.2f} M | {concurrency} | {rate:,.0f} | {speedup:.1f}x | {step_ms:.2f} | "
                f"{cell.kv_cache_bytes / 2**20:.1f} |"
            )


if __name__ == "__main__":
    main()
