"""The demo's tool-use task: a deterministic calculator in verl's tool format, and a tokenizer/template whose tool
calls verl's own Hermes parser reads and whose tool turns verl's own continuous-token builder reproduces."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pandas as pd
import pytest
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.tool_registry import initialize_tools_from_config
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from verl_partial.demo.assets import (
    TOOL_CONFIG_PATH,
    DemoAssets,
    Example,
    _example,
    _Problem,
    build_assets,
    tool_overrides,
)
from verl_partial.demo.task import answer_text, compute_tool_score, tool_call_text
from verl_partial.demo.tools import TOOL_LOG_ENV, CalculatorError, CalculatorTool, evaluate


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    # The tokenizer is all these tests need; one pretraining step keeps the build fast.
    return build_assets(tmp_path_factory.mktemp("tool_assets"), train_steps=1, train_size=16, val_size=4, tool_use=True)


@pytest.fixture(scope="module")
def tokenizer(tool_assets: DemoAssets):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(tool_assets.model_dir))


@pytest.mark.parametrize(
    ("expression", "value"),
    [("17+5", 22), (" 2 * (3 - 10) ", -14), ("-4+1", -3), ("((1))", 1), ("99*99*99", 970299)],
)
def test_calculator_evaluates_integer_expressions(expression: str, value: int) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["", "1/2", "2**3", "1.5+1", "x+1", "__import__('os')", "1+", "9" * 70])
def test_calculator_rejects_everything_else(expression: str) -> None:
    with pytest.raises(CalculatorError):
        evaluate(expression)


def _execute(tool: CalculatorTool, parameters: dict) -> str:
    async def run() -> str:
        instance_id, _ = await tool.create()
        response, reward, _ = await tool.execute(instance_id, parameters)
        await tool.release(instance_id)
        assert reward == 0.0
        return response.text

    return asyncio.run(run())


def test_tool_loads_through_verls_tool_config_and_is_deterministic(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv(TOOL_LOG_ENV, str(log))
    (tool,) = initialize_tools_from_config(str(TOOL_CONFIG_PATH))
    assert isinstance(tool, CalculatorTool)
    assert tool.name == "calculator"
    assert tool.tool_schema.function.parameters.required == ["expression"]
    outputs = [_execute(tool, {"expression": "17+5"}) for _ in range(3)]
    assert outputs == ["22", "22", "22"]
    assert _execute(tool, {"expression": "1/0"}).startswith("error: unsupported element")
    assert _execute(tool, {"expression": 5}) == "error: argument 'expression' must be a string"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [record["output"] for record in records] == ["22", "22", "22", records[3]["output"], records[4]["output"]]
    assert records[0]["parameters"] == {"expression": "17+5"}


def test_tool_overrides_point_verl_at_the_shipped_config() -> None:
    overrides = dict(item.split("=", 1) for item in tool_overrides())
    assert Path(overrides["actor_rollout_ref.rollout.multi_turn.tool_config_path"]) == TOOL_CONFIG_PATH
    assert overrides["actor_rollout_ref.rollout.multi_turn.format"] == "hermes"
    assert overrides["actor_rollout_ref.rollout.agent.default_agent_loop"] == "tool_agent"


def test_hermes_markers_are_single_tokens_and_verls_parser_finds_the_call(tokenizer) -> None:
    for marker in ("<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    generated = tokenizer.encode(tool_call_text(17, 5), add_special_tokens=False) + [tokenizer.eos_token_id]
    parser = ToolParser.get_tool_parser("hermes", tokenizer)
    _, calls = asyncio.run(parser.extract_tool_calls(generated))
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("calculator", {"expression": "17+5"})]
    # A plain countdown holds no call.
    plain = tokenizer.encode(answer_text(5), add_special_tokens=False) + [tokenizer.eos_token_id]
    assert asyncio.run(parser.extract_tool_calls(plain))[1] == []


def test_pretraining_tool_turn_is_what_verls_continuous_token_builder_appends(tokenizer) -> None:
    """The model is pretrained on exactly the token stream verl's ToolAgentLoop builds at rollout."""
    example: Example = _example(tokenizer, _Problem(22, (17, 5)), calls_tool=True)
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2")
    user = [{"role": "user", "content": "Count down from 17+5 to 1."}]
    runtime = builder.build_initial_tokens(user)
    assert runtime == example.prompt_ids
    call_ids = tokenizer.encode(tool_call_text(17, 5), add_special_tokens=False) + [tokenizer.eos_token_id]
    runtime = builder.merge_assistant_tokens(runtime, call_ids).token_ids
    assistant = {"role": "assistant", "content": "", "tool_calls": []}
    tool = {"role": "tool", "content": "22"}
    merged = builder.merge_context_tokens(user + [assistant], user + [assistant, tool], runtime)
    answer_ids = tokenizer.encode(answer_text(22), add_special_tokens=False) + [tokenizer.eos_token_id]
    assert merged.token_ids + answer_ids == example.prompt_ids + example.response_ids
    tool_turn = len(merged.token_ids) - len(runtime)
    assert example.loss_mask == [1] * len(call_ids) + [0] * tool_turn + [1] * len(answer_ids)


def test_tool_score_reads_the_final_answer_after_the_tool_turn(tokenizer) -> None:
    example = _example(tokenizer, _Problem(4, (1, 3)), calls_tool=True)
    decoded = tokenizer.decode(example.response_ids, skip_special_tokens=True)  # as verl's reward manager does
    assert compute_tool_score("", decoded, answer_text(4)) == 1.0
    assert compute_tool_score("", decoded.replace("4 3 2 1", "4 3 9 1"), answer_text(4)) == 0.5
    assert compute_tool_score("", "4 3 2 1", answer_text(4)) == 1.0  # answered without the tool


def test_tool_dataset_rows_ask_for_a_sum(tool_assets: DemoAssets) -> None:
    frame = pd.read_parquet(tool_assets.train_parquet)
    for prompt, extra, reward in zip(frame.prompt, frame.extra_info, frame.reward_model, strict=True):
        first, second = (int(term) for term in extra["terms"])
        assert prompt[0]["content"] == f"Count down from {first}+{second} to 1."
        assert reward["ground_truth"] == answer_text(first + second) == answer_text(int(extra["count"]))
    assert tool_assets.reward_fn_name == "compute_tool_score"
