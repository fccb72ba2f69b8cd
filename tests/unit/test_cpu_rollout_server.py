"""The verl-facing CPU rollout server: TokenOutputs with exact log-probs, abort, weight updates, bad input.

The server class is exercised in-process (``CpuRolloutServer`` is a plain class that the replica wraps
with ``ray.remote``), built from verl's own ``RolloutConfig`` and ``HFModelConfig`` on the demo model.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import TokenOutput

from verl_partial.core.finish import Finish, from_vllm
from verl_partial.core.partial_config import PartialConfig
from verl_partial.core.pool import RolloutPool, SegmentResult
from verl_partial.core.scheduler import run_step
from verl_partial.cpu_backend.rollout import CpuRolloutServer, FaultInjection, to_engine_params


@pytest.fixture(scope="module")
def reference(demo_assets):
    return AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32).eval()


def make_server(demo_assets, max_num_seqs: int = 8, replica_rank: int = 0) -> CpuRolloutServer:
    config = RolloutConfig(name="cpu", prompt_length=32, response_length=64, max_num_seqs=max_num_seqs)
    model_config = HFModelConfig(path=str(demo_assets.model_dir))
    return CpuRolloutServer(config=config, model_config=model_config, replica_rank=replica_rank)


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
            # Exactly verl's vLLM server fields: neither server says who it is (the client knows whom it called).
            assert output.extra_fields == {"global_steps": None}

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


# ------------------------------------------------------------------------ vLLM gate semantics (verl 0.9.1)
LONG = {"temperature": 1.0, "max_tokens": 60, "ignore_eos": True}


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_stop_reason_is_vllms_completed_for_eos_and_length(demo_assets):
    """verl's vLLM server says "completed" for both; the vLLM mapper tells them apart by the last token."""

    async def main():
        server = make_server(demo_assets)
        eos_ids = server.engine.eos_token_ids
        outputs = await asyncio.gather(
            *[
                server.generate(
                    prompt_ids=prompt(demo_assets, count), sampling_params={"max_tokens": 6}, request_id=str(i)
                )
                for i, count in enumerate((2, 3, 5, 8, 13, 21))
            ],
            server.generate(prompt_ids=prompt(demo_assets, 4), sampling_params={"max_tokens": 64}, request_id="full"),
        )
        for output in outputs:
            assert output.stop_reason == "completed"
            finish = from_vllm(output.stop_reason, output.token_ids, 64 if len(output.token_ids) > 6 else 6, eos_ids)
            assert finish in (Finish.EOS, Finish.LENGTH)
            assert (finish is Finish.EOS) == (output.token_ids[-1] in eos_ids)
        assert any(len(o.token_ids) == 6 and o.token_ids[-1] not in eos_ids for o in outputs)  # a budget stop
        assert outputs[-1].token_ids[-1] in eos_ids  # the demo model ends its count-down with EOS

    asyncio.run(main())


def test_rejecting_gate_refuses_late_arrivals_at_once(demo_assets):
    """abort_all_requests(reject_request=True): a request arriving before resume returns "aborted", no tokens,
    log_probs None, without reaching the engine -- verl's _park_until_admitted. Resume clears the rejection."""

    async def main():
        server = make_server(demo_assets)
        await server.abort_all_requests(reject_request=True)
        prefilled = server.engine.stats.prefill_tokens
        late = await asyncio.wait_for(
            server.generate(prompt_ids=prompt(demo_assets, 3), sampling_params=dict(LONG), request_id="late"), 1.0
        )
        assert (late.token_ids, late.log_probs, late.stop_reason) == ([], None, "aborted")
        assert server.engine.stats.prefill_tokens == prefilled
        await server.resume_generation()
        again = await server.generate(prompt_ids=prompt(demo_assets, 3), sampling_params=dict(LONG), request_id="x")
        assert len(again.token_ids) == 60 and again.stop_reason == "completed"

    asyncio.run(main())


def test_a_request_aborted_while_queued_returns_no_tokens(demo_assets):
    async def main():
        server = make_server(demo_assets, max_num_seqs=1)
        running = asyncio.ensure_future(
            server.generate(prompt_ids=prompt(demo_assets, 5), sampling_params=dict(LONG), request_id="running")
        )
        queued = asyncio.ensure_future(
            server.generate(prompt_ids=prompt(demo_assets, 6), sampling_params=dict(LONG), request_id="queued")
        )
        await _until(lambda: server.engine.stats.generated_tokens >= 3)
        assert server.engine.num_waiting == 1
        result = await server.abort_all_requests()
        assert sorted(result["request_ids"]) == ["queued", "running"]
        first, second = await running, await queued
        assert first.stop_reason == second.stop_reason == "aborted"
        assert 0 < len(first.token_ids) < 60 and len(first.log_probs) == len(first.token_ids)
        assert second.token_ids == []

    asyncio.run(main())


