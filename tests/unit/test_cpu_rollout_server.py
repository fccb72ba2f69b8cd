"""The verl-facing CPU rollout server: TokenOutputs with exact log-probs, abort, weight updates, bad input, and the
control semantics of verl 0.9.1's vLLMHttpServer on vLLM 0.24 (gate, admission barrier, take-back, max_model_len).

The server class is exercised in-process (``CpuRolloutServer`` is a plain class that the replica wraps
with ``ray.remote``), built from verl's own ``RolloutConfig`` and ``HFModelConfig`` on the demo model. Tests about
timing run on the virtual clock with engine steps of ``STEP_S``; none depends on wall-clock time.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import TokenOutput

from verl_partial.config.partial import PartialConfig
from verl_partial.core.engines.vllm import from_vllm
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import RolloutPool, SegmentResult
from verl_partial.core.partial.scheduler import run_step
from verl_partial.cpu_backend.rollout import GATE_BARRIER_TIMEOUT_S, CpuRolloutServer, FaultInjection, to_engine_params
from verl_partial.sim.clock import run_virtual

STEP_S = 0.01


@pytest.fixture(scope="module")
def reference(demo_assets):
    return AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32).eval()


def make_server(
    demo_assets,
    max_num_seqs: int = 8,
    replica_rank: int = 0,
    max_model_len: int | None = None,
    virtual_step_s: float | None = None,
) -> CpuRolloutServer:
    config = RolloutConfig(
        name="cpu", prompt_length=32, response_length=64, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    model_config = HFModelConfig(path=str(demo_assets.model_dir))
    return CpuRolloutServer(
        config=config, model_config=model_config, replica_rank=replica_rank, virtual_step_s=virtual_step_s
    )


def virtual_server(demo_assets, **kwargs) -> CpuRolloutServer:
    return make_server(demo_assets, virtual_step_s=STEP_S, **kwargs)


def call(server, request_id: str, params: dict, prompt_ids: list[int]):
    return asyncio.ensure_future(
        server.generate(prompt_ids=prompt_ids, sampling_params=dict(params), request_id=request_id)
    )


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
        server = virtual_server(demo_assets)
        prompt_ids = prompt(demo_assets, 5)
        params = {"temperature": 1.0, "max_tokens": 60, "ignore_eos": True}
        task = call(server, "a", params, prompt_ids)
        await server.engine.wait_until(lambda: server.engine.stats.generated_tokens >= 5)
        result = await server.abort_all_requests()
        output = await task
        assert result["aborted_count"] == 1
        assert output.stop_reason == "aborted"
        assert 0 < len(output.token_ids) < 60
        expected = recompute(reference, prompt_ids, output.token_ids)
        assert torch.allclose(torch.tensor(output.log_probs), expected, atol=1e-4)
        # Paused after an abort, like vLLM: a new request waits for resume_generation.
        late = call(server, "b", params, prompt_ids)
        await asyncio.sleep(100 * STEP_S)
        assert not late.done()
        await server.resume_generation()
        assert len((await late).token_ids) == 60

    run_virtual(main())


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
    assert FaultInjection.from_env("step_s=0.01").step_s == 0.01
    with pytest.raises(ValueError, match="unknown key 'crash'"):
        FaultInjection.from_env("crash=1")


# ------------------------------------------------------------------------ vLLM gate semantics (verl 0.9.1)
LONG = {"temperature": 1.0, "max_tokens": 60, "ignore_eos": True}


def test_stop_reason_is_vllms_completed_for_eos_and_length(demo_assets):
    """verl's vLLM server says "completed" for both; the vLLM mapper tells them apart by the last token."""

    async def main():
        server = make_server(demo_assets)
        eos_ids = server.engine.eos_token_ids
        # Greedy: which answers end on EOS and which on the budget must not depend on the random state tests leave.
        budgets = [6] * 6 + [demo_assets.max_response_length]
        outputs = await asyncio.gather(
            *[
                server.generate(
                    prompt_ids=prompt(demo_assets, count),
                    sampling_params={"max_tokens": budget, "temperature": 0.0},
                    request_id=str(i),
                )
                for i, (count, budget) in enumerate(zip((2, 3, 5, 8, 13, 21, 4), budgets, strict=True))
            ]
        )
        for output, budget in zip(outputs, budgets, strict=True):
            assert output.stop_reason == "completed"
            finish = from_vllm(output.stop_reason, output.token_ids, budget, eos_ids).finish
            assert finish in (Finish.EOS, Finish.LENGTH)
            assert (finish is Finish.EOS) == (output.token_ids[-1] in eos_ids)
        assert any(len(o.token_ids) == 6 and o.token_ids[-1] not in eos_ids for o in outputs)  # a budget stop
        assert outputs[-1].token_ids[-1] in eos_ids  # the demo model ends its count-down with EOS

    asyncio.run(main())


