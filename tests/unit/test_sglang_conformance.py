"""The conformance tier: SGLang's own code, executed from its 0.5.12 (verl 0.9.1's pin) and 0.5.23 wheels, beside the
hand-written double (``cpu_backend.rollout``'s SGLang mode) and under verl-partial's server fix.

* The double agrees with 0.5.12's own functions on queued, running, finished and aborted requests: what the caller
  gets, whether the tokenizer's ``rid_to_state`` still holds the request, whether the tokenizer dies; and on
  ``Req.check_finished``'s finish types over every short token run.
* Findings 1 and 2 (issue 26) shown on the wheel's code and fixed: a cancelled queued call killed 0.5.12's tokenizer
  (the state was deleted before the abort's echo), and every call taken back while queued leaked its state. On
  0.5.23's code neither happens, with or without the fix: the harness executes the wheel it names.
* 0.5.12's abort misses a request between two chunks of its prefill; the fix's re-sent abort ends it, and ``sleep``
  waits for that instead of tripping ``release_memory_occupation``'s idle assert.
* Every ``file@version:lines "fragment"`` citation in the double and the glue is found in that wheel at those lines,
  and no SGLang file is cited there without one.

``nox -s tests`` downloads the wheels and requires them; plain ``pytest`` without them skips this tier.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path

import pytest
import test_sglang_server as server_tests
from sglang_wheel import CITATION, PINNED, REPO, VERSIONS, Outcome, Wheel, WheelSglang

from verl_partial.cpu_backend.engine import EngineRequest, SamplingParams
from verl_partial.cpu_backend.rollout import _SGLANG_FINISH_TYPE, CpuSglangServer
from verl_partial.sim.clock import run_virtual

pytestmark = pytest.mark.sglang
make, verl_server = server_tests.make, server_tests.verl_server
verl_sglang_server = server_tests.verl_sglang_server  # the fixture: verl's own SGLangHttpServer, fixed by the hook

EOS, OTHER = 2, 7
CITING_FILES = ("verl_partial/cpu_backend/rollout.py", "verl_partial/cpu_backend/engine.py",
                "verl_partial/glue/engines/sglang.py")  # fmt: skip
SGLANG_FILES = re.compile(
    r"\b(tokenizer_manager|scheduler|schedule_batch|scheduler_update_weights_mixin|scheduler_output_processor_mixin"
    r"|io_struct|sampling_params)\.py\b(?!@)"
)


@pytest.fixture(scope="module", params=VERSIONS)
def wheel(request) -> Wheel:
    return Wheel(request.param)


@pytest.fixture(scope="module")
def wheels() -> dict[str, Wheel]:
    return {version: Wheel(version) for version in VERSIONS}


# ------------------------------------------------------------------ finish rules: Req.check_finished vs the double
def wheel_finish(sglang: WheelSglang, max_new: int, ignore_eos: bool, tokens: tuple[int, ...], abort_at: int | None):
    req = sglang.Req("r", max_new, {EOS}, ignore_eos)
    for i, token in enumerate(tokens):
        if i == abort_at:
            req.to_finish = sglang.finish_types["FINISH_ABORT"]()
        req.output_ids.append(token)
        req.update_finish()
        if req.finished():
            kept = len(req.output_ids) if req.finished_len is None else req.finished_len
            return req.finished_reason.to_json()["type"], kept
    return None


def double_finish(engine, max_new: int, ignore_eos: bool, tokens: tuple[int, ...], abort_at: int | None):
    request = EngineRequest("r", [1], SamplingParams(max_tokens=max_new, ignore_eos=ignore_eos), None, None)
    for i, token in enumerate(tokens):
        if i == abort_at:
            request.to_finish = True
        request.token_ids.append(token)
        request.log_probs.append(0.0)
        reason = engine._check_finished(request, token)
        if reason is not None:
            return _SGLANG_FINISH_TYPE[reason], len(request.token_ids)
    return None


def finish_cases():
    for max_new, ignore_eos in itertools.product((1, 2, 3), (False, True)):
        for length in range(1, max_new + 1):
            for tokens in itertools.product((EOS, OTHER), repeat=length):
                for abort_at in (None, *range(length)):
                    yield max_new, ignore_eos, tokens, abort_at


def test_check_finished_and_finish_types_agree_with_the_double(wheels, demo_assets):
    """0.5.12's ``Req.check_finished`` and finish types against the double's engine over every run of EOS/other tokens
    up to 3, with and without ignore_eos and an abort before any token: identical. 0.5.23's ``update_finish_state``
    differs exactly where it checks EOS before the length cap (an EOS as the last allowed token: "stop", not
    "length")."""
    engine = make(demo_assets, CpuSglangServer).engine
    engine.eos_token_ids = frozenset({EOS})
    pinned, newest = WheelSglang(wheels[PINNED]), WheelSglang(wheels["0.5.23"])
    cases = list(finish_cases())
    differ_0523 = []
    for case in cases:
        expected = double_finish(engine, *case)
        assert wheel_finish(pinned, *case) == expected, case
        if wheel_finish(newest, *case) != expected:
            differ_0523.append(case)
    eos_at_cap = [
        (max_new, ignore_eos, tokens, abort_at)
        for max_new, ignore_eos, tokens, abort_at in cases
        if not ignore_eos
        and len(tokens) == max_new
        and abort_at is None
        and tokens[-1] == EOS
        and EOS not in tokens[:-1]
    ]
    assert len(cases) > 100 and differ_0523 == eos_at_cap


# ------------------------------------------------------------------ the request table: the wheel vs the double
async def wheel_outcomes(wheel: Wheel) -> dict[str, Outcome]:
    """Queued, running and finished requests on the wheel's tokenizer and scheduler code (one running slot)."""
    sglang = WheelSglang(wheel, max_running=1)
    sglang.submit("run/", 16)
    sglang.submit("queued/", 16)
    sglang.step()
    sglang.step()
    queued, running = sglang.tm.rid_to_state["queued/"], sglang.tm.rid_to_state["run/"]
    sglang.tm.abort_request("queued/")
    await sglang.pump()
    outcomes = {"queued": sglang.outcome("queued/", queued)}
    sglang.tm.abort_request("run/")
    sglang.step()
    await sglang.pump()
    outcomes["running"] = sglang.outcome("run/", running)
    outcomes["running"].tokens -= 2  # tokens after the abort
    sglang.submit("length/", 3)
    length = sglang.tm.rid_to_state["length/"]
    for _ in range(3):
        sglang.step()
    await sglang.pump()
    outcomes["length"] = sglang.outcome("length/", length)
    sglang.tm.abort_request("unknown/")  # not in the table: nothing is sent
    assert not sglang._inbox
    return outcomes


