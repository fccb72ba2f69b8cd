"""The layer rules, checked on every module of ``verl_partial/core/`` and the typed configs of ``verl_partial/config/``.

``core/`` holds the algorithms: it must import without verl, Ray or anything above it in this package, so the
scheduler, pool and balancer run (and are tested) without a trainer, and ``verl-partial simulate`` runs after a plain
``pip install``. The typed configs (``config/`` but the module that reads verl's composed config) are held to the
same rule, and are the only thing outside ``core/`` that ``core/`` may import. torch is kept to the tensor side named
in :data:`TORCH_ALLOWED`. The module list comes from the directories, so a new core module (or subpackage) is covered
without editing this file.

Above core, verl's ``DataProto`` is built and read in one adapter, :data:`DATAPROTO_ADAPTER`: any other module names
it for type annotations only (under ``TYPE_CHECKING``) and never reads its ``meta_info`` or ``non_tensor_batch``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "verl_partial" / "core"
CONFIG = REPO / "verl_partial" / "config"
# The one config module that reads verl's composed (omegaconf) config; it sits above core.
CONFIG_READER = "verl_partial.config.job"
FORBIDDEN = ("verl", "ray", "torch")
# The tensor side of the correction (token lags and masks over verl's batch tensors): torch, still no verl.
TORCH_ALLOWED = frozenset({"verl_partial.core.correction.math"})


def core_modules() -> list[str]:
    """Every module under core/ (subpackages included) and every pure config module, as dotted names."""
    names = []
    for path in sorted([*CORE.rglob("*.py"), *CONFIG.rglob("*.py")]):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [name for name in names if name != CONFIG_READER]


def below_core(name: str) -> bool:
    """Modules core may import: core's own and the pure configs."""
    pure_config = name.startswith("verl_partial.config") and not name.startswith(CONFIG_READER)
    return name.startswith("verl_partial.core") or pure_config


PROBE = """
import sys
before = set(sys.modules)
import {module}
loaded = sorted(set(sys.modules) - before)
print("\\n".join(loaded))
"""


def test_the_listing_sees_the_core_modules():
    modules = core_modules()
    assert {"verl_partial.core", "verl_partial.core.partial.scheduler", "verl_partial.config.partial"} <= set(modules)
    assert TORCH_ALLOWED <= set(modules), "an allowance for a module that no longer exists"


@pytest.mark.parametrize("module", core_modules())
def test_core_module_imports_no_trainer_and_nothing_above_core(module: str):
    # A fresh interpreter (in this one, other tests have long since imported verl and torch), run from the checkout
    # so it is the checkout's core that is probed, as listed.
    probe = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)], cwd=REPO, capture_output=True, text=True, check=True
    )
    loaded = probe.stdout.split()
    forbidden = {f for f in FORBIDDEN if not (f == "torch" and module in TORCH_ALLOWED)}
    pulled = sorted({name.split(".")[0] for name in loaded} & forbidden)
    assert not pulled, f"{module} imports {pulled}"
    above = [name for name in loaded if name.startswith("verl_partial.") and not below_core(name)]
    assert not above, f"{module} imports upwards: {above}"


# ---------------------------------------------------------------------------------------------- DataProto
PACKAGE = REPO / "verl_partial"
DATAPROTO_ADAPTER = PACKAGE / "glue" / "dataproto.py"
# What only the adapter reads or builds: DataProto's columns and meta, and the class itself (``verl.DataProto``).
DATAPROTO_ATTRIBUTES = frozenset({"meta_info", "non_tensor_batch", "DataProto"})


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of every node inside an ``if TYPE_CHECKING:`` block (imports there are annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def dataproto_uses(path: Path) -> list[str]:
    """Where a module imports ``DataProto`` at run time or reads one's ``meta_info``/``non_tensor_batch``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    annotations_only = _type_checking_nodes(tree)
    uses: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "verl":
            if any(alias.name == "DataProto" for alias in node.names):
                uses.append((node.lineno, "imports DataProto"))
        elif isinstance(node, ast.Attribute) and node.attr in DATAPROTO_ATTRIBUTES:
            uses.append((node.lineno, f".{node.attr}"))
    return [f"line {line}: {what}" for line, what in sorted(uses)]


def test_the_dataproto_check_sees_runtime_imports_and_reads_not_annotations(tmp_path: Path):
    annotated = tmp_path / "annotated.py"
    annotated.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from verl import DataProto\n"
        "def f(batch: DataProto) -> DataProto:\n    return batch\n"
    )
    assert dataproto_uses(annotated) == []
    reader = tmp_path / "reader.py"
    reader.write_text(
        "import verl\nfrom verl import DataProto\ndef f(batch):\n    return batch.meta_info, verl.DataProto\n"
    )
    assert dataproto_uses(reader) == ["line 2: imports DataProto", "line 4: .DataProto", "line 4: .meta_info"]


def test_only_the_adapter_builds_or_reads_a_dataproto():
    offenders = {
        str(path.relative_to(REPO)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != DATAPROTO_ADAPTER and (uses := dataproto_uses(path))
    }
    assert not offenders, f"DataProto outside {DATAPROTO_ADAPTER.relative_to(REPO)}: {offenders}"
