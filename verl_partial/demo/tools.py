"""A deterministic, local calculator tool for the multi-turn demo task, in verl's ``BaseTool`` format.

Why: verl's ``ToolAgentLoop`` needs a real tool to run a real multi-turn rollout, and tests and the CPU demo have no
network. The tool-use variant of the countdown task asks to "Count down from 17+5 to 1."; a tiny model cannot add,
but it can copy the expression into a calculator call and count down from the result. The calculator evaluates
integer ``+ - *`` expressions with parentheses through Python's ``ast`` (never ``eval``), so the same arguments
always give the same text.

Registered through verl's tool config file (``actor_rollout_ref.rollout.multi_turn.tool_config_path``, see
:data:`verl_partial.demo.assets.TOOL_CONFIG_PATH` and :func:`verl_partial.demo.assets.tool_overrides`). Set
``VERL_PARTIAL_TOOL_LOG`` to a file path to get one JSON line per execution (request id, assistant turn,
arguments): tests read it to count tool calls and to prove that a resumed trajectory never re-runs a call it
already made. ``VERL_PARTIAL_TOOL_DELAY_S=N`` makes every execution take a random 0 to N seconds (an ``asyncio``
sleep, as a remote tool would): tests use it so that partial rollout's step ends find trajectories between turns,
their tool calls running, on purpose.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import random
from pathlib import Path
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

TOOL_NAME = "calculator"
TOOL_LOG_ENV = "VERL_PARTIAL_TOOL_LOG"
TOOL_DELAY_ENV = "VERL_PARTIAL_TOOL_DELAY_S"
# Keeps the evaluator cheap whatever the model writes: no huge literals, no deep nesting.
_MAX_EXPRESSION_CHARS = 64
_MAX_ABS_VALUE = 10**12

_BINARY_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


class CalculatorError(ValueError):
    """The expression is not an integer ``+ - *`` expression the calculator accepts."""


def evaluate(expression: str) -> int:
    """Value of an integer expression with ``+``, ``-``, ``*``, unary minus and parentheses.

    Anything else (names, calls, division, floats, over-long input) raises :class:`CalculatorError` with the reason,
    which the tool returns to the model as its output.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an expression: {expression!r}") from error
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        result = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        result = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        result = _BINARY_OPS[type(node.op)](_value(node.left), _value(node.right))
    else:
        raise CalculatorError(f"unsupported element {ast.unparse(node)!r}; use integers, + - * and parentheses")
    if abs(result) > _MAX_ABS_VALUE:
        raise CalculatorError("value too large")
    return result


class CalculatorTool(BaseTool):
    """verl tool: ``calculator(expression: str)`` returns the expression's integer value as text.

    Stateless, so ``create``/``release`` keep verl's defaults; the tool reward is 0 (the task reward scores the final
    countdown).
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        log_path = os.environ.get(TOOL_LOG_ENV)
        self._log_path = Path(log_path) if log_path else None
        delay = os.environ.get(TOOL_DELAY_ENV, "0")
        try:
            self._delay_s = float(delay)
        except ValueError:
            raise ValueError(f"{TOOL_DELAY_ENV} must be a number of seconds, got {delay!r}") from None

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        if self._delay_s > 0:
            await asyncio.sleep(random.uniform(0, self._delay_s))
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            text = "error: argument 'expression' must be a string"
        else:
            try:
                text = str(evaluate(expression))
            except CalculatorError as error:
                text = f"error: {error}"
        self._log(kwargs.get("agent_data"), parameters, text)
        return ToolResponse(text=text), 0.0, {}

    def _log(self, agent_data: Any, parameters: dict[str, Any], text: str) -> None:
        if self._log_path is None:
            return
        record = {
            "request_id": getattr(agent_data, "request_id", None),
            "assistant_turn": getattr(agent_data, "assistant_turns", None),
            "parameters": parameters,
            "output": text,
        }
        # One short line per O_APPEND write: concurrent workers' lines never interleave.
        with open(self._log_path, "a") as log:
            log.write(json.dumps(record, sort_keys=True) + "\n")