def test_rejecting_gate_refuses_late_arrivals_at_once(demo_assets):
    """abort_all_requests(reject_request=True): a request arriving before resume returns "aborted", no tokens,
    log_probs None, without reaching the engine -- verl's _park_until_admitted. Resume clears the rejection."""

    async def main():
        server = virtual_server(demo_assets)
        await server.abort_all_requests(reject_request=True)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        late = await call(server, "late", LONG, prompt(demo_assets, 3))
        assert loop.time() == arrived  # refused at the gate, no engine step
        assert (late.token_ids, late.log_probs, late.stop_reason) == ([], None, "aborted")
        assert server.engine.stats.prefill_tokens == 0
        await server.resume_generation()
        again = await call(server, "x", LONG, prompt(demo_assets, 3))
        assert len(again.token_ids) == 60 and again.stop_reason == "completed"

    run_virtual(main())


def test_a_queued_request_holds_the_admission_barrier_while_the_engine_keeps_generating(demo_assets):
    """vLLMHttpServer.abort_all_requests waits while _admitting > 0, and _admitting falls only at a request's first
    output: a request queued behind max_num_seqs holds the barrier; the running one keeps decoding meanwhile.
    Taking the queued one back (it ends with no output) releases the barrier; then the abort ends the rest."""

    async def main():
        server = virtual_server(demo_assets, max_num_seqs=1)
        running = call(server, "running", LONG, prompt(demo_assets, 5))
        queued = call(server, "queued", LONG, prompt(demo_assets, 6))
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("running") >= 3)
        assert server.engine.num_waiting == 1 and not queued.done()
        abort = asyncio.ensure_future(server.abort_all_requests(reject_request=True))
        held_at = server.engine.tokens_so_far("running")
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("running") >= held_at + 10)
        assert not abort.done()  # the barrier holds and the engine keeps generating
        assert await server.take_back_requests(["queued", "parked-or-unknown"]) == ["queued"]
        assert (await queued).token_ids == []
        result = await abort
        assert result["request_ids"] == ["running"]
        first = await running
        assert first.stop_reason == "aborted" and held_at + 10 <= len(first.token_ids) < 60

    run_virtual(main())


def test_the_admission_barrier_gives_up_after_60_s(demo_assets):
    async def main():
        server = virtual_server(demo_assets, max_num_seqs=1)
        running = call(server, "running", dict(LONG, max_tokens=64), prompt(demo_assets, 5))
        queued = call(server, "queued", LONG, prompt(demo_assets, 6))
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("running") >= 3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The running request finishes meanwhile and the queued one starts: its first output releases the barrier.
        await server.abort_all_requests()
        assert loop.time() - started < GATE_BARRIER_TIMEOUT_S
        assert (await running).stop_reason == "completed" and (await queued).stop_reason == "aborted"

        long = virtual_server(demo_assets, max_num_seqs=1)
        running = call(long, "running", dict(LONG, max_tokens=64), prompt(demo_assets, 5))
        queued = call(long, "queued", LONG, prompt(demo_assets, 6))
        long.engine.virtual_step_s = 2.0  # 64 tokens take longer than the barrier waits
        await long.engine.wait_until(lambda: long.engine.tokens_so_far("running") >= 1)
        started = loop.time()
        result = await long.abort_all_requests()
        assert GATE_BARRIER_TIMEOUT_S <= loop.time() - started < GATE_BARRIER_TIMEOUT_S + 1
        assert sorted(result["request_ids"]) == ["queued", "running"]
        assert (await queued).token_ids == [] and (await running).stop_reason == "aborted"

    run_virtual(main())


