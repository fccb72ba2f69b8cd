"""Length-aware windows (``partial.length_window_steps``): every prompt exactly once, each window longest expected
first, a bounded delay, and a checkpoint that loses no drawn prompt."""

from __future__ import annotations

import random

import pytest

from verl_partial.config.partial import PRESETS, PartialConfig
from verl_partial.core.partial.length_batching import LengthBatcher, longest_expected_first


class Counting:
    """A prompt source over ``total`` prompts ``0..total-1`` (keys ``k<i>``), then exhausted."""

    def __init__(self, total: int) -> None:
        self.total, self.issued = total, 0

    def next_prompt(self) -> tuple[int, str] | None:
        if self.issued == self.total:
            return None
        self.issued += 1
        return self.issued - 1, f"k{self.issued - 1}"


def drain(batcher: LengthBatcher[int], per_step: int) -> list[list[int]]:
    """Hand out ``per_step`` prompts per step until the source is exhausted."""
    steps: list[list[int]] = []
    while True:
        batcher.begin_step(len(steps))
        got: list[int] = []
        for _ in range(per_step):
            item = batcher.next_prompt()
            if item is None:
                break
            got.append(item[0])
        if not got:
            return steps
        steps.append(got)


def test_each_window_is_handed_out_longest_expected_first_and_every_prompt_once() -> None:
    lengths = {prompt: random.Random(prompt).uniform(10, 1000) for prompt in range(40)}
    batcher = LengthBatcher(Counting(40), lengths.get, window=16)
    steps = drain(batcher, per_step=4)
    handed = [prompt for step in steps for prompt in step]
    assert sorted(handed) == list(range(40))
    for start in (0, 16, 32):
        window = handed[start : start + 16]
        assert sorted(window) == list(range(start, min(start + 16, 40)))  # a window holds exactly its own prompts
        assert [lengths[p] for p in window] == sorted((lengths[p] for p in window), reverse=True)


def test_delay_is_bounded_by_the_window() -> None:
    """At ``batch`` hand-outs per step a prompt leaves within K steps of its window's draw (window = K x batch)."""
    batch, steps_per_window = 4, 3
    batcher = LengthBatcher(Counting(60), lambda prompt: float(prompt), window=steps_per_window * batch)
    delays: list[int] = []
    step = 0
    while True:
        batcher.begin_step(step)
        handed = [batcher.next_prompt() for _ in range(batch)]
        delays += batcher.delays
        if handed[-1] is None:
            break
        step += 1
    assert max(delays) == steps_per_window - 1
    assert min(delays) == 0


def test_unknown_lengths_sit_at_the_median_and_ties_keep_draw_order() -> None:
    assert longest_expected_first([None, None, None]) == [0, 1, 2]  # a first epoch: the dataloader's order
    assert longest_expected_first([100.0, None, 300.0, 200.0]) == [2, 1, 3, 0]  # None ranks as 200, before the 200
    assert longest_expected_first([1.0, 5.0, 5.0]) == [1, 2, 0]


def test_a_checkpoint_mid_window_resumes_with_the_same_prompts_in_the_same_order() -> None:
    lengths = {prompt: float((prompt * 37) % 11) for prompt in range(24)}
    reference = drain(LengthBatcher(Counting(24), lengths.get, window=12), per_step=4)

    source = Counting(24)
    first = LengthBatcher(source, lengths.get, window=12)
    first.begin_step(0)
    before = [first.next_prompt()[0] for _ in range(5)]  # type: ignore[index]
    state = first.state_dict()
    resumed = LengthBatcher(source, lengths.get, window=12)  # the source's own state is the loader's to restore
    resumed.load_state_dict(state)
    after = [item[0] for item in iter(resumed.next_prompt, None)]
    assert before + after == [prompt for step in reference for prompt in step]


def test_estimates_are_read_when_a_window_is_drawn() -> None:
    """The second window sees what the first one taught (the estimator's history grows between windows)."""
    known: dict[int, float] = {}
    batcher = LengthBatcher(Counting(8), known.get, window=4)
    first = [batcher.next_prompt()[0] for _ in range(4)]  # type: ignore[index]
    assert first == [0, 1, 2, 3]
    known.update({4: 9.0, 5: 1.0, 6: 5.0, 7: 3.0})
    assert [batcher.next_prompt()[0] for _ in range(4)] == [4, 6, 7, 5]  # type: ignore[index]


def test_the_knob_builds_the_window_from_the_batch() -> None:
    assert LengthBatcher.for_config(PartialConfig(), Counting(1), 8, lambda p: None) is None
    batcher = LengthBatcher.for_config(PartialConfig(length_window_steps=4), Counting(1), 8, lambda p: None)
    assert batcher is not None and batcher.window == 32


@pytest.mark.parametrize("value", [1, -1])
def test_a_window_of_one_step_or_less_is_refused_naming_the_key(value: int) -> None:
    with pytest.raises(ValueError, match=r"partial.length_window_steps must be 0 .* or an integer >= 2"):
        PartialConfig(length_window_steps=value)


def test_the_tail_presets_compose_windows() -> None:
    for name in ("tail", "tail_on_policy"):
        assert PRESETS[name].length_window_steps >= 2
    assert PRESETS["tail"].max_staleness == 1 and PRESETS["tail_on_policy"].max_staleness == 0
