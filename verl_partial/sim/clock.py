"""An asyncio event loop on a virtual clock: simulated hours of GPU time run in seconds of CPU time.

The loop never sleeps. When nothing is ready, it jumps its clock to the next scheduled callback
(``loop.call_at`` / ``asyncio.sleep`` / ``wait_for`` timeouts all use it), so the real scheduler's own
coroutines run unchanged against a simulated engine and see consistent times.

It is also the driver's watchdog (issue 19: a scheduler that spins at 100 % CPU must fail a test, not hang it):

* a loop that keeps iterating without its clock moving (a coroutine re-awaiting something already done, over and
  over) raises :class:`BusyLoop` after ``max_still_iterations`` iterations at one virtual instant;
* a coroutine that never yields at all (``while True: ... continue`` with no ``await``) starves the loop; with
  ``run_virtual(..., watchdog_s=...)`` a watcher thread sees no loop iteration for that many real seconds and
  raises :class:`BusyLoop` inside the spinning code, so it fails with a traceback pointing at the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import selectors
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Iterations of the loop at one virtual instant before it is judged a busy loop. A step recording thousands of
# answers that arrive at the same instant needs a few iterations per answer; a spinning driver needs millions.
MAX_STILL_ITERATIONS = 200_000


class BusyLoop(AssertionError):
    """The driver spins: it runs without awaiting anything that lets virtual time or an answer advance."""

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "busy loop: the event loop ran no iteration for the watchdog period -- a coroutine is spinning "
            "without awaiting anything (see the traceback for where)"
        )


class _JumpSelector(selectors.DefaultSelector):
    """Polls real I/O without blocking and turns every wait into a jump of the virtual clock."""

    def __init__(self, loop_clock: list[float], max_still_iterations: int) -> None:
        super().__init__()
        self._clock = loop_clock
        self.iterations = 0  # every loop iteration selects once; the watchdog thread reads this
        self.still = 0
        self._max_still = max_still_iterations

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.iterations += 1
        events = super().select(0)
        if events:
            self.still = 0
            return events
        if timeout is None:
            raise RuntimeError("simulation deadlock: every task waits and nothing is scheduled")
        if timeout > 0:
            self._clock[0] += timeout
            self.still = 0
            return []
        self.still += 1
        if self.still > self._max_still:
            raise BusyLoop(
                f"busy loop: {self.still} event-loop iterations at virtual time {self._clock[0]:.6f} without the "
                "clock moving -- a coroutine keeps waking without anything advancing"
            )
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual; waiting advances it instantly."""

    def __init__(self, max_still_iterations: int = MAX_STILL_ITERATIONS) -> None:
        self._virtual_now = [0.0]
        self.selector = _JumpSelector(self._virtual_now, max_still_iterations)
        super().__init__(self.selector)

    def time(self) -> float:
        return self._virtual_now[0]


class _Watchdog(threading.Thread):
    """Raises :class:`BusyLoop` in the loop's thread when the loop made no iteration for ``period_s`` real seconds."""

    def __init__(self, loop: VirtualClockLoop, period_s: float) -> None:
        super().__init__(daemon=True, name="virtual-clock-watchdog")
        self.loop, self.selector, self.period_s = loop, loop.selector, period_s
        self.target = threading.get_ident()
        self.stopped = threading.Event()
        self.fired = False

    def run(self) -> None:
        seen = self.selector.iterations
        while not self.stopped.wait(self.period_s):
            now = self.selector.iterations
            if now == seen and self.loop.is_running():
                # CPython's documented way to raise in another thread; lands at the spinning code's next bytecode.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target), ctypes.py_object(BusyLoop))
                self.fired = True
                return
            seen = now


def run_virtual(
    main: Coroutine[Any, Any, T],
    *,
    watchdog_s: float | None = None,
    max_still_iterations: int = MAX_STILL_ITERATIONS,
) -> T:
    """Run ``main`` to completion on a fresh virtual-clock loop and close it.

    Tasks still pending at the end (calls lost to a dead simulated server) are cancelled. ``watchdog_s``: fail with
    :class:`BusyLoop` when the loop makes no iteration for that many real seconds (None: no watcher thread).
    """
    loop = VirtualClockLoop(max_still_iterations)
    watchdog = None if watchdog_s is None else _Watchdog(loop, watchdog_s)
    try:
        if watchdog is not None:
            watchdog.start()
        return loop.run_until_complete(main)
    finally:
        if watchdog is not None:
            watchdog.stopped.set()
            watchdog.join()
        loop.selector.still = 0  # the clean-up below may iterate at the instant a busy loop was caught
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()
