"""Tests for the continuous-batching CPU engine.

The reference for every log-prob is a plain recompute: one full forward of the same HF model over prompt + response,
no cache, no batching. Matching it for requests that were batched with padding, joined and left mid-flight and moved
between KV slots is what shows the engine's own forward and bookkeeping are right.

Tests about timing (arrivals, aborts, pauses) run the engine on the virtual clock with steps of ``STEP_S``
(``virtual_step_s``) and wait on the engine's own progress (``wait_until``), never on wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from verl_partial.cpu_backend.engine import CpuBatchedEngine, GenerationResult, SamplingParams, _StepPlan, sample
from verl_partial.cpu_backend.kv_model import UnsupportedModelError
from verl_partial.sim.clock import run_virtual

torch.set_num_threads(1)

VOCAB = 512
TOL = 1e-4
STEP_S = 0.001
T = TypeVar("T")


def _qwen2_config(**overrides: object) -> Qwen2Config:
    fields: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        # A wider init than the default 0.02 makes next-token distributions peaked, so greedy has no near-ties.
        initializer_range=0.2,
        attn_implementation="eager",
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


def _build(model_cls: type[torch.nn.Module], config: object, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return model_cls(config).eval()


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return _build(Qwen2ForCausalLM, _qwen2_config())


def _prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _run(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())


def _recompute_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits that predicted each generated token, from one uncached, unbatched forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1]


def _assert_matches_recompute(model: torch.nn.Module, prompt: list[int], result: GenerationResult) -> None:
    assert len(result.log_probs) == len(result.token_ids)
    log_probs = torch.log_softmax(_recompute_logits(model, prompt, result.token_ids), dim=-1)
    expected = log_probs.gather(1, torch.tensor(result.token_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(result.log_probs), expected, atol=TOL, rtol=0)


def _record_decode_batches(engine: CpuBatchedEngine) -> list[int]:
    """Wrap the engine's batched decode forward to record the batch size of every call."""
    sizes: list[int] = []
    decode = engine._kv.decode

    def recording(token_ids: list[int], positions: list[int]) -> torch.Tensor:
        sizes.append(len(token_ids))
        return decode(token_ids, positions)

    engine._kv.decode = recording  # type: ignore[method-assign]
    return sizes


def _record_prefill_batches(engine: CpuBatchedEngine) -> list[list[int]]:
    """Wrap the engine's prefill forward to record the prompt lengths of every call."""
    batches: list[list[int]] = []
    prefill = engine._kv.prefill

    def recording(prompts: list[list[int]], first_slot: int) -> torch.Tensor:
        batches.append([len(p) for p in prompts])
        return prefill(prompts, first_slot)

    engine._kv.prefill = recording  # type: ignore[method-assign]
    return batches


def _virtual(make: Callable[[], Awaitable[T]]) -> T:
    return run_virtual(make())


def test_concurrent_logprobs_match_plain_recompute(model: Qwen2ForCausalLM) -> None:
    prompts = _prompts(3, 17, 9, 30, 1)

    async def main() -> tuple[list[GenerationResult], list[int]]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), seed=0)
        batches = _record_decode_batches(engine)
        params = SamplingParams(max_tokens=24, temperature=1.0)
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        await engine.close()
        return results, batches

    results, batches = _run(main)
    # One forward per step for all five (prefilled together, then decoded together with padding).
    assert batches == [5] * 23
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == 24 and result.stop_reason == "length"
        _assert_matches_recompute(model, prompt, result)


def test_qwen3_matches_recompute() -> None:
    qwen3 = _build(
        Qwen3ForCausalLM,
        Qwen3Config(**{**_qwen2_config().to_dict(), "model_type": "qwen3", "head_dim": 32, "layer_types": None}),
    )
    prompts = _prompts(4, 11)

    async def main() -> list[GenerationResult]:
        engine = CpuBatchedEngine(qwen3, eos_token_ids=set(), seed=0)
        params = SamplingParams(max_tokens=12)
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        await engine.close()
        return results

    for prompt, result in zip(prompts, _run(main), strict=True):
        _assert_matches_recompute(qwen3, prompt, result)


def test_requests_join_and_leave_without_draining(model: Qwen2ForCausalLM) -> None:
    """max_num_seqs=3 with staggered arrivals and lengths: finished requests leave, waiting ones join mid-batch,
    surviving requests are moved into freed slots, and every result still matches the recompute."""
    prompts = _prompts(5, 22, 2, 13, 8, 40, 3)
    max_tokens = [6, 30, 12, 4, 25, 9, 15]

    async def main() -> tuple[list[GenerationResult], list[int], int, list[str]]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), max_num_seqs=3, seed=0, virtual_step_s=STEP_S)
        batches = _record_decode_batches(engine)
        moves = 0
        move_slot = engine._kv.move_slot

        def counting_move(src: int, dst: int, length: int) -> None:
            nonlocal moves
            moves += 1
            move_slot(src, dst, length)

        engine._kv.move_slot = counting_move  # type: ignore[method-assign]
        finish_order: list[str] = []

        async def one(index: int) -> GenerationResult:
            await asyncio.sleep(0.003 * index)
            result = await engine.generate(f"r{index}", prompts[index], SamplingParams(max_tokens=max_tokens[index]))
            finish_order.append(f"r{index}")
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        await engine.close()
        return results, batches, moves, finish_order

    results, batches, moves, finish_order = _virtual(main)
    assert max(batches) == 3
    assert moves > 0
    # r1 (30 tokens) was still running when later, shorter requests joined and finished.
    assert finish_order.index("r3") < finish_order.index("r1")
    for prompt, limit, result in zip(prompts, max_tokens, results, strict=True):
        assert len(result.token_ids) == limit
        _assert_matches_recompute(model, prompt, result)


