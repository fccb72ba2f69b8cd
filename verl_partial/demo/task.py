"""The demo task: count down from ``n`` to 1, with ``n`` drawn from a heavy-tailed distribution.

Why this task: partial rollout only pays off when a few responses in a batch are much longer than the rest, so the
demo needs answers whose length has a long tail (most ``n`` are small, a few are tens of times the median) while the
prompts stay short. Counting down has that shape, is trivially checkable by a rule, and is learnable by a tiny
model in seconds (each step is "previous number minus one", and "1" is always followed by the end of the turn), so
the pretrained demo model's response lengths follow the task's answer lengths instead of being noise.

This module is also handed to verl by file path (``reward.custom_reward_function.path``), which executes it with
``importlib`` without registering it in ``sys.modules``. It must therefore stay standalone (standard library only, no
relative imports) and must not use ``from __future__ import annotations``: with string annotations, ``dataclass``
looks the module up in ``sys.modules`` and fails there.
"""

import json
import random
from dataclasses import dataclass
from typing import Any

DATA_SOURCE = "verl_partial/countdown"
TOOL_DATA_SOURCE = "verl_partial/countdown_tool"
ABILITY = "counting"
REWARD_FUNCTION_NAME = "compute_score"
TOOL_REWARD_FUNCTION_NAME = "compute_tool_score"


@dataclass(frozen=True)
class CountdownTask:
    """Parameters of the answer-length distribution.

    ``n`` follows a Pareto law with scale ``min_count`` and shape ``alpha``, truncated at ``max_count``. With the
    defaults the median ``n`` is about 3 and roughly 1.4% of the examples hit ``max_count`` = 96, which gives
    p99/p50 of the answer length well above 8.
    """

    min_count: int = 2
    max_count: int = 96
    alpha: float = 1.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_count <= self.max_count:
            raise ValueError(f"need 1 <= min_count <= max_count, got {self.min_count=} {self.max_count=}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")

    def sample_count(self, rng: random.Random) -> int:
        """Draw ``n`` by inverse-CDF sampling, so a seeded ``random.Random`` makes the dataset reproducible."""
        pareto = self.min_count * (1.0 - rng.random()) ** (-1.0 / self.alpha)
        return min(self.max_count, int(pareto))


def prompt_text(count: int) -> str:
    """The user message asking for a countdown from ``count``."""
    return f"Count down from {count} to 1."


def split_count(count: int, rng: random.Random) -> tuple[int, int]:
    """Write ``count`` as ``a + b`` with ``a, b >= 1`` (``count >= 2``), for the tool-use prompt."""
    if count < 2:
        raise ValueError(f"the tool-use task needs count >= 2, got {count}")
    first = rng.randint(1, count - 1)
    return first, count - first


def tool_prompt_text(first: int, second: int) -> str:
    """The tool-use variant: the start is a sum the model is meant to hand to the calculator tool."""
    return f"Count down from {first}+{second} to 1."


def tool_call_text(first: int, second: int) -> str:
    """The assistant turn that calls the calculator, in the Hermes format verl's ``hermes`` tool parser reads."""
    call = {"name": "calculator", "arguments": {"expression": f"{first}+{second}"}}
    return "<tool_call>" + json.dumps(call) + "</tool_call>"


def answer_text(count: int) -> str:
    """The exact expected response: ``count`` numbers separated by single spaces."""
    return " ".join(str(i) for i in range(count, 0, -1))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """Fraction of the expected numbers the response gets right before its first mistake.

    Signature matches what verl 0.9.1's reward managers pass (all by keyword: ``data_source``, ``solution_str``,
    ``ground_truth``, ``extra_info``, plus ``reward_router_address``/``reward_model_tokenizer`` when a reward
    model is configured, hence ``**kwargs``). Partial credit for a correct prefix gives a barely trained model
    non-zero rewards; dividing by the longer of the two sequences makes running past "1" cost reward, so the policy
    is pushed to stop at the right length instead of rambling to ``max_response_length``.
    """
    expected = ground_truth.split()
    produced = solution_str.split()
    correct_prefix = 0
    for want, got in zip(expected, produced, strict=False):
        if want != got:
            break
        correct_prefix += 1
    return correct_prefix / max(len(expected), len(produced), 1)


def compute_tool_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """:func:`compute_score` of the final answer of a tool-use trajectory: the text after the last newline.

    verl scores the whole decoded response, tool call and tool output included (special tokens skipped). In the demo
    chat template every tool call and tool turn ends with a newline and a countdown never holds one, so the last line
    is the model's final answer whether or not it called the tool.
    """
    return compute_score(data_source, solution_str.rsplit("\n", 1)[-1], ground_truth, extra_info)
