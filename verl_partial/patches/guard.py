"""The one version guard: which verl these patches were written against, and what of verl's private surface
partial rollout's glue reuses. Everything that checks verl's version, or fails on a verl it does not know, calls here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import inspect
from typing import Any

from packaging.version import Version

SUPPORTED_VERL = (Version("0.9.0"), Version("0.10.0"))


class UnsupportedVerlError(RuntimeError):
    """Raised when the installed verl is outside the range our patches target."""


def check_verl_version(version: str) -> None:
    low, high = SUPPORTED_VERL
    if not low <= Version(version) < high:
        raise UnsupportedVerlError(
            f"verl-partial supports verl >={low},<{high}; found verl {version}. Its patches of verl internals "
            "were written against that range only; install a supported verl or a matching verl-partial."
        )


# ---------------------------------------------------------------------------------------------- glue's reach
# Private members of the verl classes partial rollout's glue subclasses and calls (glue/partial_agent_loop.py,
# glue/partial_rollout.py, glue/partial_tool_loop.py). The glue reuses them instead of copying verl's padding, reward,
# metrics and tool-turn code; they are declared here, with the rest of our reach into verl, and checked when a
# partial-rollout manager starts, so a verl that renamed one fails at start-up naming it, not mid-run.
GLUE_PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker": (
        "_agent_loop_postprocess",
        "_postprocess",
        "_compute_score",
    ),
    "verl.experimental.agent_loop.agent_loop:AgentLoopManager": ("_performance_metrics",),
    "verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop": (
        "_handle_pending_state",
        "_handle_processing_tools_state",
        "_build_assistant_message",
    ),
}


# Attributes set by the verl functions named: ToolAgentLoop.run's on its AgentData, which its tool-turn methods read
# (the glue sets them alike), the reward loop workers the manager and each worker hold (the glue scores finished
# groups through them while a step generates) and whether a worker distils (rows are then built at the hand-over).
GLUE_PRIVATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "verl.experimental.agent_loop.tool_agent_loop:ToolAgentLoop.run": ("_active_tools", "_active_tool_schemas"),
    "verl.experimental.agent_loop.agent_loop:AgentLoopManager.__init__": ("reward_loop_worker_handles",),
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker.__init__": (
        "reward_loop_worker_handles",
        "distillation_enabled",
    ),
}


def check_glue_reach() -> None:
    """Refuse to start partial rollout on a verl whose private members the glue relies on have changed."""
    import verl

    missing = []
    for target, names in GLUE_PRIVATE_METHODS.items():
        owner = _resolve(target)
        missing += [f"{target}.{name}" for name in names if not callable(getattr(owner, name, None))]
    for target, names in GLUE_PRIVATE_ATTRIBUTES.items():
        code = getattr(inspect.unwrap(_resolve(target)), "__code__", None)
        missing += [f"{target} sets {name}" for name in names if code is None or name not in code.co_names]
    if missing:
        raise UnsupportedVerlError(
            f"verl {verl.__version__} lacks what verl-partial's partial-rollout glue reuses: {missing}; "
            f"supported: verl >={SUPPORTED_VERL[0]},<{SUPPORTED_VERL[1]}"
        )


def _resolve(target: str) -> Any:
    module_name, _, path = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in path.split("."):
        value = getattr(value, part)
    return value