def test_prefill_budget_splits_a_burst_of_prompts(model: Qwen2ForCausalLM) -> None:
    prompts = _prompts(10, 10, 10)

    async def main() -> tuple[list[GenerationResult], list[int]]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), max_num_batched_tokens=20)
        batches = _record_prefill_batches(engine)
        params = SamplingParams(max_tokens=6)
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        await engine.close()
        return results, [len(batch) for batch in batches]

    results, widths = _run(main)
    assert widths == [2, 1]  # 2 x 10 padded tokens fit the budget of 20, the third prompt waits one step
    for prompt, result in zip(prompts, results, strict=True):
        _assert_matches_recompute(model, prompt, result)


def test_prefill_groups_long_and_short_prompts_apart(model: Qwen2ForCausalLM) -> None:
    """Resumed samples (long prompt + prefix) do not pad fresh short prompts up to their length."""
    prompts = _prompts(400, 10, 12, 420)

    async def main() -> tuple[list[GenerationResult], list[list[int]]]:
        engine = CpuBatchedEngine(model, eos_token_ids=set())
        batches = _record_prefill_batches(engine)
        params = SamplingParams(max_tokens=4)
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        await engine.close()
        return results, batches

    results, batches = _run(main)
    assert [sorted(batch) for batch in batches] == [[400, 420], [10, 12]]
    for prompt, result in zip(prompts, results, strict=True):
        _assert_matches_recompute(model, prompt, result)


def test_resume_from_partial_response_continues_greedy_output(model: Qwen2ForCausalLM) -> None:
    prompt = _prompts(10)[0]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)

    async def main() -> tuple[GenerationResult, GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set())
        full = await engine.generate("full", prompt, greedy)
        resumed = await engine.generate("resumed", prompt + full.token_ids[:8], SamplingParams(12, temperature=0.0))
        await engine.close()
        return full, resumed

    full, resumed = _run(main)
    assert resumed.token_ids == full.token_ids[8:]
    torch.testing.assert_close(torch.tensor(resumed.log_probs), torch.tensor(full.log_probs[8:]), atol=TOL, rtol=0)
    # Greedy really is the argmax of the model.
    assert full.token_ids == _recompute_logits(model, prompt, full.token_ids).argmax(-1).tolist()


def test_seeded_request_is_independent_of_batch(model: Qwen2ForCausalLM) -> None:
    prompt, *others = _prompts(7, 3, 25, 12, 5)
    seeded = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, top_k=50, seed=1234)

    async def main() -> tuple[GenerationResult, GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), seed=7)
        alone = await engine.generate("alone", prompt, seeded)
        noise = [engine.generate(f"o{i}", p, SamplingParams(max_tokens=40 - 5 * i)) for i, p in enumerate(others)]
        crowded, *_ = await asyncio.gather(engine.generate("crowded", prompt, seeded), *noise)
        await engine.close()
        return alone, crowded

    alone, crowded = _run(main)
    assert alone.token_ids == crowded.token_ids
    torch.testing.assert_close(torch.tensor(alone.log_probs), torch.tensor(crowded.log_probs), atol=TOL, rtol=0)


def test_processed_and_raw_logprob_modes(model: Qwen2ForCausalLM) -> None:
    prompt = _prompts(9)[0]
    params = SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.8, seed=3)

    async def main(mode: str) -> GenerationResult:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), logprobs_mode=mode)  # type: ignore[arg-type]
        result = await engine.generate("r", prompt, params)
        await engine.close()
        return result

    processed, raw = _run(lambda: main("processed_logprobs")), _run(lambda: main("raw_logprobs"))
    assert processed.token_ids == raw.token_ids  # the mode changes what is reported, not what is sampled
    logits = _recompute_logits(model, prompt, processed.token_ids)
    tokens = torch.tensor(processed.token_ids).unsqueeze(1)
    # processed: the distribution sampled from (temperature, then top-k, then top-p of the top-k mass).
    scaled = logits / params.temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    keep = torch.arange(VOCAB) < params.top_k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & ((sorted_probs.cumsum(-1) - sorted_probs) < params.top_p)
    truncated = scaled.scatter(-1, order, sorted_logits.masked_fill(~keep, float("-inf")))
    expected = torch.log_softmax(truncated, dim=-1).gather(1, tokens).squeeze(1)
    torch.testing.assert_close(torch.tensor(processed.log_probs), expected, atol=TOL, rtol=0)
    assert torch.isfinite(expected).all()  # every sampled token lies inside the truncated support
    torch.testing.assert_close(
        torch.tensor(raw.log_probs), torch.log_softmax(logits, -1).gather(1, tokens).squeeze(1), atol=TOL, rtol=0
    )


