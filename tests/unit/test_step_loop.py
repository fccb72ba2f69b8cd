"""A partial-rollout step runs on its own event loop, cleaned up as ``asyncio.run`` does, without the SIGINT handler
``asyncio.run`` installs on the main thread (measured to hold verl's TaskRunner 0.06-0.11 s per step under uvloop)."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

import pytest

from verl_partial.glue.partial.step_loop import run_on_own_loop


async def _sigint_handler() -> object:
    return signal.getsignal(signal.SIGINT)


def test_the_step_runs_with_the_sigint_handler_it_found() -> None:
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT)
    assert run_on_own_loop(_sigint_handler()) is before
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.Runner's SIGINT handling came with Python 3.11")
def test_asyncio_run_would_install_its_own_handler_for_the_run() -> None:
    """Why the step does not use ``asyncio.run``: on the main thread with Python's default handler in place (a Ray
    actor's ``fit()``), it swaps in its own for the length of the run."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("the test process runs with another SIGINT handler; asyncio.run leaves it alone then")
    assert asyncio.run(_sigint_handler()) is not signal.default_int_handler


def test_each_step_gets_a_fresh_loop_that_is_closed_and_unset_afterwards() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def step() -> int:
        loops.append(asyncio.get_running_loop())
        return len(loops)

    assert [run_on_own_loop(step()), run_on_own_loop(step())] == [1, 2]
    assert loops[0] is not loops[1]
    assert all(loop.is_closed() for loop in loops)
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()


def test_tasks_a_step_leaves_running_are_cancelled_and_their_clean_up_runs() -> None:
    cleaned: list[str] = []

    async def stream() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("stream")

    async def step() -> str:
        asyncio.get_running_loop().create_task(stream())
        await asyncio.sleep(0)  # the stream starts and waits
        return "trained"

    assert run_on_own_loop(step()) == "trained"
    assert cleaned == ["stream"]


def test_an_error_in_the_step_propagates_and_the_loop_is_still_closed() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def step() -> None:
        loops.append(asyncio.get_running_loop())
        raise ValueError("server answered with other weights")

    with pytest.raises(ValueError, match="other weights"):
        run_on_own_loop(step())
    assert loops[0].is_closed()
