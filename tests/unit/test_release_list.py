"""The release-only list (tests/release_only.py) names tests that exist: a renamed test would otherwise leave CI and the
release session both without it, silently."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from release_only import RELEASE_ONLY

REPO = Path(__file__).resolve().parents[2]
NODE = re.compile(r"^(?P<path>tests/[\w/]+\.py)::(?P<name>test_\w+)(\[(?P<param>[\w-]+)\])?$")


@pytest.mark.parametrize("node", sorted(RELEASE_ONLY))
def test_each_release_only_test_exists(node: str) -> None:
    match = NODE.match(node)
    assert match, f"{node!r} is not a test node id"
    path = REPO / match["path"]
    assert path.is_file(), node
    names = {f.name for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef)}
    assert match["name"] in names, node
    assert RELEASE_ONLY[node].strip(), f"{node}: say why it may wait for the release"
