"""docs/configuration.md is generated from the config dataclasses' field docstrings: current, and no knob missing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_partial.config import docs as config_docs
from verl_partial.config.correction import BLOCK as CORRECTION_BLOCK
from verl_partial.config.correction import RENAMED_KEYS

REPO = Path(__file__).resolve().parents[2]
BLOCKS = {block.key: block for block in config_docs.blocks()}


def test_the_page_is_current() -> None:
    """Reads the checkout's page, wherever the package is installed (CI installs it into site-packages)."""
    page = REPO / config_docs.PAGE
    assert config_docs.main(["--check", "--page", str(page)]) == 0, "run: python -m verl_partial.config.docs"


@pytest.mark.parametrize("block", BLOCKS)
def test_every_field_has_its_docstring(block: str) -> None:
    cls = BLOCKS[block].cls
    docs = config_docs.field_docs(cls)
    for field in dataclasses.fields(cls):
        assert docs.get(field.name, "").strip(), f"{cls.__name__}.{field.name} has no docstring under it"


@pytest.mark.parametrize("block", BLOCKS)
def test_every_key_our_yamls_define_is_in_its_table(block: str) -> None:
    """Keys are read from every option of the block's Hydra group, so a knob added to a YAML only is caught too."""
    page = config_docs.render()
    paths = sorted((REPO / "hydra_configs" / block).glob("*.yaml"))
    assert paths
    keys = {key for path in paths for key in OmegaConf.load(path).get(block) or {}}  # `block: null` sets none
    assert keys
    renamed = set(RENAMED_KEYS) if block == CORRECTION_BLOCK else set()
    for key in sorted(keys - renamed):
        assert f"| `{block}.{key}` |" in page, f"{block}.{key} is missing from docs/configuration.md"
    for old in sorted(renamed):
        assert f"| `{block}.{old}` | `{block}.{RENAMED_KEYS[old]}` |" in page


def test_field_docs_reads_the_string_under_each_field() -> None:
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        documented: int = 1
        """Spread over
        two lines."""

        undocumented: int = 2

    assert config_docs.field_docs(Knobs) == {"documented": "Spread over two lines."}


def test_check_fails_on_a_stale_page(tmp_path, capsys) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(config_docs.render().replace("partial.schedule", "partial.sched"))
    assert config_docs.main(["--check", "--page", str(page)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert config_docs.main(["--page", str(page)]) == 0
    assert config_docs.main(["--check", "--page", str(page)]) == 0


@pytest.mark.parametrize("block", BLOCKS)
def test_our_yamls_do_not_restate_the_docstrings(block: str) -> None:
    """A knob is documented once, under its field: a comment on a key of our own block in a YAML would be a second
    text that drifts (one said "then cancel the rest" after the step end stopped cancelling). Headers saying what a
    preset is for stay."""
    for path in sorted((REPO / "hydra_configs" / block).glob("*.yaml")):
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line and not line.startswith((" ", "#")):
                inside = line.split(":")[0] == block
            elif inside and "#" in line:
                raise AssertionError(f"{path.name}:{number}: comment on a {block}.* key: {line.strip()!r}")