def test_take_back_returns_tokens_and_verls_abort_request_finds_nothing_on_vllm_0_24(demo_assets):
    """take_back_requests: a running request ends "aborted" with its tokens, others untouched; a request parked at
    the gate is not in the engine and is untouched (its call must be cancelled). verl's own abort_request answers
    "not found" for every id on vLLM 0.24 (internal request ids), so the double does too."""

    async def main():
        server = virtual_server(demo_assets)
        a, b = call(server, "a", LONG, prompt(demo_assets, 5)), call(server, "b", LONG, prompt(demo_assets, 7))
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("a") >= 4)
        assert (await server.abort_request("a")) == {"aborted": False, "error": "Request a not found"}
        assert await server.take_back_requests(["a", "unknown"]) == ["a"]
        out_a = await a
        assert out_a.stop_reason == "aborted" and 4 <= len(out_a.token_ids) < 60
        assert len((await b).token_ids) == 60  # untouched

        await server.abort_all_requests()  # parking gate
        parked = call(server, "parked", LONG, prompt(demo_assets, 9))
        await asyncio.sleep(100 * STEP_S)
        assert not parked.done()
        assert await server.take_back_requests(["parked"]) == []
        parked.cancel()
        await asyncio.gather(parked, return_exceptions=True)
        before = server.engine.stats.generated_tokens
        await server.resume_generation()
        await asyncio.sleep(100 * STEP_S)
        assert server.engine.stats.generated_tokens == before  # the cancelled call never reached the engine

    run_virtual(main())


def test_a_cancelled_generate_call_returns_nothing_and_stops_generating(demo_assets):
    async def main():
        server = virtual_server(demo_assets)
        task = call(server, "c", LONG, prompt(demo_assets, 5))
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("c") >= 3)
        task.cancel()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        assert isinstance(outcome, asyncio.CancelledError)  # nothing comes back to a cancelled call
        stopped_at = server.engine.stats.generated_tokens
        await asyncio.sleep(100 * STEP_S)
        assert server.engine.stats.generated_tokens == stopped_at < 60
        assert server.engine.request_ids == [] and server._admitting == 0

    run_virtual(main())


def test_max_model_len_null_is_the_models_and_max_tokens_is_clamped_to_the_context(demo_assets):
    """vLLMHttpServer._validate_configs: max_model_len null -> max_position_embeddings (1024 for the demo model);
    generate clamps max_tokens to max_model_len - prompt, and the truncated answer says "completed"."""
    assert make_server(demo_assets).max_model_len == 1024
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_server(demo_assets, max_model_len=4096)

    async def main():
        prompt_ids = prompt(demo_assets, 5)
        server = virtual_server(demo_assets, max_model_len=len(prompt_ids) + 4)
        out = await call(server, "t", LONG, prompt_ids)
        assert (len(out.token_ids), out.stop_reason) == (4, "completed")
        with pytest.raises(ValueError, match="no room"):
            await call(server, "full", LONG, prompt_ids + [1, 2, 3, 4])

    run_virtual(main())


