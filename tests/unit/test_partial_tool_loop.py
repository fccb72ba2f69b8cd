"""verl's ToolAgentLoop, run whole by verl and run segment by segment by ``PartialToolAgentLoop`` -- parked after
every segment (through a pickled checkpoint) mid model turn and between turns -- produces the same trajectory:
prompt ids, response ids, response mask, turn count and log-probs, with every tool call run exactly once.

Both loops are real verl classes on the real CPU rollout server (in-process, no Ray) with the demo's tool-use
model and calculator; decoding is greedy so the two runs are comparable token for token.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.tool_registry import initialize_tools_from_config
from verl.utils import hf_tokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.config import HFModelConfig, RolloutConfig

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.finish import eos_id_set
from verl_partial.core.partial.trajectory import Phase, Trajectory
from verl_partial.cpu_backend.rollout import CpuRolloutServer
from verl_partial.demo.assets import TOOL_CONFIG_PATH, tool_overrides
from verl_partial.demo.tools import TOOL_LOG_ENV
from verl_partial.glue.partial.tool_loop import PartialToolAgentLoop

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
PROMPTS = 8


class ServerManager:
    """verl's server-manager interface over one in-process CPU server (what the loops call ``generate`` on)."""

    def __init__(self, server: CpuRolloutServer) -> None:
        self.server = server

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any):
        return await self.server.generate(prompt_ids=prompt_ids, sampling_params=sampling_params, request_id=request_id)


def trainer_config(assets, response_length: int) -> DictConfig:
    import verl

    overrides = [
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"data.max_prompt_length={assets.max_prompt_length}",
        f"data.max_response_length={response_length}",
        "actor_rollout_ref.rollout.name=cpu",
        *tool_overrides(),
    ]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def make_loop(cls, config: DictConfig, server: CpuRolloutServer, tokenizer, tools):
    return cls(
        trainer_config=DictConfigWrap(config),
        server_manager=ServerManager(server),
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        hf_model_type="qwen2",
        tools=ToolListWrap(tools),
    )


def tool_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# "short": a tool call fits in the response but its output does not; verl then ends the trajectory (2 turns)
# without the output, and so must the parked run.
@pytest.mark.parametrize(("response_length", "most_turns"), [(None, (4, 6)), (28, (2, 2))], ids=["full", "short"])
def test_segmented_parked_run_equals_verls_tool_loop(
    demo_tool_assets, tmp_path, monkeypatch, response_length, most_turns
):
    torch.set_num_threads(1)
    response_length = response_length or demo_tool_assets.max_response_length
    config = trainer_config(demo_tool_assets, response_length)
    rollout = RolloutConfig(
        name="cpu", prompt_length=demo_tool_assets.max_prompt_length, response_length=response_length, max_num_seqs=4
    )
    server = CpuRolloutServer(rollout, HFModelConfig(path=str(demo_tool_assets.model_dir)), replica_rank=0)
    tokenizer = hf_tokenizer(str(demo_tool_assets.model_dir))
    eos_ids = eos_id_set(tokenizer.eos_token_id, server.engine.eos_token_ids)
    rows = pd.read_parquet(demo_tool_assets.val_parquet).head(PROMPTS)
    partial_config = PartialConfig(chunk_tokens=3)
    verl_log, partial_log = tmp_path / "verl.jsonl", tmp_path / "partial.jsonl"

    async def main() -> None:
        turns, phases = [], []
        for index, row in enumerate(rows.itertuples()):
            kwargs = {"raw_prompt": list(row.prompt), "extra_info": dict(row.extra_info), "tools_kwargs": {}}
            monkeypatch.setenv(TOOL_LOG_ENV, str(verl_log))
            tools = initialize_tools_from_config(str(TOOL_CONFIG_PATH))
            whole = await make_loop(ToolAgentLoop, config, server, tokenizer, tools).run(dict(GREEDY), **kwargs)

            monkeypatch.setenv(TOOL_LOG_ENV, str(partial_log))
            tools = initialize_tools_from_config(str(TOOL_CONFIG_PATH))
            loop = make_loop(PartialToolAgentLoop, config, server, tokenizer, tools)
            traj = await loop.start(**kwargs)
            version = 0
            while not traj.done:
                # The pool's grant counts model tokens only; the loop bounds the whole response itself.
                grant = partial_config.max_new_tokens(traj.model_tokens, 0, response_length)
                await loop.segment(
                    traj,
                    dict(GREEDY),
                    request_id=f"p{index}",
                    max_new_tokens=grant,
                    version=version,
                    eos_ids=eos_ids,
                    **kwargs,
                )
                phases.append("mid_turn" if traj.mid_turn else traj.phase.value)
                # Parked: only the checkpointed state survives, and a fresh loop object resumes it.
                traj = Trajectory.from_state_dict(pickle.loads(pickle.dumps(traj.state_dict())))
                loop = make_loop(PartialToolAgentLoop, config, server, tokenizer, tools)
                version += 1

            fields = loop.output_fields(traj)
            assert fields["prompt_ids"] == whole.prompt_ids
            assert fields["response_ids"] == whole.response_ids
            assert fields["response_mask"] == whole.response_mask
            assert fields["num_turns"] == whole.num_turns
            assert torch.allclose(
                torch.tensor(fields["response_logprobs"]), torch.tensor(whole.response_logprobs), atol=1e-4
            )
            turns.append(whole.num_turns)
        # The comparison covers tool-calling trajectories and parks in every position.
        assert most_turns[0] <= max(turns) <= most_turns[1], turns
        assert {"mid_turn", Phase.TOOL_CALLS.value} <= set(phases)
        if max(turns) > 2:
            assert Phase.MODEL_TURN.value in phases  # parked at the start of a turn after a tool output

    asyncio.run(main())
    whole_calls, partial_calls = tool_log(verl_log), tool_log(partial_log)
    assert partial_calls, "some trajectory must call the tool"
    assert [(c["parameters"], c["output"]) for c in partial_calls] == [
        (c["parameters"], c["output"]) for c in whole_calls
    ]
    keys = [(call["request_id"], call["assistant_turn"]) for call in partial_calls]
    assert len(keys) == len(set(keys))