def test_eos_stops_unless_ignored_and_max_model_len_caps(model: Qwen2ForCausalLM) -> None:
    prompt = _prompts(6)[0]

    async def main() -> tuple[GenerationResult, ...]:
        engine = CpuBatchedEngine(model, eos_token_ids=set())
        reference = await engine.generate("ref", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        await engine.close()
        eos = next(t for i, t in enumerate(reference.token_ids) if i >= 3 and t not in reference.token_ids[:i])
        engine = CpuBatchedEngine(model, eos_token_ids={eos}, max_model_len=len(prompt) + 5)
        stopped = await engine.generate("eos", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        capped = await engine.generate("cap", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        with pytest.raises(ValueError, match="prompt length"):
            await engine.generate("long", prompt * 2, SamplingParams(max_tokens=1))
        await engine.close()
        return reference, stopped, capped

    reference, stopped, capped = _run(main)
    cut = len(stopped.token_ids)
    assert stopped.stop_reason == "completed" and 3 < cut <= 5
    assert stopped.token_ids == reference.token_ids[:cut]  # EOS is included, as vLLM does
    assert capped.stop_reason == "length" and capped.token_ids == reference.token_ids[:5]


def test_abort_returns_partial_tokens_at_once(model: Qwen2ForCausalLM) -> None:
    """vLLM semantics: an abort resolves the request's generate with its tokens so far before any further step."""
    long_prompt = _prompts(12)[0]
    short_prompt = long_prompt[:4]

    async def main() -> tuple[GenerationResult, GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), virtual_step_s=STEP_S)
        task = asyncio.create_task(engine.generate("long", long_prompt, SamplingParams(900, ignore_eos=True, seed=5)))
        other = asyncio.create_task(engine.generate("other", short_prompt, SamplingParams(max_tokens=600)))
        await engine.wait_until(lambda: engine.stats.generated_tokens >= 20)
        steps = engine.stats.decode_steps
        assert await engine.abort("long")
        assert not await engine.abort("unknown-id")
        aborted = await task
        assert engine.stats.decode_steps == steps and not other.done()
        await engine.wait_until(lambda: engine.num_running == 1)  # the aborted request left the batch
        await engine.abort("other")
        other_result = await other
        await engine.close()
        return aborted, other_result

    aborted, other = _virtual(main)
    for prompt, result in ((long_prompt, aborted), (short_prompt, other)):
        assert result.stop_reason == "aborted"
        assert 0 < len(result.token_ids) < 600
        _assert_matches_recompute(model, prompt, result)


def test_abort_all_covers_waiting_requests_and_engine_stays_usable(model: Qwen2ForCausalLM) -> None:
    prompts = _prompts(5, 6, 7)

    async def main() -> tuple[int, list[GenerationResult], GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), max_num_seqs=1, virtual_step_s=STEP_S)
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(f"r{i}", p, params)) for i, p in enumerate(prompts)]
        await engine.wait_until(lambda: engine.stats.generated_tokens >= 3)
        assert (engine.num_running, engine.num_waiting) == (1, 2)
        assert not any(task.done() for task in tasks[1:])  # queued requests produce nothing
        count = await engine.abort_all()
        results = await asyncio.gather(*tasks)
        assert engine.num_waiting == 0
        after = await engine.generate("after", prompts[0], SamplingParams(max_tokens=5))
        await engine.close()
        return count, results, after

    count, results, after = _virtual(main)
    assert count == 3
    assert all(r.stop_reason == "aborted" for r in results)
    assert len(results[0].token_ids) > 0 and results[1].token_ids == results[2].token_ids == []
    assert after.stop_reason == "length" and len(after.token_ids) == 5


