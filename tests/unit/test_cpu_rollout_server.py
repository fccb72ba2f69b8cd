"""The verl-facing CPU rollout server: TokenOutputs with exact log-probs, abort, weight updates, bad input.

The server class is exercised in-process (``CpuRolloutServer`` is a plain class that the replica wraps
with ``ray.remote``), built from verl's own ``RolloutConfig`` and ``HFModelConfig`` on the demo model.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.workers.config import HFModelConfig, RolloutConfig

from verl_partial.cpu_backend.rollout import CpuRolloutServer, FaultInjection, to_engine_params


@pytest.fixture(scope="module")
def reference(demo_assets):
    return AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32).eval()


def make_server(demo_assets) -> CpuRolloutServer:
    config = RolloutConfig(name="cpu", prompt_length=32, response_length=64, max_num_seqs=8)
    model_config = HFModelConfig(path=str(demo_assets.model_dir))
    return CpuRolloutServer(config=config, model_config=model_config, replica_rank=0)


def prompt(demo_assets, count: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    messages = [{"role": "user", "content": f"Count down from {count} to 1."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def recompute(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0, len(prompt_ids) - 1 : -1].float(), dim=-1)
    return log_probs.gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]


def test_generate_returns_the_models_own_log_probs(demo_assets, reference):
    async def main():
        server = make_server(demo_assets)
        prompts = [prompt(demo_assets, count) for count in (3, 12, 40)]
        outputs = await asyncio.gather(
            *[
                server.generate(prompt_ids=p, sampling_params={"temperature": 1.0, "logprobs": True}, request_id=str(i))
                for i, p in enumerate(prompts)
            ]
        )
        for prompt_ids, output in zip(prompts, outputs, strict=True):
            assert output.stop_reason == "completed"
            assert 0 < len(output.token_ids) <= 64
            expected = recompute(reference, prompt_ids, output.token_ids)
            assert torch.allclose(torch.tensor(output.log_probs), expected, atol=1e-4)
            assert output.extra_fields["server_address"] == "cpu://replica-0"

    asyncio.run(main())


def test_abort_returns_the_tokens_generated_so_far(demo_assets, reference):
    async def main():
        server = make_server(demo_assets)
        prompt_ids = prompt(demo_assets, 5)
        params = {"temperature": 1.0, "max_tokens": 60, "ignore_eos": True}
        task = asyncio.ensure_future(server.generate(prompt_ids=prompt_ids, sampling_params=params, request_id="a"))
        while server.engine.stats.generated_tokens < 5:
            await asyncio.sleep(0.001)
        result = await server.abort_all_requests()
        output = await task
        assert result["aborted_count"] == 1
        assert output.stop_reason == "aborted"
        assert 0 < len(output.token_ids) < 60
        expected = recompute(reference, prompt_ids, output.token_ids)
        assert torch.allclose(torch.tensor(output.log_probs), expected, atol=1e-4)
        # Paused after an abort, like vLLM: a new request waits for resume_generation.
        late = asyncio.ensure_future(server.generate(prompt_ids=prompt_ids, sampling_params=params, request_id="b"))
        await asyncio.sleep(0.05)
        assert not late.done()
        await server.resume_generation()
        assert len((await late).token_ids) == 60

    asyncio.run(main())


def test_weight_update_changes_what_is_generated(demo_assets, reference):
    async def main():
        server = make_server(demo_assets)
        prompt_ids = prompt(demo_assets, 9)
        greedy = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
        before = await server.generate(prompt_ids=prompt_ids, sampling_params=dict(greedy), request_id="x")
        torch.manual_seed(0)
        perturbed = {name: p + 0.5 * torch.randn_like(p) for name, p in reference.state_dict().items()}
        await server.load_weights(perturbed, global_steps=7)
        after = await server.generate(prompt_ids=prompt_ids, sampling_params=dict(greedy), request_id="y")
        assert after.token_ids != before.token_ids
        assert after.extra_fields["global_steps"] == 7
        await server.load_weights(reference.state_dict(), global_steps=8)
        again = await server.generate(prompt_ids=prompt_ids, sampling_params=dict(greedy), request_id="z")
        assert again.token_ids == before.token_ids

    asyncio.run(main())


def test_unsupported_sampling_params_are_refused_by_name():
    with pytest.raises(ValueError, match="repetition_penalty=1.2"):
        to_engine_params({"repetition_penalty": 1.2}, default_max_tokens=8)
    with pytest.raises(ValueError, match=r"\['stop'\]"):
        to_engine_params({"stop": ["\n"]}, default_max_tokens=8)
    assert to_engine_params({"logprobs": True, "repetition_penalty": 1.0}, default_max_tokens=8).max_tokens == 8


def test_fault_injection_spec_is_parsed_and_validated():
    assert FaultInjection.from_env("raise=0.1,hang=0.05,hang_s=3,seed=2") == FaultInjection(0.1, 0.05, 3.0, 2)
    assert FaultInjection.from_env(None) == FaultInjection()
    with pytest.raises(ValueError, match="unknown key 'crash'"):
        FaultInjection.from_env("crash=1")