def test_abort_request_ends_one_request_and_a_parked_one_is_freed_by_cancelling_its_call(demo_assets):
    async def main():
        server = make_server(demo_assets)
        a = asyncio.ensure_future(
            server.generate(prompt_ids=prompt(demo_assets, 5), sampling_params=dict(LONG), request_id="a")
        )
        b = asyncio.ensure_future(
            server.generate(prompt_ids=prompt(demo_assets, 7), sampling_params=dict(LONG), request_id="b")
        )
        await _until(lambda: server.engine.stats.generated_tokens >= 6)
        assert (await server.abort_request("a"))["aborted"]
        assert not (await server.abort_request("unknown"))["aborted"]
        out_a = await a
        assert out_a.stop_reason == "aborted" and 0 < len(out_a.token_ids) < 60
        assert len((await b).token_ids) == 60  # the other request was untouched

        await server.abort_all_requests()  # parking gate
        parked = asyncio.ensure_future(
            server.generate(prompt_ids=prompt(demo_assets, 9), sampling_params=dict(LONG), request_id="parked")
        )
        await asyncio.sleep(0.05)
        assert not parked.done()
        assert not (await server.abort_request("parked"))["aborted"]  # like vLLM: the engine does not know it
        parked.cancel()
        await asyncio.gather(parked, return_exceptions=True)
        before = server.engine.stats.generated_tokens
        await server.resume_generation()
        await asyncio.sleep(0.2)
        assert server.engine.stats.generated_tokens == before  # the cancelled call never reached the engine

    asyncio.run(main())


def test_a_cancelled_generate_call_stops_generating(demo_assets):
    async def main():
        server = make_server(demo_assets)
        call = asyncio.ensure_future(
            server.generate(prompt_ids=prompt(demo_assets, 5), sampling_params=dict(LONG), request_id="c")
        )
        await _until(lambda: server.engine.stats.generated_tokens >= 3)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await _until(lambda: server.engine.num_running == 0)
        stopped_at = server.engine.stats.generated_tokens
        await asyncio.sleep(0.1)
        assert server.engine.stats.generated_tokens == stopped_at < 60
        assert server.engine.request_ids == []

    asyncio.run(main())


class CpuServersBackend:
    """The scheduler's backend protocol over in-process CPU servers, with a client->server transit delay per call
    (what a Ray call spends on its way) so calls can be in transit when the step ends."""

    def __init__(self, servers: list[CpuRolloutServer], transit) -> None:
        self.by_name = {f"cpu://replica-{i}": server for i, server in enumerate(servers)}
        self.transit = transit
        self.tasks: dict[str, asyncio.Task] = {}
        self.eos_ids = servers[0].engine.eos_token_ids

    @property
    def servers(self) -> list[str]:
        return list(self.by_name)

    def launch(self, wave):
        return [asyncio.ensure_future(self._call(group, request)) for group, request in wave]

    async def _call(self, group, request) -> SegmentResult:
        self.tasks[request.request_id] = asyncio.current_task()
        await asyncio.sleep(self.transit(group.key))
        prefix = group.samples[request.ref.index].token_ids.tolist()
        try:
            output = await self.by_name[request.server].generate(
                prompt_ids=list(group.prompt) + prefix,
                sampling_params={"temperature": 1.0, "max_tokens": request.max_new_tokens},
                request_id=request.request_id,
            )
        except asyncio.CancelledError:
            output = TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted")
        return SegmentResult(
            new_ids=np.asarray(output.token_ids, np.int32),
            new_log_probs=np.asarray(output.log_probs or [], np.float32),
            finish=from_vllm(output.stop_reason, output.token_ids, request.max_new_tokens, self.eos_ids),
            server=request.server,
            server_version=output.extra_fields.get("global_steps"),
            prompt_ids=np.asarray(group.prompt, np.int32),
        )

    async def cancel(self, requests) -> None:
        for request in requests:
            found = await self.by_name[request.server].abort_request(request.request_id)
            if not found["aborted"]:  # in transit or parked at the gate: cancel the call itself
                self.tasks[request.request_id].cancel()

    async def abort_all(self) -> None:
        await asyncio.gather(*[server.abort_all_requests() for server in self.by_name.values()])

    async def resume(self) -> None:
        await asyncio.gather(*[server.resume_generation() for server in self.by_name.values()])


def test_step_end_with_calls_in_transit_at_the_abort_does_not_stall(demo_assets):
    """The scheduler on real CPU engines with vLLM's parking gate: the second group's calls are still on their
    way when the first group finishes and the step ends, so they reach closed gates and park. The step-end
    protocol cancels them after abort_grace_s; the old one (resume only after every call returned) waited
    request_timeout_s for them, and once the gates reopened they generated for a step that was over."""
    import time

    config = PartialConfig(extra_groups=1, staleness_policy="keep", request_timeout_s=30.0, abort_grace_s=0.5)
    servers = [make_server(demo_assets, replica_rank=i) for i in range(2)]
    backend = CpuServersBackend(servers, transit=lambda key: 0.0 if key == "p0" else 1.5)
    pool = RolloutPool(config, group_size=2, batch_groups=1, response_length=32)
    source = iter([(prompt(demo_assets, count), f"p{i}") for i, count in enumerate((3, 30, 40))])

    class Source:
        def next_prompt(self):
            return next(source, None)

    async def main():
        started = time.monotonic()
        result = await run_step(pool, backend, Source(), step=1, version=0)
        elapsed = time.monotonic() - started
        assert [group.key for group in result.trained] == ["p0"]
        assert result.metrics["partial/step_end_s"] < 4 * config.abort_grace_s
        assert elapsed < config.request_timeout_s / 3
        assert result.metrics["partial/failed_calls"] == 0
        assert all(not s.engine.request_ids for s in servers)
        generated = sum(s.engine.stats.generated_tokens for s in servers)
        await asyncio.sleep(2.0)  # gates are open again: nothing from the ended step may run now
        assert sum(s.engine.stats.generated_tokens for s in servers) == generated
        assert sum(task.cancelled() or task.done() for task in backend.tasks.values()) == len(backend.tasks)

    asyncio.run(main())
