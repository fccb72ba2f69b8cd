"""The launch window (verl_partial/core/partial/launch_window.py): a wave after a quiet window leaves at once (a
step's first wave used to wait 50 ms with every engine idle), later ones within the window go together, and never
more than one flush per window."""

from __future__ import annotations

import asyncio

from verl_partial.core.partial.launch_window import LAUNCH_WINDOW_S, LaunchWindow
from verl_partial.sim.clock import run_virtual


class Flushes:
    def __init__(self) -> None:
        self.at: list[float] = []
        self.window = LaunchWindow(self.flush)

    def flush(self) -> None:
        self.at.append(asyncio.get_running_loop().time())


def test_the_first_wave_leaves_at_once_and_later_ones_wait_for_the_window() -> None:
    async def main() -> list[float]:
        flushes = Flushes()
        start = asyncio.get_running_loop().time()
        flushes.window.request()
        flushes.window.request()  # the same turn: one flush
        await asyncio.sleep(0)
        assert flushes.at == [start]  # on the next turn, not a window later
        await asyncio.sleep(0.01)
        flushes.window.request()  # 10 ms after a flush: held to the window's end
        flushes.window.request()
        await asyncio.sleep(0.02)
        flushes.window.request()  # merged into the held flush
        await asyncio.sleep(0.1)
        flushes.window.request()  # after a quiet window: at once again
        await asyncio.sleep(0)
        return [at - start for at in flushes.at]

    at = run_virtual(main())
    assert at == [0.0, LAUNCH_WINDOW_S, 0.13]


def test_requests_every_millisecond_flush_at_most_once_per_window() -> None:
    async def main() -> list[float]:
        flushes = Flushes()
        for _ in range(1000):
            flushes.window.request()
            await asyncio.sleep(0.001)
        await asyncio.sleep(LAUNCH_WINDOW_S)
        return flushes.at

    at = run_virtual(main())
    gaps = [later - earlier for earlier, later in zip(at, at[1:], strict=False)]
    assert min(gaps) >= LAUNCH_WINDOW_S - 1e-9
    assert len(at) <= 1 + 1.0 / LAUNCH_WINDOW_S + 1


def test_reset_drops_the_held_flush_and_the_next_loop_starts_open() -> None:
    flushes = Flushes()

    async def first_step() -> None:
        flushes.window.request()
        await asyncio.sleep(0)
        flushes.window.request()  # held: the loop ends first

    run_virtual(first_step())
    flushes.window.reset()
    assert len(flushes.at) == 1

    async def next_step() -> float:  # a new loop, whose clock has nothing to do with the last one's
        start = asyncio.get_running_loop().time()
        flushes.window.request()
        await asyncio.sleep(1.0)  # the dropped flush never fires; this one goes at once
        return start

    start = run_virtual(next_step())
    assert len(flushes.at) == 2 and flushes.at[1] == start
