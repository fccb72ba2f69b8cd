"""Tests of the benchmarks' own code: the models and readings that published figures rest on (tests/README.md).

``benchmarks`` is a package of the checkout, not of the installed distribution, so these tests import it from the
checkout's root; product tests (tests/unit, tests/e2e) never import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """``bench_module("bench_vllm_trainer")`` is ``benchmarks.bench_vllm_trainer`` from this checkout."""

    def load(name: str) -> ModuleType:
        monkeypatch.syspath_prepend(str(REPO))
        return importlib.import_module(f"benchmarks.{name}")

    return load
