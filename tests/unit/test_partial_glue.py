"""The glue's pure parts: engine adapters, hand-over chunking and rows, start-up refusals of configs that would corrupt
samples.

The segment path itself (Ray streaming, cancel at the server, hand-over by verl's workers) is exercised end to end
in ``tests/e2e/test_partial_e2e.py`` and ``tests/e2e/test_partial_abort_e2e.py``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from test_plugin_and_config import compose
from verl import DataProto

from verl_partial.config.job import validate_root_config
from verl_partial.core.engines.adapter import engine_adapter
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import SampleState
from verl_partial.glue.dataproto import (
    PARTIAL_KEY,
    POLICY_VERSION_KEY,
    STEP_META_KEY,
    attach_versions,
    concat_chunks,
    group_keys,
    hand_over_rows,
    is_validation,
    pop_step_meta,
    row_chunks,
    row_fields,
    set_hand_over_meta,
)
from verl_partial.glue.partial.rollout import worker_runs


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
    assert engine_adapter("sglang").finish("stop", [3, 7], 8, eos).finish is Finish.EOS
    assert engine_adapter("vllm").finish("completed", [3, 7], 2, eos).finish is Finish.EOS
    assert engine_adapter("cpu").finish("completed", [3, 4], 2, eos).finish is Finish.LENGTH
    with pytest.raises(ValueError, match="SGLang"):
        engine_adapter("sglang").finish("completed", [3], 8, eos)


def test_an_engine_we_have_not_read_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name"):
        engine_adapter("trtllm")


def test_hand_over_calls_follow_runs_of_rows_on_one_worker_and_cover_every_row():
    """One call per run of consecutive rows a worker holds: one per worker when the loader orders groups by worker,
    more (never a wrong row) when a trainer reorders them."""
    assert worker_runs([0, 0, 0, 1, 1, 2]) == [(0, 0, 3), (1, 3, 5), (2, 5, 6)]
    assert worker_runs([1, 1, 0, 0, 1]) == [(1, 0, 2), (0, 2, 4), (1, 4, 5)]
    assert worker_runs([]) == []


def test_hand_over_rows_are_the_prompts_without_our_key_cut_into_the_workers_chunks():
    keys = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    prompts = DataProto.from_dict(
        tensors={"input_ids": torch.arange(12).reshape(6, 2)},
        non_tensors={PARTIAL_KEY: keys, "uid": np.array([f"u{i}" for i in range(6)], dtype=object)},
        meta_info={"global_steps": 3},
    )
    assert group_keys(prompts) is keys and not is_validation(prompts)
    rows = hand_over_rows(prompts)
    assert set(rows.non_tensor_batch) == {"uid"} and rows.meta_info == {}
    assert PARTIAL_KEY in prompts.non_tensor_batch, "the trainer's batch keeps its own columns"
    assert rows.batch["input_ids"].data_ptr() == prompts.batch["input_ids"].data_ptr()
    chunks = row_chunks(rows, [(start, stop) for _, start, stop in worker_runs([0, 0, 0, 0, 1, 1])])
    assert [len(chunk) for chunk in chunks] == [4, 2]
    fields, per_row = row_fields(chunks[1], 2)
    assert fields is chunks[1].non_tensor_batch and per_row == [{"uid": "u4"}, {"uid": "u5"}]
    with pytest.raises(ValueError, match="hand-over of 3 samples for 2 rows"):
        row_fields(chunks[1], 3)
    plain = DataProto.from_dict(non_tensors={"uid": np.array(["x"], dtype=object)})
    assert group_keys(plain) is None
    plain.meta_info["validate"] = True
    assert is_validation(plain)


def test_hand_over_output_carries_per_token_versions_and_our_step_payload():
    def chunk(rows: int, tag: str) -> DataProto:
        return DataProto.from_dict(
            tensors={"responses": torch.zeros(rows, 4, dtype=torch.long)},
            meta_info={"metrics": [{"tag": tag}] * rows, "reward_extra_keys": []},
        )

    output, row_metrics = concat_chunks([chunk(2, "w0"), chunk(1, "w1")])
    assert len(output) == 3 and row_metrics == [[{"tag": "w0"}] * 2, [{"tag": "w1"}]]
    single = SampleState(versions=np.array([4, 5], dtype=np.int32))
    turns = SampleState(
        versions=np.array([5], dtype=np.int32), payload={"versions": np.array([5, -1, -1, 5, 5, 5], dtype=np.int32)}
    )
    attach_versions(output, [single, turns, SampleState()], response_length=4)
    assert output.batch[POLICY_VERSION_KEY].dtype == torch.int32
    assert output.batch[POLICY_VERSION_KEY].tolist() == [[4, 5, -1, -1], [5, -1, -1, 5], [-1, -1, -1, -1]]
    set_hand_over_meta(output, {"agent_loop/x": 1.0}, {"version": 4})
    assert set(output.meta_info) == {"reward_extra_keys", "timing", STEP_META_KEY}
    assert pop_step_meta(output) == {"version": 4} and pop_step_meta(output) is None


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
