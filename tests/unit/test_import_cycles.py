"""No import circle in ``verl_partial``, function-level imports included.

A circle that only closes inside a function still couples the modules both ways and breaks as soon as one of the
imports moves to module level; the graph is read from the source (AST), so every ``import`` and ``from ... import``
anywhere in a module counts, not only those that run when it is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "verl_partial"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import mod`` counts as importing ``pkg.mod``, not
    ``pkg``: a package is imported before its submodules anyway, and importing it from one of them is no circle)."""
    paths = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                submodules = {f"{base}.{alias.name}" for alias in node.names} & paths.keys()
                targets.update(submodules)
                if len(submodules) < len(node.names):
                    targets.add(base)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as the list of its modules (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # plugin.py imports the patches inside its register function only.
    assert "verl_partial.patches.apply" in graph["verl_partial.plugin"]
    assert "verl_partial.core.partial.pool" in graph["verl_partial.core.partial.scheduler"]


def test_the_cycle_finder_finds_a_function_level_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])
