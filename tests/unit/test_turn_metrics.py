"""Multi-turn metrics split by turn (``verl_partial.core.partial.turn_metrics``), on trajectories built through the
``Trajectory`` transitions the tool loop uses: which turn a token belongs to, per-turn staleness, and where
trajectories were parked at a step end."""

from __future__ import annotations

import numpy as np
import pytest

from verl_partial.core.partial.trajectory import Trajectory
from verl_partial.core.partial.turn_metrics import model_turn_of_tokens, parked_turn_metrics, trained_turn_metrics

RESPONSE_LENGTH = 200
CALL = {"name": "calculator", "arguments": '{"expression": "1+1"}'}


def trajectory(turns: list[list[int]], *, calls_last: bool = False, end: bool = True) -> Trajectory:
    """Turn ``k`` generated as segments of ``turns[k]`` tokens each, one policy version per segment (the list
    holds the versions); a tool output of 3 tokens between turns."""
    traj = Trajectory(prompt_ids=[1, 2, 3])
    for index, versions in enumerate(turns):
        for version in versions:
            traj.add_model_tokens([10, 11], [-0.5, -0.25], version, RESPONSE_LENGTH)
        last = index == len(turns) - 1
        if not last or end:
            traj.end_model_turn([CALL] if not last or calls_last else [], RESPONSE_LENGTH)
        if not last:
            traj.add_tool_output([70, 71, 72], RESPONSE_LENGTH)
    return traj


def test_turn_of_each_token_follows_the_mask_runs():
    traj = trajectory([[0, 1], [1], [2, 2]])
    turn = model_turn_of_tokens(traj.response_mask)
    assert turn.tolist() == [1, 1, 1, 1, 0, 0, 0, 2, 2, 0, 0, 0, 3, 3, 3, 3]
    assert model_turn_of_tokens(np.zeros(0, dtype=np.int8)).tolist() == []


def test_trained_metrics_split_tokens_and_staleness_by_turn():
    # Trained at version 2. Trajectory A: turn 1 half at v0, half at v1; turn 2 at v1; turn 3 at v2.
    a = trajectory([[0, 1], [1], [2]])
    # B: one turn, on-policy, no tool call. C: five turns, the tail bucket (4+) gets turns 4 and 5.
    b = trajectory([[2]])
    c = trajectory([[2], [2], [2], [1], [2, 2]])
    metrics = trained_turn_metrics([a.state_dict(), b.state_dict(), c.state_dict()], version=2)
    assert metrics["partial/turns_per_sample/mean"] == pytest.approx((a.num_turns + b.num_turns + c.num_turns) / 3)
    assert metrics["partial/tool_calls"] == 2 + 0 + 4
    assert [metrics[f"partial/turn_{k}/trajectories"] for k in (1, 2, 3)] == [3, 2, 2]
    assert metrics["partial/turn_4plus/trajectories"] == 1
    assert [metrics[f"partial/turn_{k}/model_tokens"] for k in (1, 2, 3)] == [4 + 2 + 2, 2 + 2, 2 + 2]
    assert metrics["partial/turn_4plus/model_tokens"] == 2 + 4
    # Turn 1: A's 4 tokens lag 2 and 1, B and C on-policy -> 4 stale of 8, max lag 2.
    assert metrics["partial/turn_1/stale_fraction"] == pytest.approx(4 / 8)
    assert metrics["partial/turn_1/staleness_max"] == 2
    assert metrics["partial/turn_2/stale_fraction"] == pytest.approx(2 / 4)
    assert metrics["partial/turn_3/stale_fraction"] == 0 and metrics["partial/turn_3/staleness_max"] == 0
    assert metrics["partial/turn_4plus/stale_fraction"] == pytest.approx(2 / 6)
    # The per-turn counts add up to the trajectories' model tokens.
    total = sum(metrics[f"partial/{name}/model_tokens"] for name in ("turn_1", "turn_2", "turn_3", "turn_4plus"))
    assert total == a.model_tokens + b.model_tokens + c.model_tokens


def test_a_turn_with_no_tokens_reports_no_staleness():
    metrics = trained_turn_metrics([trajectory([[0]]).state_dict()], version=0)
    assert metrics["partial/turn_2/model_tokens"] == 0
    assert "partial/turn_2/stale_fraction" not in metrics
    assert trained_turn_metrics([], version=0) == {}


def test_parked_trajectories_are_counted_by_where_they_stand():
    mid_first_turn = trajectory([[0]], end=False)
    mid_second_turn = trajectory([[0], [0]], end=False)  # a tool call already made
    tools_pending = trajectory([[0]], calls_last=True)
    after_tool_output = trajectory([[0]], calls_last=True)
    after_tool_output.add_tool_output([70, 71], RESPONSE_LENGTH)
    not_started = Trajectory(prompt_ids=[1, 2, 3])
    finished = trajectory([[0]])
    metrics = parked_turn_metrics(
        t.state_dict()
        for t in (mid_first_turn, mid_second_turn, tools_pending, after_tool_output, not_started, finished)
    )
    assert metrics == {
        "partial/parked_trajectories/mid_turn": 2,
        "partial/parked_trajectories/between_turns": 2,
        "partial/parked_trajectories/tools_pending": 1,
        "partial/parked_trajectories/with_tool_output": 2,
    }