def test_cancelled_generate_returns_nothing_and_frees_its_slot(model: Qwen2ForCausalLM) -> None:
    """vLLM's AsyncLLM.generate aborts a request whose caller is cancelled: the caller gets no tokens, the engine
    stops decoding it at once and its slot serves the next request."""

    async def main() -> GenerationResult:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), max_num_seqs=1, virtual_step_s=STEP_S)
        task = asyncio.create_task(engine.generate("r", _prompts(5)[0], SamplingParams(max_tokens=500)))
        await engine.wait_until(lambda: engine.stats.generated_tokens >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.is_idle
        stopped_at = engine.stats.generated_tokens
        result = await engine.generate("next", _prompts(3)[0], SamplingParams(4))
        assert engine.stats.generated_tokens == stopped_at + 4
        await engine.close()
        return result

    assert len(_virtual(main).token_ids) == 4


def test_pause_holds_requests_until_resume(model: Qwen2ForCausalLM) -> None:
    async def main() -> tuple[GenerationResult, GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), virtual_step_s=STEP_S)
        running = asyncio.create_task(engine.generate("running", _prompts(4)[0], SamplingParams(max_tokens=300)))
        await engine.wait_until(lambda: engine.stats.generated_tokens >= 2)
        engine.pause()
        queued = asyncio.create_task(engine.generate("queued", _prompts(6)[0], SamplingParams(max_tokens=5)))
        await asyncio.sleep(10 * STEP_S)  # the step in flight ends
        frozen = engine.stats.generated_tokens
        await asyncio.sleep(100 * STEP_S)
        assert engine.stats.generated_tokens == frozen
        assert (engine.num_running, engine.num_waiting) == (1, 1) and not queued.done()
        engine.resume()
        results = await asyncio.gather(running, queued)
        await engine.close()
        return results[0], results[1]

    running, queued = _virtual(main)
    assert len(running.token_ids) == 300 and running.stop_reason == "length"
    assert len(queued.token_ids) == 5


def test_load_weights_changes_generation_and_restores(model: Qwen2ForCausalLM) -> None:
    own = copy.deepcopy(model)  # the engine updates the module in place
    original = {name: t.clone() for name, t in own.state_dict().items()}  # includes the tied lm_head.weight alias
    generator = torch.Generator().manual_seed(9)
    # bfloat16, as a trainer would send: the engine converts to the model's dtype.
    perturbed = [
        (name, (p + 0.1 * torch.randn(p.shape, generator=generator)).to(torch.bfloat16))
        for name, p in own.named_parameters()
    ]
    prompt = _prompts(8)[0]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)

    async def main() -> tuple[GenerationResult, GenerationResult, GenerationResult]:
        engine = CpuBatchedEngine(own, eos_token_ids=set())
        before = await engine.generate("a", prompt, greedy)
        engine.load_weights(perturbed)
        during = await engine.generate("b", prompt, greedy)
        _assert_matches_recompute(own, prompt, during)  # own now holds the perturbed weights
        engine.load_weights(original.items())
        after = await engine.generate("c", prompt, greedy)
        with pytest.raises(KeyError):
            engine.load_weights([("no.such.weight", torch.zeros(1))])
        with pytest.raises(ValueError, match="shape"):
            engine.load_weights([("lm_head.weight", torch.zeros(1))])
        await engine.close()
        return before, during, after

    before, during, after = _run(main)
    assert during.token_ids != before.token_ids
    assert after.token_ids == before.token_ids
    assert after.log_probs == before.log_probs


def test_unsupported_architectures_fail_loudly() -> None:
    gpt2 = _build(GPT2LMHeadModel, GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="model_type"):
        CpuBatchedEngine(gpt2, eos_token_ids=set())
    sliding = _build(Qwen2ForCausalLM, _qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(UnsupportedModelError, match="attention"):
        CpuBatchedEngine(sliding, eos_token_ids=set())


def test_sampling_params_validation(model: Qwen2ForCausalLM) -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):  # vLLM refuses 0; SGLang allows it
        _run(lambda: CpuBatchedEngine(model, eos_token_ids=set()).generate("z", [1, 2], SamplingParams(max_tokens=0)))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, temperature=-1.0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.sampled_from([-1, 1, 3, 32]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]),
)
def test_sample_picks_inside_support_with_renormalised_logprob(
    seed: int, temperature: float, top_k: int, top_p: float
) -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed)) * 4
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    # Same seed on every row: a seeded row's draw must not depend on the other rows.
    same_logits = logits[:1].expand(3, -1)
    samplers = [(params, torch.Generator().manual_seed(seed)) for _ in range(3)]
    tokens, log_probs = sample(same_logits, samplers, torch.Generator().manual_seed(0), "processed_logprobs")
    assert len(set(tokens)) == 1 and len(set(log_probs)) == 1
    token, log_prob = tokens[0], log_probs[0]
    row = logits[0]
    if temperature == 0:
        assert token == int(row.argmax())
        assert log_prob == pytest.approx(float(torch.log_softmax(row, -1)[token]), abs=1e-6)
        return
    tempered = torch.log_softmax(row / temperature, -1)
    # Truncation only removes mass, so the renormalised log-prob is never below the untruncated one.
    assert float(tempered[token]) - 1e-5 <= log_prob <= 1e-6
    if top_k == -1 and top_p == 1.0:
        assert log_prob == pytest.approx(float(tempered[token]), abs=1e-5)
    higher = row > row[token]
    if top_k > 0:
        assert int(higher.sum()) < top_k
    kept = row >= row.sort(descending=True).values[top_k - 1] if top_k > 0 else torch.ones_like(higher)
    probs_in_k = torch.softmax((row / temperature).masked_fill(~kept, float("-inf")), -1)
    assert float(probs_in_k[higher].sum()) < top_p + 1e-6