async def double_outcomes(demo_assets) -> dict[str, Outcome]:
    """The same on the double (``CpuSglangServer``'s TokenizerManager over the engine, one running slot)."""
    server = make(demo_assets, CpuSglangServer, max_num_seqs=1)
    tm, engine = server.tokenizer_manager, server.engine

    def request(rid: str, max_new_tokens: int) -> asyncio.Future:
        obj = {"rid": rid, "input_ids": [3, 17, 29], "sampling_params": {"max_new_tokens": max_new_tokens,
               "ignore_eos": True}}  # fmt: skip
        return asyncio.ensure_future(tm.generate_request(obj).__anext__())

    def outcome(rid: str, out: dict) -> Outcome:
        finish = out["meta_info"]["finish_reason"]["type"]
        return Outcome(len(out["output_ids"]), finish, rid in tm.rid_to_state, tm.died is not None)

    run, queued = request("run/", 16), request("queued/", 16)
    await engine.wait_until(lambda: engine.tokens_so_far("run/") >= 2)
    seen = engine.tokens_so_far("run/")
    tm.abort_request("queued/")
    outcomes = {"queued": outcome("queued/", await queued)}
    tm.abort_request("run/")
    outcomes["running"] = outcome("run/", await run)
    outcomes["running"].tokens -= seen
    outcomes["length"] = outcome("length/", await request("length/", 3))
    return outcomes


def test_request_table_agrees_with_the_double_on_queued_running_and_finished(wheel, demo_assets):
    """Queued abort: no tokens, "abort", and 0.5.12 keeps the state (the leak) where 0.5.23 deletes it; running abort:
    one more token, "abort", state deleted; a length finish: state deleted. The double is 0.5.12."""
    from_wheel = asyncio.run(wheel_outcomes(wheel))
    from_double = run_virtual(double_outcomes(demo_assets))
    assert from_wheel["running"] == from_double["running"] == Outcome(1, "abort", False, False)
    assert from_wheel["length"] == from_double["length"] == Outcome(3, "length", False, False)
    assert from_double["queued"] == Outcome(0, "abort", True, False)
    assert from_wheel["queued"] == Outcome(0, "abort", wheel.version == PINNED, False)


async def delete_before_echo_on_the_wheel(wheel: Wheel) -> Outcome:
    sglang = WheelSglang(wheel, max_running=1)
    sglang.submit("run/")
    sglang.submit("queued/")
    sglang.step()
    sglang.tm.abort_request("queued/")
    sglang.tm.rid_to_state.pop("queued/")  # verl-partial's cancel before the fix: the state goes before the echo
    await sglang.pump()
    return Outcome(None, None, "queued/" in sglang.tm.rid_to_state, sglang.crash is not None)


