"""The docs stay a user guide and their links stay live: the README under 900 words, no page under docs/ (appendices
in subfolders included) over 3,000, the guide pages at most 12,000 words together and all of docs/ at most 24,000,
and every relative link -- file and heading anchor -- pointing at something that exists. Without the totals a page
limit makes pages split, not shrink; without the link check a link to a moved section fails silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# What a user reads to decide; method and derivations sit in appendices under docs/method/.
GUIDES = (
    "getting-started.md",
    "partial-rollout.md",
    "rollout-correction.md",
    "balancing.md",
    "engines.md",
    "configuration.md",
    "evidence.md",
)
README_WORDS = 900
PAGE_WORDS = 3000
GUIDE_WORDS = 12000
DOCS_WORDS = 24000
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


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_page_under_docs_is_counted() -> None:
    """The limits below see appendices in subfolders too: a page moved one folder down is still a page."""
    assert DOCS / "method" / "partial-rollout.md" in PAGES
    assert all((DOCS / guide).exists() for guide in GUIDES), [g for g in GUIDES if not (DOCS / g).exists()]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_docs_page_is_under_its_word_limit(page: Path) -> None:
    assert words(page) < PAGE_WORDS


def test_guide_pages_together_are_under_their_word_limit() -> None:
    counts = {guide: words(DOCS / guide) for guide in GUIDES}
    assert sum(counts.values()) <= GUIDE_WORDS, counts


def test_all_of_docs_is_under_its_word_limit() -> None:
    counts = {_name(page): words(page) for page in PAGES}
    assert sum(counts.values()) <= DOCS_WORDS, counts


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CHANGELOG.md", *PAGES], ids=_name)
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
    assert not broken, f"{_name(page)}: links to nothing: {broken}"
