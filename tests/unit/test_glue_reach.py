"""The glue's reach into verl's private members is declared in one place and checked at start-up (issue 21).

Partial rollout's glue subclasses verl's AgentLoopWorker, AgentLoopManager and ToolAgentLoop and reuses some of
their private methods (padding, reward and metrics, tool turns) rather than copying them. ``patches.guard`` lists
them; a verl that renamed one must refuse to start, naming it, instead of failing mid-run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from verl_partial.glue.partial import agent_loop as partial_agent_loop
from verl_partial.glue.partial import rollout as partial_rollout
from verl_partial.glue.partial import tool_loop as partial_tool_loop
from verl_partial.patches import guard


def test_the_installed_verl_has_everything_the_glue_reuses():
    guard.check_glue_reach()


def test_every_private_verl_member_the_glue_uses_is_declared():
    """A new private call in the glue must be declared, or the start-up check would not cover it: every
    ``self._x`` / ``agent_data._x`` the glue reads that it neither defines (a method of its classes) nor assigns (an
    attribute of its own) is verl's."""
    modules = (partial_agent_loop, partial_rollout, partial_tool_loop)
    sources = [Path(module.__file__).read_text() for module in modules]
    used = {name for source in sources for name in re.findall(r"(?:self|agent_data)\.(_[a-z][a-z_]*)\b", source)}
    defined = {
        name
        for module in modules
        for cls in vars(module).values()
        if isinstance(cls, type) and cls.__module__ == module.__name__
        for name in vars(cls)
    }
    assigned = {name for source in sources for name in re.findall(r"self\.(_[a-z][a-z_]*)\s*(?::[^=\n]*)?=", source)}
    declared = {name for names in guard.GLUE_PRIVATE_METHODS.values() for name in names}
    declared |= {name for names in guard.GLUE_PRIVATE_ATTRIBUTES.values() for name in names}
    assert used - defined - assigned <= declared, sorted(used - defined - assigned - declared)


def test_a_verl_without_one_of_them_is_refused_naming_it(monkeypatch):
    monkeypatch.setitem(
        guard.GLUE_PRIVATE_METHODS,
        "verl.experimental.agent_loop.agent_loop:AgentLoopWorker",
        ("_agent_loop_postprocess", "_renamed_in_a_later_verl"),
    )
    with pytest.raises(guard.UnsupportedVerlError, match="AgentLoopWorker._renamed_in_a_later_verl"):
        guard.check_glue_reach()
