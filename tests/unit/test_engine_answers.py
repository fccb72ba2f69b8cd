"""Engines as they are (issue 26): what the worker keeps of a server's answer -- a speculative run is cut at its
first EOS, tokens AND log-probs, before it is parked or trained (finding 6) -- and the model-length check, which is
made wherever the model's config can be read, never skipped (finding 7).

The worker under test is verl-partial's real ``PartialAgentLoopWorker._generate``; only its server is a stand-in,
answering with the TokenOutput shapes verl 0.9.1's servers build.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_plugin_and_config import compose
from verl.workers.rollout.replica import TokenOutput

from verl_partial.config.job import model_max_positions, validate_root_config
from verl_partial.core.engines.adapter import engine_adapter
from verl_partial.core.partial.finish import Finish, eos_id_set
from verl_partial.glue.partial.agent_loop import (
    PartialAgentLoopWorker,
    SegmentCall,
    answer_end_ids,
    check_loaded_model_len,
)

EOS = 151645


class _Generate:
    def __init__(self, output: TokenOutput) -> None:
        self.output = output

    def remote(self, **_: object):
        async def answer() -> TokenOutput:
            return self.output

        return answer()


class SpeculativeServer:
    """Answers every call with one fixed run, as a speculative engine returns it after an abort."""

    def __init__(self, output: TokenOutput) -> None:
        self.generate = _Generate(output)


def worker_for(engine: str, server: SpeculativeServer) -> PartialAgentLoopWorker:
    """The real worker class with only the state ``_generate`` reads (verl's AgentLoopWorker needs a cluster)."""
    worker = PartialAgentLoopWorker.__new__(PartialAgentLoopWorker)
    worker.engine = engine_adapter(engine)
    worker.eos_from_model = eos_id_set(EOS)
    worker.servers = {"s0": server}
    worker.sent = {}
    worker.transit_delay_s = 0.0
    return worker


@pytest.mark.parametrize(("engine", "reason"), [("sglang", "abort"), ("sglang", "length"), ("vllm", "aborted")])
def test_a_run_with_an_eos_inside_is_parked_cut_at_the_eos_and_finished(engine, reason):
    """Before the fix the worker kept [5, EOS, 6, 7] with 4 log-probs and reported ABORTED/LENGTH: the sample was
    resumed after its EOS and trained on tokens past the answer's end."""
    output = TokenOutput(token_ids=[5, EOS, 6, 7], log_probs=[-0.1, -0.2, -0.3, -0.4], stop_reason=reason)
    worker = worker_for(engine, SpeculativeServer(output))
    call = SegmentCall("g/0/0#", "s0", "g", np.zeros(0, np.int32), 4, prompt_ids=np.array([1, 2], np.int32))
    answer = asyncio.run(worker._generate(call, {"temperature": 1.0}))
    assert answer.finish is Finish.EOS
    assert answer.new_ids.tolist() == [5, EOS]
    assert answer.new_log_probs.tolist() == pytest.approx([-0.1, -0.2])


@pytest.mark.parametrize(("engine", "reason"), [("sglang", "length"), ("vllm", "completed")])
def test_under_ignore_eos_a_run_through_eos_is_kept_whole(engine, reason):
    """``rollout.ignore_eos=true``: the engine decoded through the EOS on purpose, and verl's own loop trains the whole
    run. Before the fix the worker still cut at the first EOS (answers of 4-36 tokens where 144 were decoded)."""
    output = TokenOutput(token_ids=[5, EOS, 6, 7], log_probs=[-0.1, -0.2, -0.3, -0.4], stop_reason=reason)
    worker = worker_for(engine, SpeculativeServer(output))
    worker.eos_from_model = answer_end_ids(True, EOS, [EOS, 151643])
    call = SegmentCall("g/0/0#", "s0", "g", np.zeros(0, np.int32), 4, prompt_ids=np.array([1, 2], np.int32))
    answer = asyncio.run(worker._generate(call, {"temperature": 1.0}))
    assert answer.finish is Finish.LENGTH
    assert answer.new_ids.tolist() == [5, EOS, 6, 7]
    assert answer_end_ids(False, EOS, [EOS, 151643]) == {EOS, 151643}


# ---------------------------------------------------------------- issue 26, finding 7: the model-length check


def _model_dir(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_driver_reads_max_positions_under_text_config_as_verl_does(tmp_path):
    """A multimodal model keeps max_position_embeddings under text_config (verl's get_max_position_embeddings looks
    there); the old reader saw no top-level key and skipped the check silently."""
    path = _model_dir(tmp_path, {"model_type": "llava", "text_config": {"model_type": "llama",
                                                                         "max_position_embeddings": 4096}})  # fmt: skip
    assert model_max_positions(path) == 4096
    config = compose("backend/cpu", "partial/default", actor_rollout_ref__model__path=path,
                     data__max_prompt_length=1024, data__max_response_length=4096,
                     actor_rollout_ref__rollout__max_model_len=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"the model's max_position_embeddings \(4096\)"):
        validate_root_config(config)


def test_the_driver_reads_a_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    """A hub id is read from the HF cache (local files only), like a folder; the old reader skipped every hub id."""
    repo = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 2048}))
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_max_positions("org/tiny") == 2048


class _RolloutConfig:
    def __init__(self, max_model_len):
        self.max_model_len, self.prompt_length, self.response_length, self.name = max_model_len, 1024, 4096, "vllm"


def test_a_model_config_the_driver_cannot_read_is_checked_in_the_worker_on_verls_loaded_config():
    """Where the driver cannot read the config (a hub id not downloaded yet), the worker checks the one verl
    loaded (HFModelConfig.hf_config) at its start: the check is made later, never skipped."""
    assert model_max_positions("org/not-downloaded-model") is None
    loaded = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=4096))
    with pytest.raises(ValueError, match=r"the model's max_position_embeddings \(4096\)"):
        check_loaded_model_len(_RolloutConfig(None), loaded)
    check_loaded_model_len(_RolloutConfig(8192), loaded)  # an explicit max_model_len wins, as on the servers
    check_loaded_model_len(_RolloutConfig(None), SimpleNamespace(max_position_embeddings=8192))