class CpuServersBackend:
    """The scheduler's backend protocol over in-process CPU servers, with a client->server transit delay per call
    (what a Ray call spends on its way) so calls can be in transit when the step ends. Take-back goes to the
    server by request id; cancel drops the call, which then returns nothing, as on a real engine."""

    def __init__(self, servers: list[CpuRolloutServer], transit) -> None:
        self.by_name = {f"cpu://replica-{i}": server for i, server in enumerate(servers)}
        self.transit = transit
        self.tasks: dict[str, asyncio.Task] = {}
        self.eos_ids = servers[0].engine.eos_token_ids
        self.group_of: dict[str, str] = {}
        self.cancelled: list[str] = []  # group keys of the calls dropped
        self.aborts: dict[str, asyncio.Task] = {}
        self.resumes: dict[str, asyncio.Task] = {}

    @property
    def servers(self) -> list[str]:
        return list(self.by_name)

    def launch(self, wave):
        self.group_of.update({request.request_id: group.key for group, request in wave})
        return [asyncio.ensure_future(self._call(group, request)) for group, request in wave]

    async def _call(self, group, request) -> SegmentResult:
        self.tasks[request.request_id] = asyncio.current_task()
        prefix = group.samples[request.ref.index].token_ids.tolist()
        try:
            await asyncio.sleep(self.transit(group.key))
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
            finish=from_vllm(output.stop_reason, output.token_ids, request.max_new_tokens, self.eos_ids).finish,
            server=request.server,
            server_version=output.extra_fields.get("global_steps"),
            prompt_ids=np.asarray(group.prompt, np.int32),
        )

    async def take_back(self, requests) -> None:
        for request in requests:
            await self.by_name[request.server].take_back_requests([request.request_id])

    async def progress(self, server: str):
        return await self.by_name[server].progress_of_requests()

    async def cancel(self, requests) -> None:
        for request in requests:
            self.cancelled.append(self.group_of[request.request_id])
            self.tasks[request.request_id].cancel()

    async def abort(self, server: str) -> None:
        self.aborts[server] = asyncio.ensure_future(self.by_name[server].abort_all_requests(reject_request=True))
        await asyncio.shield(self.aborts[server])

    async def resume(self, server: str) -> None:
        """Chained on the server's abort, as the glue chains it."""
        self.resumes[server] = asyncio.ensure_future(self._resume_after_abort(server))
        await asyncio.shield(self.resumes[server])

    async def _resume_after_abort(self, server: str) -> None:
        await asyncio.wait([self.aborts.pop(server)])
        await self.by_name[server].resume_generation()

    def reopening(self) -> dict[str, asyncio.Task]:
        return {server: task for server, task in self.resumes.items() if not task.done()}


def test_step_end_with_calls_queued_and_in_transit_takes_them_back_without_cancelling(demo_assets):
    """The scheduler on CPU engines with vLLM's gate and admission barrier, on the virtual clock: calls queue behind
    max_num_seqs=2 (holding the barrier) and the second group's calls are still in transit when the step ends. The
    step end takes the queued ones back (the barrier falls, control_timeouts 0); the calls still in transit after
    abort_grace_s are taken back once more and reach the closed gate, which refuses them (nothing lost, nothing
    cancelled). The step ends within a few abort_grace_s and nothing runs after it."""
    config = PartialConfig(extra_groups=2, staleness_policy="keep", request_timeout_s=30.0, abort_grace_s=0.5)
    servers = [virtual_server(demo_assets, replica_rank=i, max_num_seqs=2) for i in range(2)]
    backend = CpuServersBackend(servers, transit=lambda key: 0.0 if key != "p1" else 1.5)
    pool = RolloutPool(config, group_size=4, batch_groups=1, response_length=32, engine_slots=2 * 2)
    source = iter([(prompt(demo_assets, count), f"p{i}") for i, count in enumerate((3, 30, 40, 50))])

    class Source:
        def next_prompt(self):
            return next(source, None)

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await run_step(pool, backend, Source(), step=1, version=0)
        assert len(result.trained) == 1
        assert result.metrics["partial/step_end_s"] < 4 * config.abort_grace_s
        assert loop.time() - started < config.request_timeout_s / 3
        assert result.metrics["partial/failed_calls"] == 0
        assert result.metrics["partial/taken_back_calls"] > 0 and result.metrics["partial/control_timeouts"] == 0
        # The calls in transit reach the closed gate (refused, released) within the second take-back's grace:
        # nothing is cancelled, so nothing could be lost.
        assert backend.cancelled == []
        assert all(s.engine.is_idle and s._admitting == 0 for s in servers)
        generated = sum(s.engine.stats.generated_tokens for s in servers)
        await asyncio.sleep(2.0)  # gates are open again: nothing from the ended step may run now
        assert sum(s.engine.stats.generated_tokens for s in servers) == generated

    run_virtual(main())


