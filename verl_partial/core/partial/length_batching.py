"""Length-aware batch composition (tail batching): which prompts train together, decided before any of them starts.

A step lasts about as long as the longest answer it must finish. When every step draws its prompts in the
dataloader's order, nearly every step holds one long answer, so nearly every step is long. RollPacker's tail
batching (arXiv 2509.21009) and Seer's context-aware scheduling (arXiv 2511.14617) regroup prompts by expected
length so that short steps hold short answers and the long answers share a few long steps. Ordering requests
within one step (``partial.schedule=longest_first``) cannot do that: it cannot shorten a step whose batch holds a
long answer.

With ``partial.length_window_steps = K >= 2`` the :class:`LengthBatcher` draws K steps' worth of prompts
(``K x data.train_batch_size``) at once and hands them to the pool longest expected answer first; the next window is
drawn only when this one is used up. Longest first is longest-processing-time-first (Graham) at the window's scale:
the window's long answers start together at its start and share its first steps, while the short rest streams
through the later ones; under partial rollout's ``wait`` a long answer admitted late in a window would instead tie
down the next step (docs/method/gpu-simulator.md compares both orders). The expected length of a prompt is the
mean length of its samples the last times it was trained (:class:`verl_partial.core.partial.on_policy.LengthEstimator`,
its earlier epochs). What it guarantees, whatever the estimates:

* **Nothing lost or duplicated.** Every drawn prompt is handed out exactly once; the undrawn rest of a window is
  part of the checkpoint (:meth:`LengthBatcher.state_dict`).
* **Bounded delay.** A prompt is handed out at most ``K x batch - 1`` hand-outs after its window was drawn. The pool
  admits ``batch`` groups per step in steady state, so that is K steps; the trainer reports the largest delay of
  each step as ``partial/window_delay_steps/max`` so the bound is checked, not assumed.
* **The same data per window.** The prompts trained over a window are the window's, only reordered, so the
  trained-length distribution over a window matches sync's for the same prompts; the bias is confined to the order
  within K steps.
* **No estimate, no change.** A prompt without history (the first epoch) keeps its draw position relative to the
  others without one; it is placed as if of the window's median known length, so a first epoch runs exactly like
  ``length_window_steps = 0``.

Pure and cheap: one sort of ``K x batch`` floats per window.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from verl_partial.config.partial import PartialConfig

P = TypeVar("P")


class _Source(Protocol[P]):
    def next_prompt(self) -> tuple[P, str] | None: ...


def longest_expected_first(expected: Sequence[float | None]) -> list[int]:
    """Positions of ``expected`` in descending order; an unknown estimate counts as the median of the known ones,
    and ties (including all-unknown) keep their original order."""
    known = [value for value in expected if value is not None]
    fill = statistics.median(known) if known else 0.0
    keys = [fill if value is None else value for value in expected]
    return sorted(range(len(keys)), key=lambda index: -keys[index])


class LengthBatcher(Generic[P]):
    """A prompt source that hands out windows of ``window`` prompts, each longest expected answer first.

    ``expected(prompt)`` is the prompt's expected response length or ``None`` when nothing is known; it is asked
    when a window is drawn, so it sees the history of every step trained before.
    """

    def __init__(self, source: _Source[P], expected: Callable[[P], float | None], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 prompt, got {window}")
        self.source = source
        self.expected = expected
        self.window = window
        self.step = 0
        # (prompt, key, step the window was drawn at), in hand-out order.
        self.pending: deque[tuple[P, str, int]] = deque()
        self.delays: list[int] = []

    @classmethod
    def for_config(
        cls, config: PartialConfig, source: _Source[P], batch_groups: int, expected: Callable[[P], float | None]
    ) -> LengthBatcher[P] | None:
        """The batcher ``partial.length_window_steps`` asks for over ``source``, or None when it is 0."""
        if config.length_window_steps == 0:
            return None
        return cls(source, expected, config.length_window_steps * batch_groups)

    def begin_step(self, step: int) -> None:
        """The trainer's step: delays are counted in steps between a window's draw and each hand-out."""
        self.step = step
        self.delays = []

    def next_prompt(self) -> tuple[P, str] | None:
        if not self.pending:
            self._draw()
        if not self.pending:
            return None
        prompt, key, drawn_at = self.pending.popleft()
        self.delays.append(self.step - drawn_at)
        return prompt, key

    def _draw(self) -> None:
        drawn: list[tuple[P, str]] = []
        while len(drawn) < self.window:
            item = self.source.next_prompt()
            if item is None:
                break
            drawn.append(item)
        order = longest_expected_first([self.expected(prompt) for prompt, _ in drawn])
        self.pending.extend((*drawn[index], self.step) for index in order)

    def state_dict(self) -> dict[str, Any]:
        """The drawn prompts not handed out yet: without them a resume would skip part of a window."""
        return {"pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = deque(tuple(item) for item in state["pending"])  # type: ignore[misc]
