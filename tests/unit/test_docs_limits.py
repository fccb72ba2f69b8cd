"""The docs stay readable and their links stay live (issue 21): the README under 900 words, no docs page over 3,000,
and every relative link -- file and heading anchor -- pointing at something that exists. Pages move and split;
without this a link to a moved section fails silently for the reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
README_WORDS = 900
PAGE_WORDS = 3000
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def words(path: Path) -> int:
    """Words as ``wc -w`` counts them: tables and code included, since the reader scrolls past them too."""
    return len(path.read_text().split())


def anchors(path: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``, and ``-N``
    suffixes for repeated headings."""
    seen: dict[str, int] = {}
    slugs = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def test_readme_is_under_its_word_limit() -> None:
    assert words(ROOT / "README.md") < README_WORDS


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_docs_page_is_under_its_word_limit(page: Path) -> None:
    assert words(page) < PAGE_WORDS


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CHANGELOG.md", *PAGES], ids=lambda page: page.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"
