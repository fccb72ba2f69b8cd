"""Shared fixtures: the demo assets, built once per test session into a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory):
    from verl_partial.demo.assets import build_assets

    return build_assets(Path(tmp_path_factory.mktemp("demo_assets")))


@pytest.fixture(scope="session")
def demo_tool_assets(tmp_path_factory: pytest.TempPathFactory):
    """The tool-use variant (calculator calls, multi-turn), built once per session."""
    from verl_partial.demo.assets import build_assets

    return build_assets(Path(tmp_path_factory.mktemp("demo_tool_assets")), tool_use=True)
