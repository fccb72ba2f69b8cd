"""When a wave of launches leaves the driver: at once, unless the last one left less than a window ago.

Each flush is one streaming Ray call per AgentLoopWorker it touches, so the glue limits flushes to one per
``LAUNCH_WINDOW_S``: at 512 prompts x 16 the answers of a step arrive one by one, and a call per answer would be
thousands of Ray calls a step. The limit holds the *next* flush back, never the first: a wave after a quiet window
goes out at once. The step's first wave (every carried-over sample, whose longest answer the whole step waits for)
and a refill while the engines drain would otherwise wait a whole window with the engines idle: measured through
verl's trainer on the emulated H200, a step's first engine step came 57-62 ms into the step when every wave waited
out the window (about 1 % of its rollout phase), and 8-11 ms into it with this rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["LAUNCH_WINDOW_S", "LaunchWindow"]

LAUNCH_WINDOW_S = 0.05


class LaunchWindow:
    """Calls ``flush`` for waiting launches: on the loop's next turn when the last flush is at least ``window_s`` old
    (launches of one scheduler turn still go together), otherwise once it is. At most one flush per window."""

    def __init__(self, flush: Callable[[], None], window_s: float = LAUNCH_WINDOW_S) -> None:
        self.window_s = window_s
        self._flush = flush
        self._last: float | None = None  # the running loop's time of the last flush; None: none on this loop yet
        self._handle: asyncio.Handle | None = None

    def request(self) -> None:
        """Launches are waiting: flush them as the rule allows (once, however often this is called before)."""
        if self._handle is not None:
            return
        loop = asyncio.get_running_loop()
        due = 0.0 if self._last is None else self._last + self.window_s - loop.time()
        self._handle = loop.call_soon(self._run) if due <= 0 else loop.call_later(due, self._run)

    def reset(self) -> None:
        """A step's event loop is gone (each step runs on its own): drop its unfired flush and its clock."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._last = None

    def _run(self) -> None:
        self._handle = None
        self._last = asyncio.get_running_loop().time()
        self._flush()
