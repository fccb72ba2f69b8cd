"""SGLang mode of the CPU test server (SGLang 0.5.12 semantics behind verl 0.9.1's SGLangHttpServer), each behaviour
shown on the double as verl ships it (``CpuSglangServer``: the bug) and with verl-partial's server fix applied the way
``patches.apply`` applies it to verl's class (``FixedCpuSglangServer``: the fix). Everything runs on the virtual clock
(engine steps of ``STEP_S``), so no assertion depends on wall-clock time."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType, SimpleNamespace

import pytest
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

from verl_partial.cpu_backend.rollout import (
    SGLANG_PAUSE_POLL_S,
    CpuSglangReplica,
    CpuSglangServer,
    FixedCpuSglangServer,
)
from verl_partial.glue.engines import sglang
from verl_partial.glue.engines.sglang import apply_sglang_server_fix
from verl_partial.patches import apply, cpu
from verl_partial.sim.clock import run_virtual

STEP_S = 0.01
LONG = {"max_tokens": 40, "ignore_eos": True, "logprobs": True}
PROMPT = [3, 17, 29, 41, 5]


def make(demo_assets, cls=FixedCpuSglangServer, max_num_seqs: int = 4, max_model_len: int | None = None):
    config = RolloutConfig(
        name="sglang", prompt_length=32, response_length=64, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    return cls(
        config=config,
        model_config=HFModelConfig(path=str(demo_assets.model_dir)),
        replica_rank=0,
        virtual_step_s=STEP_S,
    )


def countdown(demo_assets) -> list[int]:
    """A demo prompt the demo model answers and ends with EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    messages = [{"role": "user", "content": "Count down from 4 to 1."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def call(server, request_id: str, params=LONG, prompt=PROMPT):
    return asyncio.ensure_future(
        server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id=request_id)
    )


def tokens(server, request_id: str) -> int:
    return server.engine.tokens_so_far(request_id)


def test_stop_reasons_are_sglangs_stop_length_abort(demo_assets):
    """SGLangHttpServer passes SGLang's finish type through: "stop" at EOS, "length" at max_new_tokens, "abort"."""

    async def main():
        server = make(demo_assets)
        # Greedy, with the whole response budget: the demo model ends a countdown answer with EOS.
        stop = call(
            server,
            "stop/",
            {"max_tokens": demo_assets.max_response_length, "temperature": 0.0, "logprobs": True},
            prompt=countdown(demo_assets),
        )
        length = call(server, "length/", {"max_tokens": 3, "ignore_eos": True, "logprobs": True})
        aborted = call(server, "abort/")
        await server.engine.wait_until(lambda: tokens(server, "abort/") >= 2)
        assert await server.take_back_requests(["abort/"]) == ["abort/"]
        out_stop, out_length, out_abort = await stop, await length, await aborted
        assert out_stop.stop_reason == "stop" and out_stop.token_ids[-1] in server.engine.eos_token_ids
        assert (out_length.stop_reason, len(out_length.token_ids)) == ("length", 3)
        assert out_abort.stop_reason == "abort" and len(out_abort.log_probs) == len(out_abort.token_ids)

    run_virtual(main())


@pytest.mark.parametrize("cls", [CpuSglangServer, FixedCpuSglangServer])
def test_abort_all_gives_each_running_request_one_more_token_and_queued_ones_none(demo_assets, cls):
    """Scheduler.abort_request "Abort method 3" (running: to_finish, one more decode) and "method 1" (queued:
    popped, no tokens); verl's abort_all_requests is pause_generation(mode="abort"). Same with and without the fix."""

    async def main():
        server = make(demo_assets, cls, max_num_seqs=2)
        calls = [call(server, f"r{i}/") for i in range(3)]
        await server.engine.wait_until(lambda: tokens(server, "r0/") >= 3 and tokens(server, "r1/") >= 3)
        seen = [tokens(server, "r0/"), tokens(server, "r1/")]
        await server.abort_all_requests()
        outputs = [await c for c in calls]
        assert [o.stop_reason for o in outputs] == ["abort"] * 3
        assert [len(o.token_ids) for o in outputs] == [seen[0] + 1, seen[1] + 1, 0]
        assert server.engine.is_idle

    run_virtual(main())


def test_pause_generation_polls_until_no_request_holds_the_reader_lock(demo_assets):
    """TokenizerManager.pause_generation re-sends abort-all every second while a request is in flight, so an abort
    with running requests lasts one poll on SGLang."""

    async def main():
        server = make(demo_assets)
        running = call(server, "r/")
        await server.engine.wait_until(lambda: tokens(server, "r/") >= 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await server.abort_all_requests()
        assert loop.time() - started == pytest.approx(SGLANG_PAUSE_POLL_S)
        assert (await running).stop_reason == "abort"

    run_virtual(main())


def test_max_new_tokens_is_capped_one_below_the_context_and_zero_answers_an_empty_length(demo_assets):
    """SGLangHttpServer.generate clamps max_new_tokens to [0, max_model_len - prompt - 1]; 0 gives a 0-token
    "length" (SGLang's phantom log-prob entry makes verl return [] tokens and [] log-probs)."""

    async def main():
        capped = make(demo_assets, max_model_len=len(PROMPT) + 4)
        out = await call(capped, "c/", {"max_tokens": 60, "ignore_eos": True, "logprobs": True})
        assert (out.stop_reason, len(out.token_ids)) == ("length", 3)
        full = make(demo_assets, max_model_len=len(PROMPT) + 1)
        empty = await call(full, "e/", {"max_tokens": 60, "logprobs": True})
        assert (empty.token_ids, empty.log_probs, empty.stop_reason) == ([], [], "length")
        again = await call(full, "e2/", {"max_tokens": 60})
        assert (again.token_ids, again.stop_reason) == ([], "length")
        assert make(demo_assets).max_model_len == 1024  # max_model_len null: the model's max_position_embeddings

    run_virtual(main())


def test_unfixed_pause_gate_parks_late_arrivals_and_has_no_reject(demo_assets):
    """verl's SGLangHttpServer.abort_all_requests takes no reject_request (SGLangReplica warns and drops it): a call
    arriving after the abort parks at is_pause_cond until resume_generation, then runs."""

    async def main():
        server = make(demo_assets, CpuSglangServer)
        with pytest.raises(TypeError):
            await server.abort_all_requests(reject_request=True)
        await server.abort_all_requests()
        late = call(server, "late/", {"max_tokens": 4, "ignore_eos": True, "logprobs": True})
        await asyncio.sleep(5.0)
        assert not late.done() and server.engine.stats.prefill_tokens == 0
        await server.resume_generation()
        assert len((await late).token_ids) == 4

    run_virtual(main())


def test_fixed_rejecting_gate_refuses_late_arrivals_without_entering_sglang(demo_assets):
    async def main():
        server = make(demo_assets)
        await server.abort_all_requests(reject_request=True)
        late = await call(server, "late/")
        assert (late.token_ids, late.log_probs, late.stop_reason) == ([], None, "abort")
        assert server.tokenizer_manager.stats().request_states == 0 and server.engine.stats.prefill_tokens == 0
        await server.resume_generation()
        assert len((await call(server, "after/", {"max_tokens": 4, "ignore_eos": True})).token_ids) == 4
        await server.abort_all_requests()  # without reject_request: SGLang's parking gate, as before the fix
        parked = call(server, "parked/", {"max_tokens": 4, "ignore_eos": True})
        await asyncio.sleep(5.0)
        assert not parked.done()
        await server.resume_generation()
        assert len((await parked).token_ids) == 4

    run_virtual(main())


def test_unfixed_cancel_keeps_decoding_and_sleep_asserts(demo_assets):
    """SGLang's generate_request has no CancelledError handler: the request keeps its slot and decodes to the end;
    release_memory_occupation (verl's sleep) meanwhile asserts is_fully_idle()."""

    async def main():
        server = make(demo_assets, CpuSglangServer)
        running = call(server, "c/")
        await server.engine.wait_until(lambda: tokens(server, "c/") >= 2)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await server.engine.wait_until(lambda: tokens(server, "c/") >= 10)
        assert server.engine.num_running == 1 and "c/" in server.tokenizer_manager.rid_to_state
        with pytest.raises(AssertionError, match="idle"):
            await server.sleep()
        await server.engine.wait_until(lambda: server.engine.is_idle)
        assert server.engine.stats.generated_tokens == 40  # it ran to max_tokens for nobody
        assert server.tokenizer_manager.stats().request_states == 0
        await server.sleep()

    run_virtual(main())


def test_fixed_cancel_aborts_the_request(demo_assets):
    async def main():
        server = make(demo_assets)
        running = call(server, "c/")
        await server.engine.wait_until(lambda: tokens(server, "c/") >= 2)
        seen = tokens(server, "c/")
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await server.engine.wait_until(lambda: server.engine.is_idle)
        assert server.engine.stats.generated_tokens == seen + 1  # the abort's one extra token, then nothing
        assert server.tokenizer_manager.stats().request_states == 0
        await server.sleep()

    run_virtual(main())


@pytest.mark.parametrize("cls, leaked", [(CpuSglangServer, 1), (FixedCpuSglangServer, 0)])
def test_a_call_cancelled_while_parked_leaks_its_state_unless_fixed(demo_assets, cls, leaked):
    """_init_req_state runs before the pause gate; a call cancelled there never reaches the scheduler, so nothing
    deletes its rid_to_state entry (SGLang). The fix drops it on cancel."""

    async def main():
        server = make(demo_assets, cls)
        await server.abort_all_requests()
        parked = call(server, "p/")
        await asyncio.sleep(1.0)
        parked.cancel()
        await asyncio.gather(parked, return_exceptions=True)
        await server.resume_generation()
        await asyncio.sleep(1.0)
        stats = server.tokenizer_manager.stats()
        assert (stats.leaked_request_states, stats.request_states) == (leaked, leaked)
        assert server.engine.stats.prefill_tokens == 0

    run_virtual(main())


@pytest.mark.parametrize("cls, leaked", [(CpuSglangServer, 2), (FixedCpuSglangServer, 0)])
def test_calls_aborted_while_queued_leave_no_state_unless_unfixed(demo_assets, cls, leaked):
    """SGLang 0.5.12's _handle_abort_req marks an aborted queued request finished and never deletes its state: each
    call taken back (here: verl's abort-all) while queued leaks its entry. The fix drops it when the call returns."""

    async def main():
        server = make(demo_assets, cls, max_num_seqs=1)
        calls = [call(server, f"r{i}/") for i in range(3)]
        await server.engine.wait_until(lambda: tokens(server, "r0/") >= 2)
        await server.abort_all_requests()
        outputs = [await c for c in calls]
        assert [len(o.token_ids) for o in outputs[1:]] == [0, 0] and outputs[0].stop_reason == "abort"
        await server.resume_generation()
        stats = server.tokenizer_manager.stats()
        assert (stats.leaked_request_states, stats.request_states, stats.died) == (leaked, leaked, False)

    run_virtual(main())


def test_fixed_cancel_of_a_queued_call_keeps_its_state_until_the_abort_echo(demo_assets):
    """A cancelled queued call: the scheduler echoes its abort, and the tokenizer's handler indexes rid_to_state
    without a guard. The fix keeps the state until the echo is handled, then drops it: the server lives on."""

    async def main():
        server = make(demo_assets, max_num_seqs=1)
        running, queued = call(server, "run/"), call(server, "queued/")
        await server.engine.wait_until(lambda: tokens(server, "run/") >= 2)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        assert not server.tokenizer_manager.stats().died
        out = await running
        assert len(out.token_ids) == 40
        stats = server.tokenizer_manager.stats()
        assert (stats.died, stats.request_states) == (False, 0)
        await server.sleep()

    run_virtual(main())


def test_fixed_cancel_resends_an_abort_that_missed_a_chunked_prefill_and_sleep_waits(demo_assets, monkeypatch):
    """SGLang 0.5.12's abort misses a request between two chunks of its prefill: it decodes on. The fix re-sends the
    abort every ABORT_RESEND_S until it is answered, and sleep (release_memory_occupation's idle assert) waits."""
    from verl_partial.glue.engines import sglang as sglang_server

    resend_s = 5 * STEP_S  # re-sends within the answer's 40 steps
    monkeypatch.setattr(sglang_server, "ABORT_RESEND_S", resend_s, raising=False)

    async def main():
        server = make(demo_assets)
        running = call(server, "c/")
        await server.engine.wait_until(lambda: tokens(server, "c/") >= 2)
        server.tokenizer_manager.between_chunks.add("c/")
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        sleeping = asyncio.ensure_future(server.sleep())
        await asyncio.sleep(resend_s * 2.5)
        assert not sleeping.done() and server.engine.num_running == 1  # missed twice: still decoding
        server.tokenizer_manager.between_chunks.discard("c/")  # its prefill's last chunk
        await sleeping  # the next re-send ends it; sleep then finds the scheduler idle
        assert server.engine.is_idle and server.tokenizer_manager.stats().request_states == 0
        assert server.engine.stats.generated_tokens < 40

    run_virtual(main())


def test_take_back_matches_ids_by_prefix_so_ids_must_be_prefix_free(demo_assets):
    """Scheduler.abort_request ends every request whose id starts with the given one: "g/1" also ends "g/10";
    with terminated ids ("g/1/") only the named call ends. Running: tokens + 1; queued: none; unknown: untouched."""

    async def main():
        server = make(demo_assets, max_num_seqs=3)
        calls = {rid: call(server, rid) for rid in ("g/1", "g/10", "h/1/", "h/10/", "q/")}
        await server.engine.wait_until(lambda: all(tokens(server, r) >= 2 for r in ("g/1", "g/10", "h/1/")))
        seen = {rid: tokens(server, rid) for rid in ("g/1", "g/10", "h/1/")}
        assert await server.take_back_requests(["g/1", "h/1/", "q/", "unknown/"]) == ["g/1", "h/1/", "q/"]
        out = {rid: await calls[rid] for rid in ("g/1", "g/10", "h/1/", "q/")}
        assert all(o.stop_reason == "abort" for o in out.values())
        assert [len(out[r].token_ids) for r in ("g/1", "g/10", "h/1/")] == [seen[r] + 1 for r in seen]
        assert out["q/"].token_ids == []
        assert len((await calls["h/10/"]).token_ids) == 40  # untouched

    run_virtual(main())


def test_unfixed_server_has_no_per_request_take_back():
    assert not hasattr(CpuSglangServer, "take_back_requests")
    assert hasattr(FixedCpuSglangServer, "take_back_requests")


def test_sglang_fix_is_applied_once_and_by_the_after_import_hook():
    class Server:
        async def generate(self, prompt_ids, sampling_params, request_id):
            return None

        async def abort_all_requests(self):
            return None

        async def resume_generation(self):
            return None

    module = SimpleNamespace(SGLangHttpServer=Server)
    sglang._fix_sglang_server(module)
    patched = Server.generate
    assert apply_sglang_server_fix(Server) is Server and Server.generate is patched
    assert hasattr(Server, "take_back_requests")


def test_cpu_sglang_backend_makes_sglang_resolve_to_the_double(monkeypatch):
    monkeypatch.setattr(RolloutReplicaRegistry, "_registry", dict(RolloutReplicaRegistry._registry))
    monkeypatch.setattr(rollout_base, "_ROLLOUT_REGISTRY", dict(rollout_base._ROLLOUT_REGISTRY))
    monkeypatch.setenv(cpu.CPU_SGLANG_ENV, "1")
    apply.install_sglang_support()
    assert RolloutReplicaRegistry.get("sglang") is CpuSglangReplica
    assert rollout_base._ROLLOUT_REGISTRY[("sglang", "async")] == cpu.CPU_SERVER_ADAPTER


def test_ray_sees_the_reject_request_parameter_of_the_fixed_abort_all():
    """Ray binds remote-call arguments against inspect.signature: the fixed method must accept reject_request there,
    or ``server.abort_all_requests.remote(reject_request=True)`` fails before reaching the server."""
    from ray._common.signature import extract_signature, flatten_args

    flatten_args(
        extract_signature(FixedCpuSglangServer.abort_all_requests, ignore_first=True), [], {"reject_request": True}
    )
    with pytest.raises(TypeError):
        flatten_args(
            extract_signature(CpuSglangServer.abort_all_requests, ignore_first=True), [], {"reject_request": True}
        )


# ------------------------------------------------------------------ verl's own SGLangHttpServer over the double
VERL_SGLANG_SERVER = "verl.workers.rollout.sglang_rollout.async_sglang_server"


class _StubModule(ModuleType):
    """A stand-in for one SGLang module: any name it is asked for is a placeholder class (SGLang's CUDA-only wheel
    cannot be installed here); the io_struct request types build what the double's TokenizerManager reads."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {})
        setattr(self, name, placeholder)
        return placeholder


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``sglang.*`` module as a :class:`_StubModule` package."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "sglang" or fullname.startswith("sglang."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        return None


@pytest.fixture
def verl_sglang_server(monkeypatch):
    """verl 0.9.1's real ``SGLangHttpServer`` class, imported over stub SGLang modules; verl-partial's plugin hook
    (``patches.apply.install_sglang_support``) applies the fix when the module is imported, as in production."""
    finder = _StubFinder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    before = set(sys.modules)
    sglang = importlib.import_module("sglang")
    sglang.__version__ = "0.5.12"
    io_struct = importlib.import_module("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = dict
    for request_type in ("PauseGenerationReqInput", "ContinueGenerationReqInput", "ReleaseMemoryOccupationReqInput"):
        setattr(io_struct, request_type, SimpleNamespace)
    apply.install_sglang_support()
    module = importlib.import_module(VERL_SGLANG_SERVER)
    yield module.SGLangHttpServer
    for name in set(sys.modules) - before:
        del sys.modules[name]


def verl_server(server_cls, demo_assets):
    """A ``SGLangHttpServer`` without its launch (no SGLang process): the attributes its request and control methods
    read, with the double's TokenizerManager over the engine with SGLang semantics."""
    double = make(demo_assets)
    server = object.__new__(server_cls)
    server.config, server.model_config = double.config, double.model_config
    server.config.max_model_len = double.max_model_len  # SGLangHttpServer.__init__ resolves a null one
    server.replica_rank, server.node_rank, server.global_steps = 0, 0, None
    server._disaggregation_role, server._pd_decode_peers = "null", []
    server.rollout_mode = RolloutMode.HYBRID
    server.tokenizer_manager = double.tokenizer_manager
    return server, double.engine


def test_verls_sglang_server_runs_over_the_double_with_the_fix(verl_sglang_server, demo_assets):
    """The plugin's after-import hook fixed verl's class; its generate, abort_all_requests, resume_generation and
    sleep then show what the double shows: "stop"/"length"/"abort", one more token at an abort, the rejecting gate,
    take-back by id, cancel stopping decoding, and the idle assert at sleep."""
    assert getattr(verl_sglang_server, "_verl_partial_sglang_fix", False)

    async def main():
        server, engine = verl_server(verl_sglang_server, demo_assets)
        stop = await server.generate(
            countdown(demo_assets), {"max_tokens": 256, "temperature": 0.0, "logprobs": True}, "stop/"
        )
        length = await server.generate(PROMPT, dict(LONG, max_tokens=3), "length/")
        assert (stop.stop_reason, length.stop_reason, len(length.token_ids)) == ("stop", "length", 3)
        running = asyncio.ensure_future(server.generate(PROMPT, dict(LONG), "run/"))
        await engine.wait_until(lambda: engine.tokens_so_far("run/") >= 4)
        with pytest.raises(AssertionError, match="idle"):
            await server.sleep()
        seen = engine.tokens_so_far("run/")
        await server.abort_all_requests(reject_request=True)
        aborted = await running
        assert (aborted.stop_reason, len(aborted.token_ids), len(aborted.log_probs)) == ("abort", seen + 1, seen + 1)
        late = await server.generate(PROMPT, dict(LONG), "late/")
        assert (late.token_ids, late.log_probs, late.stop_reason) == ([], None, "abort")
        await server.resume_generation()

        taken = asyncio.ensure_future(server.generate(PROMPT, dict(LONG), "take/"))
        cancelled = asyncio.ensure_future(server.generate(PROMPT, dict(LONG), "cancel/"))
        await engine.wait_until(lambda: engine.tokens_so_far("take/") >= 2 and engine.tokens_so_far("cancel/") >= 2)
        assert await server.take_back_requests(["take/", "gone/"]) == ["take/"]
        assert (await taken).stop_reason == "abort"
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        await engine.wait_until(lambda: engine.is_idle)
        await server.sleep()  # idle: the cancelled request was aborted, not left decoding

    run_virtual(main())


def test_rollout_ignore_eos_reaches_sglang_only_through_the_partial_worker(verl_sglang_server, demo_assets):
    """verl 0.9.1's SGLangHttpServer never passes ``rollout.ignore_eos`` to SGLang (its vLLM server does, by
    setdefault): with the flag set, the countdown still stops at its EOS. The partial worker's sampling params carry
    the flag, so the same call decodes its whole budget, as on vLLM."""
    from verl_partial.glue.partial.agent_loop import PartialAgentLoopWorker

    async def main():
        server, _ = verl_server(verl_sglang_server, demo_assets)
        server.config = dataclasses.replace(server.config, ignore_eos=True)
        worker = PartialAgentLoopWorker.__new__(PartialAgentLoopWorker)
        worker.rollout_config = server.config
        greedy = {"max_tokens": 64, "temperature": 0.0, "logprobs": True}
        verls = await server.generate(countdown(demo_assets), dict(greedy), "verl/")
        ours = await server.generate(countdown(demo_assets), {**worker.sampling_params(), **greedy}, "ours/")
        return verls, ours

    verls, ours = run_virtual(main())
    assert verls.stop_reason == "stop" and len(verls.token_ids) < 64
    assert (ours.stop_reason, len(ours.token_ids)) == ("length", 64)
    assert ours.token_ids[: len(verls.token_ids)] == verls.token_ids  # the same greedy answer, continued past its EOS
