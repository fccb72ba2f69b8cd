"""Strictly on-policy tail cutting: start the longest expected answers first (Seer, RollPacker).

With ``max_staleness=0`` no token from an older policy is trained, so the only lever left on the long tail is
the order in which a step's requests start. When a server holds fewer running requests than it is sent
(``max_num_seqs`` or the KV cache caps it), requests queue, and a queue ordered shortest-or-random-first can end
the step with one long answer started late. Longest-processing-time-first is the classic cure for makespan
(Graham 1969); the lengths are estimated the way Seer (arXiv 2511.14617) and RollPacker (arXiv 2509.21009) do:

* from the group's finished siblings, when some are done (the samples of one prompt have similar lengths);
* else from the prompt's history: its samples' mean length the last time it was trained (an earlier epoch);
* else unknown: such samples go first, as Seer probes new groups first to learn their length.

Pure and cheap: the pool calls :meth:`LengthEstimator.priority` once per runnable sample per launch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.pool import GroupState, SampleState


class LengthEstimator:
    """Expected response length of a sample from its finished siblings or its prompt's earlier samples.

    ``identity`` maps a prompt to its identity across epochs (its dataset index), or to None when the data set
    gives none: such a prompt never has a history, its finished siblings still inform the estimate. A group's
    ``key`` is unique per admission, so it cannot serve.
    ``smoothing``: weight of the newest epoch in the prompt's running mean (1.0 keeps only the last epoch).
    """

    def __init__(self, identity: Callable[[Any], Hashable | None], smoothing: float = 0.5) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.identity = identity
        self.smoothing = smoothing
        self.history: dict[Hashable, float] = {}

    def record(self, groups: Iterable[GroupState[Any]]) -> None:
        """Remember the mean response length of every trained group's prompt (call after each step)."""
        for group in groups:
            prompt = self.identity(group.prompt)
            if prompt is None:
                continue
            mean = sum(len(sample.token_ids) for sample in group.samples) / len(group.samples)
            previous = self.history.get(prompt)
            self.history[prompt] = mean if previous is None else (1 - self.smoothing) * previous + self.smoothing * mean

    def prompt_history(self, prompt: Any) -> float | None:
        """The prompt's running mean length over the epochs it was trained in, or None before its first; what
        :class:`verl_partial.core.partial.length_batching.LengthBatcher` orders a window by, before any sample
        starts."""
        identity = self.identity(prompt)
        return None if identity is None else self.history.get(identity)

    def estimate(self, group: GroupState[Any]) -> float | None:
        """Expected total length of the group's unfinished samples, or None when nothing is known."""
        done = [len(sample.token_ids) for sample in group.samples if sample.finished]
        if done:
            return sum(done) / len(done)
        return self.prompt_history(group.prompt)

    def priority(self, group: GroupState[Any], sample: SampleState) -> float:
        """Sort key for :meth:`RolloutPool.runnable` (ascending): longest expected remaining work first.

        Unknown samples sort before every estimate (probe first); a sample that already outgrew its estimate
        is expected to need at least one more token.
        """
        expected = self.estimate(group)
        if expected is None:
            return float("-inf")
        return -max(1.0, expected - len(sample.token_ids))


def length_estimator(config: PartialConfig, identity: Callable[[Any], Hashable | None]) -> LengthEstimator | None:
    """The estimator a run needs: for ``partial.schedule=longest_first``, for ``partial.length_window_steps``, or
    for both (one history serves both); None when neither is on. Shared by the trainer and the simulator."""
    needed = config.schedule == "longest_first" or config.length_window_steps > 0
    return LengthEstimator(identity) if needed else None
