"""docs/evidence.md is generated from benchmarks/results/, and the README and guides quote only its figures.

A quoted figure is a speed-up (``1.83x``, ``1.09-1.38x``) or a range of seconds (``0.56-0.60 s``, ``23-43 ms``)
in README.md or a page directly under docs/ (appendices under docs/method/ and the evidence page itself are not
guides), outside fenced code. It passes when its number appears in the value of a current figure of the evidence
page; a line that links ``evidence.md#<id>`` must quote that figure's value. Withdrawn figures do not count.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUOTED = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)(?:x\b| ?(?:s|ms)\b)")
LINK = re.compile(r"evidence\.md#([a-z0-9-]+)")
RANGE_OF_SECONDS = re.compile(r"-\d")


def guide_pages() -> list[Path]:
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "evidence.md")]


def quoted_figures(text: str) -> list[tuple[int, str, str]]:
    """(line number, figure as written, its line) for every quoted figure outside fenced code."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for match in QUOTED.finditer(line):
            written = match.group(0)
            if written.endswith("x") or RANGE_OF_SECONDS.search(match.group(1)):  # single seconds are not figures
                found.append((number, written, line))
    return found


def unbacked(text: str, values: dict[str, str]) -> list[str]:
    problems = []
    for number, written, line in quoted_figures(text):
        core = QUOTED.match(written).group(1)
        links = LINK.findall(line)
        for figure_id in links:
            if figure_id not in values:
                problems.append(f"line {number}: links evidence.md#{figure_id}, which the page does not hold")
        backing = [values[i] for i in links if i in values] if links else list(values.values())
        if not any(re.search(rf"(?<![\d.]){re.escape(core)}(?![\d.])", value) for value in backing):
            problems.append(f"line {number}: {written!r} is not a current figure of docs/evidence.md")
    return problems


def test_the_page_is_what_the_generator_writes(bench_module) -> None:
    evidence = bench_module("evidence")
    assert evidence.PAGE.read_text() == evidence.render(), (
        "docs/evidence.md is stale: run python -m benchmarks.evidence"
    )


def test_every_figure_has_a_unique_id_and_none_comes_from_withdrawn_results(bench_module) -> None:
    evidence = bench_module("evidence")
    ids = [figure.id for figure in evidence.FIGURES]
    assert len(ids) == len(set(ids))
    for figure in evidence.FIGURES:
        for item in evidence.WITHDRAWN:
            assert not any(fnmatch.fnmatch(figure.source, pattern) for pattern in item.sources), figure.id


def test_a_result_without_date_or_command_gives_no_provenance(bench_module) -> None:
    evidence = bench_module("evidence")
    assert evidence.provenance({"rows": []}) is None
    assert evidence.provenance({"date": "2026-11-24", "rows": []}) is None  # a date alone does not say how
    run = evidence.provenance(
        {"command": "python -m benchmarks.x", "machine": {"date": "2026-11-24"}, "checkout": "ab"}
    )
    assert run == evidence.Provenance(date="2026-11-24", command="python -m benchmarks.x", commit="ab")


def test_a_shown_command_keeps_every_flag_but_where_the_run_wrote_its_files(bench_module) -> None:
    evidence = bench_module("evidence")
    ran = "python -m benchmarks.x --json r.json --work-dir w --modes a,b --out=o.json --plot p.png --seeds 0 1"
    assert evidence.shown_command(ran) == "python -m benchmarks.x --modes a,b --seeds 0 1"
    assert evidence.shown_command("python -m benchmarks.x --jsonl-free") == "python -m benchmarks.x --jsonl-free"


def test_the_figure_rule_flags_unbacked_and_wrongly_linked_figures() -> None:
    values = {"lc-x": "0.96x", "step-end": "0.55-0.59 s"}
    text = (
        "ok 0.96x [e](docs/evidence.md#lc-x)\n"
        "also ok 0.55-0.59 s\n"
        "bad 1.83x\n"
        "bad range 0.56-0.60 s\n"
        "```\nverl-partial simulate --speedup 9.9x\n```\n"
        "a single 5 s is prose, not a figure\n"
        "wrong link 0.96x [e](evidence.md#step-end)\n"
    )
    assert unbacked(text, values) == [
        "line 3: '1.83x' is not a current figure of docs/evidence.md",
        "line 4: '0.56-0.60 s' is not a current figure of docs/evidence.md",
        "line 9: '0.96x' is not a current figure of docs/evidence.md",
    ]


@pytest.mark.parametrize("page", guide_pages(), ids=lambda path: path.relative_to(REPO).as_posix())
def test_quoted_figures_are_on_the_evidence_page(page: Path, bench_module) -> None:
    """A figure counts as on the page in its summary or in the table the page shows below it."""
    evidence = bench_module("evidence")
    rows, _ = evidence.current_figures()
    values = {
        figure.id: value + ("\n" + figure.table(evidence._load(figure.source)) if figure.table else "")
        for figure, value, _ in rows
    }
    problems = unbacked(page.read_text(), values)
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


def test_a_results_file_of_several_runs_gives_ranges_over_all_of_them(bench_module, tmp_path, monkeypatch) -> None:
    """gpu_engine_curve.py appends run after run to one JSON-lines file: the page's figure spans every run, not just
    the last, and its provenance names every command."""
    evidence = bench_module("evidence")
    monkeypatch.setattr(evidence, "RESULTS", tmp_path)
    lines = []
    for run_id, command, speedup in (("r1", "cmd --in-flight 256", 1.5), ("r2", "cmd --in-flight 128", 1.7)):
        common = {"run_id": run_id, "command": command, "commit": "abc", "date": f"2026-11-2{run_id[1]}T00:00:00"}
        lines += [
            {"kind": "run", **common},
            *(
                {"kind": "rollout_mode", "mode": mode, "in_flight": 256, "vs_sync_per_trained_token": value, **common}
                for mode, value in (("sync", 1.0), ("default", speedup))
            ),
        ]
    (tmp_path / "curve.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = evidence._load("curve.jsonl")
    assert [len(run) for run in data["runs"]] == [3, 3]
    assert data["command"] == "cmd --in-flight 256; cmd --in-flight 128" and data["commit"] == "abc"
    assert evidence.provenance(data).date == "2026-11-22"
    speedups = evidence._gpu_rollout(data, "vs_sync_per_trained_token", "x", baseline="sync")
    assert speedups == "at 256: default 1.50-1.70x"
    assert evidence.last_run(tmp_path / "curve.jsonl")[0]["run_id"] == "r2"