# ------------------------------------------------------------------ SGLang semantics (SGLang 0.5.12)


def _first_new_token_at(tokens: list[int], position: int) -> int:
    """A token at ``position`` that appears nowhere before it, to serve as the EOS id of a greedy replay."""
    return next(t for i, t in enumerate(tokens) if i >= position and t not in tokens[:i])


def test_finish_check_order_of_each_semantics(model: Qwen2ForCausalLM) -> None:
    """Req.check_finished (SGLang) tests max_new_tokens before EOS: an EOS that is the last allowed token ends as
    "length"; vLLM's check_stop says EOS ("completed"). A length finish never exceeds max_tokens on either."""
    prompt = _prompts(6)[0]
    greedy = dict(temperature=0.0)

    async def main() -> dict[str, GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), virtual_step_s=STEP_S)
        reference = await engine.generate("ref", prompt, SamplingParams(max_tokens=12, **greedy))
        eos = _first_new_token_at(reference.token_ids, 3)
        cut = reference.token_ids.index(eos) + 1
        out = {}
        for semantics in ("vllm", "sglang"):
            engine = CpuBatchedEngine(model, eos_token_ids={eos}, semantics=semantics, virtual_step_s=STEP_S)
            out[semantics] = await engine.generate("eos-last", prompt, SamplingParams(max_tokens=cut, **greedy))
            out[f"{semantics}-room"] = await engine.generate("eos", prompt, SamplingParams(max_tokens=12, **greedy))
            await engine.close()
        out["ref"] = reference
        return out

    out = _virtual(main)
    assert out["vllm"].token_ids == out["sglang"].token_ids == out["vllm-room"].token_ids
    assert (out["vllm"].stop_reason, out["sglang"].stop_reason) == ("completed", "length")
    assert out["vllm-room"].stop_reason == out["sglang-room"].stop_reason == "completed"


def test_sglang_abort_decodes_one_more_token_and_reports_abort_even_for_eos(model: Qwen2ForCausalLM) -> None:
    """Scheduler.abort_request sets to_finish on a running request; its next token is still decoded, and
    check_finished reports "abort" before looking at EOS. vLLM: the abort ends it at once, token in flight dropped.
    A queued request leaves with no tokens on both."""
    prompt = _prompts(6)[0]
    greedy = dict(temperature=0.0)

    async def main() -> dict[str, tuple[int, GenerationResult, GenerationResult]]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), virtual_step_s=STEP_S)
        reference = await engine.generate("ref", prompt, SamplingParams(max_tokens=12, **greedy))
        eos = _first_new_token_at(reference.token_ids, 3)
        before_eos = reference.token_ids.index(eos)
        out = {}
        for semantics in ("vllm", "sglang"):
            engine = CpuBatchedEngine(
                model, eos_token_ids={eos}, max_num_seqs=1, semantics=semantics, virtual_step_s=STEP_S
            )
            running = asyncio.create_task(engine.generate("r", prompt, SamplingParams(max_tokens=12, **greedy)))
            queued = asyncio.create_task(engine.generate("q", prompt, SamplingParams(max_tokens=12, **greedy)))
            await engine.wait_until(lambda e=engine: e.tokens_so_far("r") == before_eos)  # EOS is the next token
            await engine.abort_all()
            out[semantics] = (before_eos, await running, await queued)
            await engine.close()
        return out

    out = _virtual(main)
    seen, vllm_running, vllm_queued = out["vllm"]
    _, sglang_running, sglang_queued = out["sglang"]
    assert (vllm_running.stop_reason, len(vllm_running.token_ids)) == ("aborted", seen)
    assert (sglang_running.stop_reason, len(sglang_running.token_ids)) == ("aborted", seen + 1)
    assert sglang_running.token_ids[-1] != vllm_running.token_ids[-1]  # the extra token is the EOS, said "abort"
    assert len(sglang_running.log_probs) == seen + 1
    assert vllm_queued.token_ids == sglang_queued.token_ids == []


def test_sglang_max_tokens_zero_answers_no_tokens_with_length(model: Qwen2ForCausalLM) -> None:
    """SGLang's max_new_tokens=0: the prefill's token is cut by finished_len = 0, the finish is "length"."""

    async def main() -> GenerationResult:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), semantics="sglang", virtual_step_s=STEP_S)
        result = await engine.generate("z", _prompts(4)[0], SamplingParams(max_tokens=0))
        await engine.close()
        return result

    result = _virtual(main)
    assert (result.token_ids, result.log_probs, result.stop_reason) == ([], [], "length")


def test_unknown_semantics_is_refused_by_name(model: Qwen2ForCausalLM) -> None:
    with pytest.raises(ValueError, match="semantics must be one of"):
        CpuBatchedEngine(model, eos_token_ids=set(), semantics="trtllm")  # type: ignore[arg-type]


