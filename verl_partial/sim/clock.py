"""An asyncio event loop on a virtual clock: simulated hours of GPU time run in seconds of CPU time.

The loop never sleeps. When nothing is ready, it jumps its clock to the next scheduled callback
(``loop.call_at`` / ``asyncio.sleep`` / ``wait_for`` timeouts all use it), so the real scheduler's own
coroutines run unchanged against a simulated engine and see consistent times.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpSelector(selectors.DefaultSelector):
    """Polls real I/O without blocking and turns every wait into a jump of the virtual clock."""

    def __init__(self, loop_clock: list[float]) -> None:
        super().__init__()
        self._clock = loop_clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("simulation deadlock: every task waits and nothing is scheduled")
        self._clock[0] += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual; waiting advances it instantly."""

    def __init__(self) -> None:
        self._virtual_now = [0.0]
        super().__init__(_JumpSelector(self._virtual_now))

    def time(self) -> float:
        return self._virtual_now[0]


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh virtual-clock loop and close it."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
