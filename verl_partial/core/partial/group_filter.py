"""DAPO's dynamic sampling under partial rollout: whole groups whose rewards do not vary are never trained.

verl 0.9.1 implements ``algorithm.filter_groups`` in its v1 replay buffer only (``trainer/ppo/v1/replay_buffer.py``,
``_dapo_filtered_keys``): a finished group whose metric has zero standard deviation across its samples carries no
GRPO advantage and is evicted, and fresh prompts are drawn in its place. The same rule here, without verl or Ray: the
pool judges each group once it is finished, before it can count towards a step; a group that fails is taken out and
counted (``partial/filtered_groups``, ``partial/filtered_tokens``), and the step keeps drawing prompts until
``train_batch_size`` groups passed -- at most ``max_num_gen_batches`` x ``train_batch_size`` groups judged per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The config group, named in every refusal.
FILTER_GROUPS_KEY = "algorithm.filter_groups"
# ``metric: reward`` reads each sample's reward score (verl: the sum of ``rm_scores``, the canonical pre-KL reward);
# any other name reads that field of the sample's ``reward_extra_info`` (e.g. ``acc``), as v1 does.
REWARD_METRIC = "reward"


@dataclass(frozen=True)
class SampleScore:
    """A finished sample's reward as verl's reward loop computed it: the score and its ``reward_extra_info``. Kept on
    the group so the hand-over reuses it instead of scoring the sample again."""

    reward: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupFilter:
    """``algorithm.filter_groups`` with ``enable: true``: the metric and the bound on draws per step (``<= 0``: none,
    as in verl's DAPO recipe)."""

    metric: str = REWARD_METRIC
    max_num_gen_batches: int = 0

    def values(self, key: str, scores: Sequence[SampleScore]) -> list[float]:
        """The metric of each sample of group ``key``; refuses a sample whose reward does not report it."""
        if self.metric == REWARD_METRIC:
            return [float(score.reward) for score in scores]
        missing = [index for index, score in enumerate(scores) if self.metric not in score.extra]
        if missing:
            raise ValueError(
                f"{FILTER_GROUPS_KEY}.metric={self.metric!r}: samples {missing} of group {key} have no such field in "
                f"their reward_extra_info (they report {sorted(scores[missing[0]].extra)}); use metric=reward or a "
                "field your reward function returns"
            )
        return [float(score.extra[self.metric]) for score in scores]

    def passes(self, key: str, scores: Sequence[SampleScore]) -> bool:
        """v1's rule: a group of two or more samples whose metric has zero standard deviation is filtered out."""
        values = self.values(key, scores)
        return len(values) <= 1 or float(np.std(values)) != 0.0

    def check_bound(self, judged: int, passed: int, batch_groups: int) -> None:
        """Refuse to keep drawing: ``judged`` groups judged this step reached ``max_num_gen_batches`` batches while
        fewer than ``batch_groups`` passed (verl's DAPO recipe raises likewise)."""
        limit = self.max_num_gen_batches * batch_groups
        if self.max_num_gen_batches > 0 and judged >= limit and passed < batch_groups:
            raise RuntimeError(
                f"{FILTER_GROUPS_KEY}.max_num_gen_batches={self.max_num_gen_batches}: this step judged {judged} "
                f"groups ({self.max_num_gen_batches} x data.train_batch_size={batch_groups}) and only {passed} have "
                f"rewards that vary by {self.metric!r}; the data may be too easy or too hard. Raise "
                f"{FILTER_GROUPS_KEY}.max_num_gen_batches, or set it to 0 to draw without bound"
            )