def test_deleting_a_queued_state_before_the_abort_echo_kills_0512_on_the_wheel_and_the_double(wheel, demo_assets):
    """tokenizer_manager.py@0.5.12:2420 indexes the table without a guard: a KeyError in handle_loop, the server dies.
    0.5.23 guards it (``rid_to_state.get``). The double dies the same way on 0.5.12's order of events."""
    assert asyncio.run(delete_before_echo_on_the_wheel(wheel)).crashed == (wheel.version == PINNED)

    async def on_the_double():
        server = make(demo_assets, CpuSglangServer, max_num_seqs=1)
        tm = server.tokenizer_manager
        obj = {"rid": "run/", "input_ids": [3, 17], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        run = asyncio.ensure_future(tm.generate_request(obj).__anext__())
        queued = asyncio.ensure_future(tm.generate_request(dict(obj, rid="queued/")).__anext__())
        await server.engine.wait_until(lambda: server.engine.tokens_so_far("run/") >= 1)
        tm.abort_request("queued/")
        tm.rid_to_state.pop("queued/")
        await asyncio.gather(run, queued, return_exceptions=True)
        return tm.stats().died

    if wheel.version == PINNED:
        assert run_virtual(on_the_double())


# ------------------------------------------------------------------ findings 1 and 2 through verl's server + the fix
def verl_over_the_wheel(server_cls, demo_assets, wheel: Wheel) -> tuple[object, WheelSglang]:
    """verl 0.9.1's ``SGLangHttpServer`` (fixed by the plugin's hook) whose tokenizer manager runs the wheel's code."""
    server, _ = verl_server(server_cls, demo_assets)
    sglang = WheelSglang(wheel, max_running=1)
    server.tokenizer_manager = sglang.tm
    return server, sglang


PARAMS = {"max_tokens": 16, "ignore_eos": True}


def test_cancelling_a_queued_call_does_not_kill_sglang(verl_sglang_server, demo_assets, wheel):
    """Finding 1: Ray cancels a call whose request waits in SGLang's queue. The fix aborts it and keeps its state
    until the scheduler's echo is handled, then drops it: no KeyError, no leak (before: 0.5.12 died)."""

    async def main():
        server, sglang = verl_over_the_wheel(verl_sglang_server, demo_assets, wheel)
        running = asyncio.ensure_future(server.generate([3, 17], dict(PARAMS), "run/"))
        queued = asyncio.ensure_future(server.generate([3, 17], dict(PARAMS), "queued/"))
        await asyncio.sleep(0)
        sglang.step()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        await sglang.pump()  # the echo of the queued request's abort
        await asyncio.sleep(0.01)
        assert sglang.crash is None, f"SGLang {wheel.version}'s tokenizer died: {sglang.crash!r}"
        assert "queued/" not in sglang.tm.rid_to_state
        for _ in range(16):
            sglang.step()
        await sglang.pump()
        assert len((await running).token_ids) == 16 and sglang.tm.rid_to_state == {}

    run_virtual(main())


def test_a_call_taken_back_while_queued_leaves_no_state(verl_sglang_server, demo_assets, wheel):
    """Finding 2: ``take_back_requests`` on a queued call. The caller gets no tokens and "abort"; 0.5.12 leaves the
    finished state in its table forever, the fix drops it when the call returns (before: one entry leaked per call)."""

    async def main():
        server, sglang = verl_over_the_wheel(verl_sglang_server, demo_assets, wheel)
        running = asyncio.ensure_future(server.generate([3, 17], dict(PARAMS), "run/"))
        queued = [asyncio.ensure_future(server.generate([3, 17], dict(PARAMS), f"q{i}/")) for i in range(3)]
        await asyncio.sleep(0)
        sglang.step()
        assert await server.take_back_requests(["q0/", "q1/", "q2/"]) == ["q0/", "q1/", "q2/"]
        await sglang.pump()
        for call in queued:
            output = await call
            assert (output.token_ids, output.stop_reason) == ([], "abort")
        assert sorted(sglang.tm.rid_to_state) == ["run/"] and sglang.crash is None
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        sglang.step()
        await sglang.pump()
        await asyncio.sleep(0.01)
        assert sglang.tm.rid_to_state == {}

    run_virtual(main())


def test_an_abort_that_misses_a_chunked_prefill_is_resent_and_sleep_waits(verl_sglang_server, demo_assets, wheels):
    """0.5.12's ``Scheduler.abort_request`` (the wheel's) does not find a request between two chunks of its prefill
    (held in ``chunked_req``, in neither batch it searches). The fix re-sends the abort every ``ABORT_RESEND_S`` until
    it is answered; ``sleep`` waits for that answer instead of tripping the idle assert (before: the state was
    dropped at once, nothing re-sent the abort, and ``release_memory_occupation`` asserted)."""
    from verl_partial.glue.engines import sglang as sglang_server

    resend_s = getattr(sglang_server, "ABORT_RESEND_S", 1.0)  # SGLang's own poll where the glue has none

    async def main():
        server, sglang = verl_over_the_wheel(verl_sglang_server, demo_assets, wheels[PINNED])
        call = asyncio.ensure_future(server.generate([3, 17], dict(PARAMS), "chunked/"))
        await asyncio.sleep(0)
        scheduler = sglang.scheduler
        req = scheduler.chunked_req = scheduler.waiting_queue.pop(0)  # its prefill spans chunks
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert req.to_finish is None and scheduler.chunked_req is req  # the abort missed it
        sleeping = asyncio.ensure_future(server.sleep())
        await asyncio.sleep(resend_s / 2)
        assert not sleeping.done(), "sleep did not wait for the cancelled request"
        scheduler.chunked_req = None  # the last chunk: the request joins the running batch
        scheduler.running_batch.reqs.append(req)
        await asyncio.sleep(resend_s)  # the re-sent abort finds it
        assert req.to_finish is not None
        sglang.step()  # one more token, then "abort"
        await sglang.pump()
        await sleeping  # idle: release_memory_occupation did not assert
        assert sglang.tm.rid_to_state == {} and sglang.crash is None

    run_virtual(main())


def test_a_call_cancelled_before_its_send_is_dropped_at_once(verl_sglang_server, demo_assets, wheel):
    """A state never sent to the scheduler (parked at the pause gate, or tokenizing) gets no echo and no output: the
    fix drops it at once, as 0.5.23's own cleanup does with undelivered states."""
    from verl_partial.glue.engines.sglang import _cancel

    async def main():
        server, sglang = verl_over_the_wheel(verl_sglang_server, demo_assets, wheel)
        sglang.tm._init_req_state(type("Obj", (), {"rid": "parked/", "is_single": True, "received_time": 0.0})())
        _cancel(server, "parked/")
        assert sglang.tm.rid_to_state == {} and not sglang._inbox

    run_virtual(main())


def test_a_second_abort_and_a_chunked_prefill_on_each_version(wheel):
    """0.5.12 sends every abort of an id it holds and its scheduler misses a request mid chunked prefill, so the fix's
    re-sends are what end it; 0.5.23 ignores a second abort of the same id (``abort_sent``) and its scheduler marks
    the chunked request itself (``_pending_chunked_abort_req``), so the re-sends are harmless there."""
    sglang = WheelSglang(wheel, max_running=1)
    sglang.submit("chunked/")
    req = sglang.scheduler.chunked_req = sglang.scheduler.waiting_queue.pop(0)
    sglang.tm.abort_request("chunked/")
    sglang.tm.abort_request("chunked/")
    pinned = wheel.version == PINNED
    assert sglang.sent_aborts == (["chunked/", "chunked/"] if pinned else ["chunked/"])
    assert req.to_finish is None
    assert sglang.scheduler._pending_chunked_abort_req is (None if pinned else req)


# ------------------------------------------------------------------ citations
def citations() -> list[tuple[str, re.Match]]:
    found = []
    for name in CITING_FILES:
        text = (REPO / name).read_text()
        # vLLM's citations carry their ``vllm/`` path and are checked against vLLM's wheel (test_vllm_citations.py).
        found += [(name, match) for match in CITATION.finditer(text) if not match["file"].startswith("vllm/")]
    return found


def test_every_citation_of_sglang_is_found_at_its_lines_in_its_wheel(wheels):
    """``file@version:lines "fragment"``: the fragment appears in that wheel's file within those lines."""
    found = citations()
    assert len(found) >= 30
    for name, match in found:
        wheel = wheels[match["version"]]
        first = int(match["first"])
        last = int(match["last"] or first)
        text = " ".join(wheel.lines(match["file"], first, last).split())
        assert " ".join(match["fragment"].split()) in text, f"{name}: {match.group(0)!r} not at those lines"


def test_no_sglang_file_is_cited_without_version_and_lines():
    for name in CITING_FILES:
        text = Path(REPO / name).read_text()
        bare = [m.group(0) for m in SGLANG_FILES.finditer(text)]
        assert not bare, f"{name} cites SGLang's {bare} without @version:lines"