def test_device_cpu_is_the_default_engine(model: Qwen2ForCausalLM) -> None:
    """``device="cpu"`` (as a string or a torch.device) is the engine as it was: same tokens, same log-probs."""
    prompts = _prompts(5, 12, 3)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9)

    async def main(**device: object) -> list[GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), seed=0, **device)
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        await engine.close()
        return results

    default = _run(main)
    for device in ("cpu", torch.device("cpu")):
        assert _run(lambda d=device: main(device=d)) == default
    assert [(len(r.token_ids), r.stop_reason) for r in default] == [(10, "length")] * len(prompts)


def test_dtype_casts_the_model_and_its_cache_in_place() -> None:
    """``dtype=`` casts the caller's module in place (the engine serves that very module) and the KV cache follows;
    the batched forward still matches a plain recompute of the cast model."""
    model = _build(Qwen2ForCausalLM, _qwen2_config())
    prompt = _prompts(9)[0]

    async def main() -> tuple[GenerationResult, CpuBatchedEngine]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), seed=0, dtype=torch.float64)
        result = await engine.generate("r", prompt, SamplingParams(max_tokens=8, temperature=1.0))
        await engine.close()
        return result, engine

    result, engine = _run(main)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert engine.device == torch.device("cpu")
    assert engine.kv_cache_bytes > 0 and engine._kv._keys[0].dtype == torch.float64
    _assert_matches_recompute(model, prompt, result)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"device": "not-a-device"}, "device"), ({"dtype": torch.int64}, "dtype"), ({"dtype": "bfloat16"}, "dtype")],
)
def test_bad_device_or_dtype_is_refused_by_name(model: Qwen2ForCausalLM, kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key} must be"):
        CpuBatchedEngine(model, eos_token_ids=set(), **kwargs)


def test_every_tensor_of_a_step_is_made_on_the_models_device(model: Qwen2ForCausalLM) -> None:
    """What a GPU run needs, checked without a GPU: with ``meta`` as torch's default device, a tensor the engine made
    without naming its device would land on ``meta`` and meet the model's CPU tensors (an error) or hold no data
    (an error when read). Prefill, decode over several length buckets, top-k / top-p, greedy and seeded rows."""
    prompts = _prompts(3, 40, 150)
    params = [
        SamplingParams(max_tokens=6, temperature=1.0, top_k=20, top_p=0.9),
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=6, seed=3),
    ]

    async def main() -> list[GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), seed=0, virtual_step_s=STEP_S)  # steps on this thread
        results = await asyncio.gather(
            *(engine.generate(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params, strict=True)))
        )
        await engine.close()
        return results

    with torch.device("meta"):
        results = _virtual(main)
    assert [len(r.token_ids) for r in results] == [6, 6, 6]
    _assert_matches_recompute(model, prompts[1], results[1])


# ------------------------------------------------------------------ KV-cache capacity (vLLM's recompute preemption)


def _record_plans(engine: CpuBatchedEngine) -> list[tuple[int, _StepPlan]]:
    """Wrap the engine's step to record every plan it runs, with the preemptions counted once it was planned."""
    plans: list[tuple[int, _StepPlan]] = []
    execute = engine._execute

    def recording(plan: _StepPlan) -> tuple[list[int], list[float]]:
        plans.append((engine.stats.preemptions, plan))
        return execute(plan)

    engine._execute = recording  # type: ignore[method-assign]
    return plans


def _kv_held(plan: _StepPlan) -> int:
    """Positions the step leaves in the KV cache: each decode row's history plus the token it feeds, and every
    prefilled sequence."""
    return plan.decode_context + sum(len(p) for p in plan.prefill_prompts)


def _record_prefill_sequences(engine: CpuBatchedEngine) -> list[list[int]]:
    """Wrap the engine's prefill forward to record every sequence it prefills."""
    sequences: list[list[int]] = []
    prefill = engine._kv.prefill

    def recording(prompts: list[list[int]], first_slot: int) -> torch.Tensor:
        sequences.extend(list(p) for p in prompts)
        return prefill(prompts, first_slot)

    engine._kv.prefill = recording  # type: ignore[method-assign]
    return sequences