def test_a_resume_that_overtakes_the_abort_barrier_leaves_the_engine_paused(demo_assets):
    """verl's race (issue 19): resume_generation lands while abort_all_requests waits at its barrier; the abort then
    pauses the engine after the resume, and the gate stays open on a paused engine until the next resume. The
    scheduler must send resume only after abort_all_requests returned; the double reproduces what happens if not."""

    async def main():
        server = virtual_server(demo_assets, max_num_seqs=1)
        running = call(server, "running", LONG, prompt(demo_assets, 5))
        queued = call(server, "queued", LONG, prompt(demo_assets, 6))
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("running") >= 2)
        abort = asyncio.ensure_future(server.abort_all_requests(reject_request=True))
        await asyncio.sleep(10 * STEP_S)
        await server.resume_generation()  # overtakes the abort still waiting for "queued"
        await server.take_back_requests(["queued"])
        await abort
        await asyncio.gather(running, queued)
        late = call(server, "late", LONG, prompt(demo_assets, 7))
        await asyncio.sleep(100 * STEP_S)
        assert not late.done() and server.engine.num_waiting == 1  # admitted by the open gate, never scheduled
        await server.resume_generation()
        assert len((await late).token_ids) == 60

    run_virtual(main())


def test_progress_of_requests_reads_the_tokens_so_far_of_each_held_request(demo_assets):
    """The scheduler's stall check (issue 26, finding 5) reads this, as it reads verl's vLLM server through our patch:
    a running request's count grows between two readings, a queued one reads 0, and a request the engine no longer
    holds is left out."""

    async def main():
        server = virtual_server(demo_assets, max_num_seqs=1)
        running = call(server, "running", LONG, prompt(demo_assets, 5))
        queued = call(server, "queued", LONG, prompt(demo_assets, 6))
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("running") >= 2)
        first = await server.progress_of_requests()
        await asyncio.sleep(10 * STEP_S)
        second = await server.progress_of_requests()
        assert first["queued"] == second["queued"] == 0
        assert second["running"] > first["running"] >= 2
        await server.take_back_requests(["running", "queued"])
        await asyncio.gather(running, queued)
        assert await server.progress_of_requests() == {}

    run_virtual(main())


def test_a_server_that_stops_producing_is_taken_back_and_its_tokens_kept(demo_assets):
    """Issue 26, item 3, the other half: a stall is a server that generates nothing. Server 1's engine stops stepping
    (paused, its requests held) after its calls produced a few tokens; the stall check reads no progress there and
    takes its calls back: they return the tokens they had (kept) and finish on server 0. Server 0
    decodes long answers all along and is never taken back."""
    config = PartialConfig(extra_groups=0, staleness_policy="keep", request_timeout_s=1.0, abort_grace_s=0.5)
    servers = [virtual_server(demo_assets, replica_rank=i, max_num_seqs=4) for i in range(2)]
    backend = CpuServersBackend(servers, transit=lambda key: 0.0)
    pool = RolloutPool(config, group_size=4, batch_groups=2, response_length=64, engine_slots=2 * 4)
    source = iter([(prompt(demo_assets, count), f"p{i}") for i, count in enumerate((30, 40, 50))])

    class Source:
        def next_prompt(self):
            return next(source, None)

    async def main():
        step = asyncio.ensure_future(run_step(pool, backend, Source(), step=1, version=0))
        engine = servers[1].engine
        await engine.wait_until(lambda: any(engine.tokens_so_far(rid) >= 3 for rid in engine.request_ids))
        engine.pause()  # stops producing; its requests stay held
        result = await step
        assert len(result.trained) == 2
        metrics = result.metrics
        assert metrics["partial/progress_reads"] > 0 and metrics["partial/stalled_calls"] > 0
        # One stall costs at most one failure (its oldest call, if it had no token yet); no group is dropped.
        assert metrics["partial/failed_calls"] <= 1 and metrics["partial/failed_groups"] == 0
        assert metrics["partial/segments_per_sample/max"] >= 2  # resumed on server 0 from the tokens it returned
        assert backend.cancelled == []

    run_virtual(main())
