"""The glue's pure parts: engine adapters, hand-over chunking, start-up refusals of configs that would corrupt samples.

The segment path itself (Ray streaming, cancel at the server, hand-over by verl's workers) is exercised end to end
in ``tests/e2e/test_partial_e2e.py`` and ``tests/e2e/test_partial_abort_e2e.py``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_plugin_and_config import compose

from verl_partial.config.job import validate_root_config
from verl_partial.core.engines.adapter import engine_adapter
from verl_partial.core.partial.finish import Finish
from verl_partial.glue.partial.rollout import _chunk_bounds


class _RemoteMethod:
    """A Ray actor method as the adapter uses it (``.remote(...)`` returns an awaitable), recording each call."""

    def __init__(self, calls: list[tuple[str, tuple, dict]], name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return asyncio.sleep(0)


class RecordingServer:
    """Records the control calls the adapter sends to one server actor (the server is not what is under test)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> _RemoteMethod:
        return _RemoteMethod(self.__dict__["calls"], name)


class Replica:
    def __init__(self, servers: int) -> None:
        self.servers = [RecordingServer() for _ in range(servers)]


@pytest.mark.parametrize(("engine", "controlled"), [("vllm", 2), ("cpu", 2), ("sglang", 1)])
def test_each_engine_closes_its_gates_rejecting_late_arrivals(engine, controlled):
    """Every engine's gate refuses late arrivals at the step end (SGLang's through verl_partial.glue.engines.sglang);
    SGLang takes control calls on a replica's first server only (verl's SGLangReplica), vLLM and ours on each."""
    adapter = engine_adapter(engine)
    replicas = [Replica(2), Replica(2)]

    async def abort_then_resume() -> None:
        for replica in replicas:
            await asyncio.gather(*adapter.abort_calls(replica))
            await asyncio.gather(*adapter.resume_calls(replica))

    asyncio.run(abort_then_resume())
    expected = [("abort_all_requests", (), {"reject_request": True}), ("resume_generation", (), {})]
    for replica in replicas:
        assert [server.calls for server in replica.servers] == [expected] * controlled + [[]] * (2 - controlled)


@pytest.mark.parametrize("engine", ["vllm", "cpu", "sglang"])
def test_taking_back_is_one_call_per_server_by_request_id(engine):
    server = RecordingServer()
    asyncio.run(engine_adapter(engine).take_back(server, ["g/0/1#", "g/1/0#"]))
    assert server.calls == [("take_back_requests", (["g/0/1#", "g/1/0#"],), {})]


def test_each_engine_maps_its_own_stop_reasons():
    eos = {7}
    # Token ids as the servers return them (lists). SGLang says "stop" for an EOS; vLLM (and ours) say "completed"
    # for EOS and budget alike.
    assert engine_adapter("sglang").finish("stop", [3, 7], 8, eos) is Finish.EOS
    assert engine_adapter("vllm").finish("completed", [3, 7], 2, eos) is Finish.EOS
    assert engine_adapter("cpu").finish("completed", [3, 4], 2, eos) is Finish.LENGTH
    with pytest.raises(ValueError, match="SGLang"):
        engine_adapter("sglang").finish("completed", [3], 8, eos)


def test_an_engine_we_have_not_read_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name"):
        engine_adapter("trtllm")


@pytest.mark.parametrize("workers", [1, 3, 8, 20])
def test_hand_over_chunks_cover_every_row_and_never_cut_a_group(workers):
    keys = np.array([key for key, n in (("a", 4), ("b", 4), ("c", 4), ("d", 4), ("e", 4)) for _ in range(n)])
    bounds = _chunk_bounds(keys, workers)
    assert len(bounds) == min(workers, 5)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(keys)
    assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False))
    for start, stop in bounds:
        assert start < stop
        assert start == 0 or keys[start] != keys[start - 1], "a chunk starts inside a group"


def test_max_model_len_below_prompt_plus_response_is_refused_at_start_up():
    config = compose(
        "backend/cpu",
        "partial/default",
        data__max_prompt_length=1024,
        data__max_response_length=16384,
        actor_rollout_ref__rollout__max_model_len=16384,
    )
    with pytest.raises(ValueError) as refused:
        validate_root_config(config)
    message = str(refused.value)
    for key in ("actor_rollout_ref.rollout.max_model_len", "data.max_prompt_length", "data.max_response_length"):
        assert key in message
    validate_root_config(compose("backend/cpu", "partial/default", actor_rollout_ref__rollout__max_model_len=None))


def test_a_rollout_engine_without_a_finish_mapping_is_refused_with_partial():
    config = compose("backend/cpu", "partial/default", actor_rollout_ref__rollout__name="trtllm")
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name must be one of"):
        validate_root_config(config)
