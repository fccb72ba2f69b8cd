"""Partial-rollout settings the benchmarks compare, as Hydra overrides on top of ``+partial=default``.

One definition for every benchmark script. Imported as a sibling module (``from _modes import ...``): the
benchmarks folder is the script's own directory, and the trainer's Ray workers get it on ``PYTHONPATH``.
"""

from __future__ import annotations


def previous_default(extra_groups: int = 4) -> tuple[str, ...]:
    """``+partial=default`` as it was before streaming admission: ``restart``, no refill, extra groups admitted at
    the step start (4 then)."""
    return ("partial.staleness_policy=restart", "partial.refill=false", f"partial.extra_groups={extra_groups}")