def test_preemption_recomputes_greedy_output_exactly(model: Qwen2ForCausalLM) -> None:
    """Four greedy requests outgrow a cache of 90 tokens: the newest are preempted and re-prefilled (prompt and
    every token they had) and still produce the tokens, and the log-probs, of an engine with no limit. A capacity
    that never binds changes nothing at all."""
    prompts = _prompts(5, 9, 7, 12)
    capacity = 90

    async def main(kv_capacity_tokens: int | None) -> tuple[list[GenerationResult], CpuBatchedEngine, list[list[int]]]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), seed=0, kv_capacity_tokens=kv_capacity_tokens)
        prefills = _record_prefill_sequences(engine)
        params = SamplingParams(max_tokens=30, temperature=0.0)
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        await engine.close()
        return results, engine, prefills

    unlimited, free_engine, _ = _run(lambda: main(None))
    limited, engine, prefills = _run(lambda: main(capacity))
    assert free_engine.stats.preemptions == 0 and engine.stats.preemptions > 0
    assert free_engine.stats.prefill_tokens == sum(map(len, prompts))
    assert engine.stats.prefill_tokens > free_engine.stats.prefill_tokens  # the re-prefills
    # A readmitted request's prefill is its prompt followed by every token it had generated.
    resumed = [s for s in prefills if not any(s == p for p in prompts)]
    assert resumed
    for sequence in resumed:
        assert any(sequence == p + r.token_ids[: len(sequence) - len(p)] for p, r in zip(prompts, limited, strict=True))
    for free, bound in zip(unlimited, limited, strict=True):
        assert (bound.token_ids, bound.stop_reason) == (free.token_ids, free.stop_reason) and len(free.token_ids) == 30
        torch.testing.assert_close(torch.tensor(bound.log_probs), torch.tensor(free.log_probs), atol=1e-5, rtol=0)
    roomy, roomy_engine, _ = _run(lambda: main(10**9))
    untimed = {"step_s": 0.0, "idle_s": 0.0}  # real seconds differ between any two runs
    assert roomy == unlimited
    assert dataclasses.replace(roomy_engine.stats, **untimed) == dataclasses.replace(free_engine.stats, **untimed)


def test_admission_waits_for_kv_room(model: Qwen2ForCausalLM) -> None:
    """A cache of 32 tokens holds the first request (prompt 10, up to 30 tokens of context) but not a 25-token prompt
    beside it: the second waits, with no token, until the first ends, then runs. Waiting is not a preemption."""
    first, second = _prompts(10, 25)

    async def main() -> tuple[GenerationResult, GenerationResult, CpuBatchedEngine]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), kv_capacity_tokens=32, virtual_step_s=STEP_S)
        a = asyncio.create_task(engine.generate("a", first, SamplingParams(max_tokens=20)))
        await engine.wait_until(lambda: engine.tokens_so_far("a") >= 2)
        b = asyncio.create_task(engine.generate("b", second, SamplingParams(max_tokens=5)))
        await engine.wait_until(lambda: engine.tokens_so_far("a") >= 15)
        assert (engine.num_running, engine.num_waiting, engine.tokens_so_far("b")) == (1, 1, 0)
        result_a = await a
        assert not b.done()
        result_b = await b
        await engine.close()
        return result_a, result_b, engine

    result_a, result_b, engine = _virtual(main)
    assert len(result_a.token_ids) == 20 and len(result_b.token_ids) == 5
    assert engine.stats.preemptions == 0
    _assert_matches_recompute(model, second, result_b)


