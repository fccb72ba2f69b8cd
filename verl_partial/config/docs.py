"""Writes docs/configuration.md, the table of every knob of ours, from the config dataclasses' field docstrings.

``python -m verl_partial.config.docs``, run from the repository root, rewrites the page; ``--check`` exits 1 when
it is out of date (tests/unit/test_config_docs.py runs the same comparison). The documentation of a key lives in
one place, the docstring right under its field (the attribute docstrings of ``PartialConfig``,
``RolloutCorrectionConfig``, ``BalanceConfig``, ``BackendConfig``), so a new knob without a docstring fails the
test instead of going missing from the docs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_partial.config import balance as balance_config
from verl_partial.config import correction
from verl_partial.config import partial as partial_config
from verl_partial.config.backend import BackendConfig
from verl_partial.config.checks import type_text

PAGE = Path("docs") / "configuration.md"
"""Relative to the checkout the command runs in: the page belongs to the repository, not to the installed package
(under a regular install ``__file__`` is in site-packages, where no docs/ exists)."""


@dataclass(frozen=True)
class Block:
    """One top-level block of ours: its key, its dataclass and its presets (``+<key>=<preset>``)."""

    key: str
    cls: type
    presets: Mapping[str, Any]
    intro: str


def blocks() -> list[Block]:
    """Our blocks in the order the page lists them."""
    correction_presets = {name: correction.preset(name) for name in correction.PRESET_NAMES}
    return [
        Block(
            "partial",
            partial_config.PartialConfig,
            partial_config.PRESETS,
            "Partial rollout (`+partial=<preset>`): keep generating across step boundaries instead of waiting for "
            "the longest answer. `PartialConfig()` is `+partial=default`.",
        ),
        Block(
            "rollout_correction",
            correction.RolloutCorrectionConfig,
            correction_presets,
            "Rollout correction (`+rollout_correction=<preset>`): importance sampling and rejection of off-policy "
            "tokens, written into verl's own `algorithm.rollout_correction`. Presets carry verl 0.9.1's classmethod "
            "names and the seed-era names.",
        ),
        Block(
            "balance",
            balance_config.BalanceConfig,
            balance_config.PRESETS,
            "Group-preserving batch balancing (`+balance=group`): each prompt's group stays in one mini-batch.",
        ),
        Block(
            "backend",
            BackendConfig,
            {},
            "CPU execution backends (`+backend=<name>`) for tests, demos and CI; GPU users keep verl's own rollout "
            "set-up and select no backend.",
        ),
    ]


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it in the class body), whitespace-normalised."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in zip(body, body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _yaml(value: Any) -> str:
    """A value as the user writes it on the command line or in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _cell(text: str) -> str:
    """Docstring reST (````x````, ``:mod:`x```) as Markdown, safe inside a table cell."""
    return text.replace(":mod:", "").replace("``", "`").replace("|", "\\|")


def knob_table(block: Block) -> list[str]:
    """``key | allowed values | default | what it does`` for every field of the block."""
    docs = field_docs(block.cls)
    hints = typing.get_type_hints(block.cls)
    default = block.cls()
    lines = ["| key | allowed | default | what it does |", "|---|---|---|---|"]
    for field in dataclasses.fields(block.cls):
        missing = f"(undocumented: add a docstring under {block.cls.__name__}.{field.name})"
        lines.append(
            f"| `{block.key}.{field.name}` | {_cell(type_text(hints[field.name]))} | "
            f"`{_yaml(getattr(default, field.name))}` | {_cell(docs.get(field.name, missing))} |"
        )
    return lines


def preset_table(block: Block) -> list[str]:
    """Each preset and the keys where it differs from the block's defaults."""
    if not block.presets:
        return []
    default = block.cls()
    lines = [f"| `+{block.key}=` | differs from the defaults above in |", "|---|---|"]
    for name, config in block.presets.items():
        changes = [
            f"`{field.name}={_yaml(getattr(config, field.name))}`"
            for field in dataclasses.fields(config)
            if field.name != "preset" and getattr(config, field.name) != getattr(default, field.name)
        ]
        lines.append(f"| `{name}` | {', '.join(changes) or '(nothing: the defaults)'} |")
    return lines


def renamed_table() -> list[str]:
    lines = ["| old key | new key |", "|---|---|"]
    for old, new in correction.RENAMED_KEYS.items():
        lines.append(f"| `{correction.BLOCK}.{old}` | `{correction.BLOCK}.{new}` |")
    return lines


def render() -> str:
    """The whole page."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m verl_partial.config.docs` from the field docstrings of the config",
        "     dataclasses; edit those, not this file (tests/unit/test_config_docs.py checks it is current). -->",
        "",
        "Every key verl-partial adds to verl's config, with its allowed values, its default and what it does. You pick",
        "a preset per block on the command line (`python -m verl.trainer.main_ppo +partial=default",
        "+rollout_correction=token_is`) and override single keys after it (`partial.max_staleness=2`). A bad value",
        "fails in the driver, before Ray starts, naming the key and the allowed values.",
        "",
        "Staleness has one name: `max_staleness`, the most policy versions a trained token may lag the policy being",
        "trained. `partial.max_staleness` bounds it while generating; `rollout_correction.max_staleness` masks",
        "older tokens at training.",
    ]
    for block in blocks():
        lines += ["", f"## `{block.key}`", "", block.intro, "", *knob_table(block)]
        presets = preset_table(block)
        if presets:
            lines += ["", "Presets:", "", *presets]
    lines += [
        "",
        "## Renamed keys",
        "",
        "The old names still work and warn (FutureWarning) naming the new one.",
        "",
        *renamed_table(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_partial.config.docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date, write nothing")
    parser.add_argument("--page", type=Path, default=PAGE, help=f"the page to write or check (default: {PAGE})")
    args = parser.parse_args(argv)
    page: Path = args.page
    text = render()
    if args.check:
        current = page.read_text() if page.exists() else ""
        if current != text:
            print(f"{page} is out of date: run python -m verl_partial.config.docs", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