def test_the_newest_admitted_is_preempted_whatever_its_slot(model: Qwen2ForCausalLM) -> None:
    """r0..r3 join together; r1 ends early and r3 moves into r1's slot, so the slots read r0, r3, r2. When the cache
    of 50 tokens runs out, r3 (the newest admitted) is preempted, not r2 (the last slot): r3 stops while r2 goes on.
    Everyone still completes."""
    prompts = _prompts(5, 6, 7, 8)
    max_tokens = [30, 2, 30, 30]

    async def main() -> list[GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), kv_capacity_tokens=50, virtual_step_s=STEP_S)
        tasks = [
            asyncio.create_task(engine.generate(f"r{i}", p, SamplingParams(n)))
            for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        await engine.wait_until(lambda: engine.stats.preemptions == 1)
        held, running = engine.tokens_so_far("r3"), engine.tokens_so_far("r2")
        await engine.wait_until(lambda: engine.tokens_so_far("r2") >= running + 3)
        assert engine.tokens_so_far("r3") == held and engine.stats.preemptions == 1
        results = await asyncio.gather(*tasks)
        await engine.close()
        return results

    assert [len(r.token_ids) for r in _virtual(main)] == max_tokens


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_aborting_a_preempted_request_returns_its_tokens(model: Qwen2ForCausalLM, semantics: str) -> None:
    """Two requests outgrow a cache of 40 tokens: the newest is preempted to the front of the queue, keeping its
    tokens (``tokens_so_far`` still counts them), so a request queued before it stays behind it though it would fit.
    Aborted there, the preempted one answers its tokens as "aborted" on both semantics (it is queued, not running);
    the others run to their end."""
    first, second, third = _prompts(10, 10, 12)

    async def main() -> tuple[GenerationResult, GenerationResult, int]:
        engine = CpuBatchedEngine(
            model,
            eos_token_ids=set(),
            kv_capacity_tokens=40,
            semantics=semantics,  # type: ignore[arg-type]
            virtual_step_s=STEP_S,
        )
        a = asyncio.create_task(engine.generate("a", first, SamplingParams(max_tokens=25, ignore_eos=True)))
        b = asyncio.create_task(engine.generate("b", second, SamplingParams(max_tokens=25, ignore_eos=True)))
        await engine.wait_until(lambda: engine.tokens_so_far("a") >= 4)
        c = asyncio.create_task(engine.generate("c", third, SamplingParams(max_tokens=5)))  # no room beside a and b
        await engine.wait_until(lambda: engine.stats.preemptions >= 1)
        assert (engine.num_running, engine.num_waiting) == (1, 2) and not b.done()
        held, running = engine.tokens_so_far("b"), engine.tokens_so_far("a")
        await engine.wait_until(lambda: engine.tokens_so_far("a") >= running + 3)
        assert engine.tokens_so_far("b") == held  # b, the newer, is the one waiting
        assert engine.tokens_so_far("c") == 0  # c would fit beside a now, but b is ahead of it
        assert await engine.abort("b")
        aborted = await b
        result_a = await a
        assert len((await c).token_ids) == 5
        await engine.close()
        return aborted, result_a, held

    aborted, result_a, held = _virtual(main)
    assert aborted.stop_reason == "aborted" and len(aborted.token_ids) == held > 0
    _assert_matches_recompute(model, second, aborted)
    assert len(result_a.token_ids) == 25 and result_a.stop_reason == "length"


@pytest.mark.parametrize("semantics", ["vllm", "sglang"])
def test_kv_capacity_is_never_exceeded(model: Qwen2ForCausalLM, semantics: str) -> None:
    """Eight sampled requests of mixed lengths arriving over time against a cache of 120 tokens: no step holds more
    than the capacity, the limit binds (preemptions, steps near it), a step that preempts admits no one (vLLM's
    scheduler), and every answer is complete and matches a plain recompute, re-prefilled or not."""
    lengths = [6, 30, 3, 14, 9, 22, 4, 11]
    prompts = _prompts(*lengths)
    max_tokens = [20, 25, 40, 12, 30, 15, 35, 18]
    capacity = 120

    async def main() -> tuple[list[GenerationResult], list[tuple[int, _StepPlan]], CpuBatchedEngine]:
        engine = CpuBatchedEngine(
            model,
            eos_token_ids=set(),
            max_num_seqs=4,
            seed=0,
            semantics=semantics,  # type: ignore[arg-type]
            kv_capacity_tokens=capacity,
            virtual_step_s=STEP_S,
        )
        plans = _record_plans(engine)

        async def one(index: int) -> GenerationResult:
            await asyncio.sleep(0.004 * index)
            params = SamplingParams(max_tokens=max_tokens[index], ignore_eos=True)
            return await engine.generate(f"r{index}", prompts[index], params)

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        await engine.close()
        return results, plans, engine

    results, plans, engine = _virtual(main)
    held = [_kv_held(plan) for _, plan in plans]
    assert max(held) <= capacity
    assert max(held) >= capacity - 8 and engine.stats.preemptions > 0
    preempting = [plan for (before, _), (after, plan) in itertools.pairwise(plans) if after > before]
    assert preempting and all(plan.decode_tokens and not plan.prefill_prompts for plan in preempting)
    for prompt, limit, result in zip(prompts, max_tokens, results, strict=True):
        assert len(result.token_ids) == limit and result.stop_reason == "length"
        _assert_matches_recompute(model, prompt, result)


def test_a_request_larger_than_the_cache_fails_and_others_are_served(model: Qwen2ForCausalLM) -> None:
    """A cache of 20 tokens: a 25-token prompt can never fit and fails naming the capacity; one that outgrows the
    cache while decoding is preempted, then fails the same way when it cannot be readmitted alone. The engine
    serves the requests beside and after them."""
    big, small, grower = _prompts(25, 5, 10)

    async def main() -> tuple[GenerationResult, GenerationResult]:
        engine = CpuBatchedEngine(model, eos_token_ids=set(), kv_capacity_tokens=20, virtual_step_s=STEP_S)
        params = SamplingParams(max_tokens=5, temperature=0.0)
        failed, served = await asyncio.gather(
            engine.generate("big", big, params), engine.generate("small", small, params), return_exceptions=True
        )
        assert isinstance(failed, ValueError) and "kv_capacity_tokens=20" in str(failed)
        with pytest.raises(ValueError, match=r"needs 21 tokens of KV cache, more than .*kv_capacity_tokens=20"):
            await engine.generate("grower", grower, SamplingParams(max_tokens=30, ignore_eos=True))
        assert engine.stats.preemptions == 1 and engine.is_idle
        after = await engine.generate("after", small, params)
        await engine.close()
        return served, after

    served, after = _virtual(main)
    assert served.token_ids == after.token_ids and len(served.token_ids) == 5
    _assert_matches_recompute(model, small, served)


@pytest.mark.parametrize("capacity", [0, -3])
def test_kv_capacity_must_be_positive(model: Qwen2ForCausalLM, capacity: int) -> None:
    with pytest.raises(ValueError, match=f"^kv_capacity_tokens must be >= 1 or None, got {capacity}$"):
        CpuBatchedEngine(model, eos_token_ids=set(), kv_capacity_tokens=capacity)
