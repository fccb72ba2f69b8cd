"""Parked multi-turn trajectories (``verl_partial.core.partial.trajectory``): a trajectory parked anywhere -- mid model
turn, or between turns with tool calls pending -- and resumed through a checkpoint ends with exactly the tokens,
masks and log-probs of an uninterrupted run, and runs each tool call once."""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest

from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import RolloutPool, SegmentResult
from verl_partial.core.partial.trajectory import NO_VERSION, Phase, Trajectory

EOS, CALL = 2, 50
RESPONSE_LENGTH = 64
PROMPT = [7, 8, 9]
# The scripted model: turn k's tokens, whatever segments they are produced in. A turn holding CALL calls the
# tool with the token after it as argument.
TURNS = [[11, CALL, 5, 13, EOS], [21, CALL, 6, 23, EOS], [31, 32, 33, EOS]]


def tool_output(argument: int) -> list[int]:
    return [70, argument + 1, 71]


def log_prob(context: np.ndarray) -> float:
    """A deterministic stand-in for the policy's log-prob of the last token given everything before it: any
    difference in the context a resumed segment sees changes it."""
    return -(zlib.crc32(context.astype(np.int32).tobytes()) % 1000) / 1000.0


def parse_calls(turn: np.ndarray) -> list[dict]:
    ids = turn.tolist()
    return [{"name": "tool", "arguments": ids[i + 1]} for i, token in enumerate(ids[:-1]) if token == CALL]


class Loop:
    """A minimal driver in the shape of verl's ToolAgentLoop, one segment per call, counting tool executions."""

    def __init__(self, max_assistant_turns: int | None = None) -> None:
        self.executions: list[dict] = []
        self.max_assistant_turns = max_assistant_turns

    def segment(self, traj: Trajectory, grant: int, version: int) -> None:
        if traj.phase is Phase.TOOL_CALLS:
            output = [token for call in traj.pending_calls for token in self._execute(call)]
            traj.add_tool_output(output, RESPONSE_LENGTH)
            return
        script = TURNS[traj.assistant_turns]
        produced = len(traj.turn_ids())
        new = script[produced : produced + grant]
        context = traj.context_ids()
        log_probs = []
        for token in new:
            context = np.append(context, token)
            log_probs.append(log_prob(context))
        traj.add_model_tokens(new, log_probs, version, RESPONSE_LENGTH)
        if new and new[-1] == EOS:
            traj.end_model_turn(parse_calls(traj.turn_ids()), RESPONSE_LENGTH, self.max_assistant_turns)

    def _execute(self, call: dict) -> list[int]:
        self.executions.append(call)
        return tool_output(call["arguments"])


def run(grant: int, checkpoint_every_segment: bool) -> tuple[Trajectory, Loop, list[int]]:
    loop, traj, version, phases = Loop(), Trajectory(PROMPT), 0, []
    while not traj.done:
        loop.segment(traj, grant, version)
        phases.append(traj.phase)
        if checkpoint_every_segment:
            traj = Trajectory.from_state_dict(pickle.loads(pickle.dumps(traj.state_dict())))
            version += 1
    return traj, loop, phases


def test_parked_after_every_segment_matches_an_uninterrupted_run_token_for_token():
    whole, whole_loop, _ = run(grant=100, checkpoint_every_segment=False)
    parked, parked_loop, phases = run(grant=2, checkpoint_every_segment=True)
    assert Phase.TOOL_CALLS in phases  # parked between turns with calls pending, not only mid-turn
    np.testing.assert_array_equal(parked.response_ids, whole.response_ids)
    np.testing.assert_array_equal(parked.response_mask, whole.response_mask)
    np.testing.assert_array_equal(parked.log_probs, whole.log_probs)
    expected_ids = TURNS[0] + tool_output(5) + TURNS[1] + tool_output(6) + TURNS[2]
    assert parked.response_ids.tolist() == expected_ids
    expected_mask = [1] * 5 + [0] * 3 + [1] * 5 + [0] * 3 + [1] * 4
    assert parked.response_mask.tolist() == expected_mask
    # Tool tokens carry no log-prob and no policy version; model tokens the version of their own segment.
    assert np.all(parked.log_probs[parked.response_mask == 0] == 0)
    assert np.all(parked.versions[parked.response_mask == 0] == NO_VERSION)
    model_versions = parked.versions[parked.response_mask == 1]
    assert np.all(model_versions >= 0) and len(set(model_versions.tolist())) > 1
    assert np.all(np.diff(model_versions) >= 0)
    # Each call ran exactly once, in both runs; verl's turn count.
    assert (
        parked_loop.executions
        == whole_loop.executions
        == [{"name": "tool", "arguments": 5}, {"name": "tool", "arguments": 6}]
    )
    assert (parked.tool_calls_made, parked.assistant_turns, parked.user_turns, parked.num_turns) == (2, 3, 2, 6)


def test_parked_mid_turn_resumes_the_same_turn_and_the_parser_sees_all_of_it():
    loop, traj = Loop(), Trajectory(PROMPT)
    loop.segment(traj, grant=2, version=0)  # [11, CALL]: the call's argument is not generated yet
    assert traj.mid_turn and traj.phase is Phase.MODEL_TURN and traj.assistant_turns == 0
    traj = Trajectory.from_state_dict(traj.state_dict())
    loop.segment(traj, grant=10, version=1)
    assert traj.phase is Phase.TOOL_CALLS and not traj.mid_turn
    assert traj.pending_calls == [{"name": "tool", "arguments": 5}]
    assert traj.versions.tolist() == [0, 0, 1, 1, 1]


def test_parked_with_calls_pending_runs_them_once_and_never_again():
    loop, traj = Loop(), Trajectory(PROMPT)
    loop.segment(traj, grant=10, version=0)
    assert traj.phase is Phase.TOOL_CALLS and loop.executions == []
    resumed = Trajectory.from_state_dict(pickle.loads(pickle.dumps(traj.state_dict())))
    loop.segment(resumed, grant=10, version=1)
    assert len(loop.executions) == 1 and resumed.pending_calls == []
    assert resumed.phase is Phase.MODEL_TURN and resumed.turn_start == len(resumed.response_ids)
    with pytest.raises(RuntimeError, match="cannot add tool output in phase model_turn"):
        resumed.add_tool_output(tool_output(5), RESPONSE_LENGTH)
    ids = resumed.response_ids.tolist()
    assert sum(ids[i : i + 3] == tool_output(5) for i in range(len(ids))) == 1


def test_step_token_budget_counts_model_tokens_and_response_length_counts_all():
    """The pool holds a multi-turn sample's model tokens (its budget view) and the trajectory (the whole response)."""
    pool = RolloutPool(
        PartialConfig(step_token_budget=5, staleness_policy="restart", refill=False),
        group_size=1,
        batch_groups=1,
        response_length=10,
    )
    pool.admit({"row": 0}, "g0")
    pool.begin_step(1, 0)
    (ref,) = pool.runnable()
    traj = Trajectory(PROMPT)
    traj.add_model_tokens([11, CALL, 5], [-0.1] * 3, 0, 10)
    traj.end_model_turn(parse_calls(traj.turn_ids()), 10)
    traj.add_tool_output([70, 71, 72, 73], 10)
    assert traj.model_tokens == 3 and len(traj.response_ids) == 7
    pool.start(ref, "s0")
    model_ids, model_log_probs = traj.response_ids[traj.response_mask == 1], traj.log_probs[traj.response_mask == 1]
    pool.finish_segment(ref, SegmentResult(model_ids, model_log_probs, Finish.LENGTH, "s0", payload=traj.state_dict()))
    assert pool.start(ref, "s0").max_new_tokens == 2  # 5 - 3 model tokens: the 4 tool tokens do not count
    with pytest.raises(ValueError, match="overflow the response"):
        traj.add_model_tokens([1, 2, 3, 4], [0.0] * 4, 0, response_length=10)  # 7 + 4 > 10: all tokens count


def test_tool_output_that_would_fill_the_response_ends_the_trajectory_without_it():
    traj = Trajectory(PROMPT)
    traj.add_model_tokens([11, CALL, 5, EOS], [-0.1] * 4, 0, RESPONSE_LENGTH)
    traj.end_model_turn(parse_calls(traj.turn_ids()), 7)
    assert traj.add_tool_output([70, 6, 71], response_length=7) is Phase.DONE
    assert traj.response_ids.tolist() == [11, CALL, 5, EOS]
    assert traj.tool_calls_made == 1 and traj.pending_calls == [] and traj.user_turns == 0


def test_context_merge_may_trim_the_last_turn_like_verls_alignment():
    traj = Trajectory(PROMPT)
    traj.add_model_tokens([11, CALL, 5, EOS], [-0.1, -0.2, -0.3, -0.4], 0, RESPONSE_LENGTH)
    traj.end_model_turn(parse_calls(traj.turn_ids()), RESPONSE_LENGTH)
    traj.add_tool_output([1, 70, 6, 71], RESPONSE_LENGTH, removed_tokens=1)
    assert traj.response_ids.tolist() == [11, CALL, 5, 1, 70, 6, 71]
    assert traj.response_mask.tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert traj.log_probs[:3].tolist() == pytest.approx([-0.1, -0.2, -0.3])


def test_turn_limit_ends_the_trajectory_with_its_calls_unrun():
    loop, traj = Loop(max_assistant_turns=1), Trajectory(PROMPT)
    loop.segment(traj, grant=10, version=0)
    assert traj.done and traj.pending_calls == [] and loop.executions == []


def test_state_is_compact_and_round_trips_as_copies():
    traj, _, _ = run(grant=3, checkpoint_every_segment=False)
    state = traj.state_dict()
    assert state["response_ids"].dtype == np.int32 and state["response_mask"].dtype == np.int8
    assert state["log_probs"].dtype == np.float32 and state["versions"].dtype == np.int32
    assert traj.nbytes == 4 * len(PROMPT) + (4 + 1 + 4 + 4) * len(traj.response_ids)
    state["response_ids"][0] = -5
    assert traj.response_ids[0] == 11
    again = Trajectory.from_state_dict(traj.state_dict())
    assert again.state_dict().keys() == state.keys()
    for key in ("response_ids", "response_mask", "log_probs", "versions", "prompt_ids"):
        np.testing.assert_array_equal(getattr(again, key), getattr(traj, key))
    assert (again.phase, again.num_turns, again.tool_calls_made) == (traj.phase, traj.num_turns, traj.tool_calls_made)


def test_inconsistent_state_is_refused():
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory(PROMPT, response_ids=[1, 2], response_mask=[1], log_probs=[0.0, 0.0], versions=[0, 0])
    traj = Trajectory(PROMPT)
    with pytest.raises(RuntimeError, match="cannot end a model turn in phase done"):
        traj.finish()
        traj.end_model_turn([], RESPONSE_LENGTH)


def test_pool_keeps_a_trajectory_payload_through_a_checkpoint_and_drops_it_on_restart():
    """The pool's hook for multi-turn samples: the loop's state rides on the sample, opaque to the pool."""

    def new_pool() -> RolloutPool[dict]:
        return RolloutPool(
            PartialConfig(max_staleness=0, staleness_policy="restart", refill=False),
            group_size=1,
            batch_groups=1,
            response_length=64,
        )

    pool = new_pool()
    pool.admit({"row": 0}, "g0")
    pool.begin_step(1, 0)
    (ref,) = pool.runnable()
    pool.start(ref, "s0")
    traj = Trajectory(PROMPT)
    traj.add_model_tokens([11, CALL], [-0.1, -0.2], 0, RESPONSE_LENGTH)
    ids, log_probs = np.array([11, CALL], np.int32), np.array([-0.1, -0.2], np.float32)
    pool.finish_segment(ref, SegmentResult(ids, log_probs, Finish.LENGTH, "s0", payload=traj.state_dict()))
    restored = new_pool()
    restored.load_state_dict(pickle.loads(pickle.dumps(pool.state_dict())))
    parked = Trajectory.from_state_dict(restored.sample(ref).payload)
    assert parked.mid_turn and parked.response_ids.tolist() == [11, CALL]
    # A result without a payload (e.g. a call cancelled before it reached its server) keeps the parked one.
    restored.begin_step(2, 0)
    restored.start(ref, "s0")
    restored.finish_segment(ref, SegmentResult(ids[:0], log_probs[:0], Finish.ABORTED, "s0"))
    assert restored.sample(ref).payload is not None
    # Restarted for staleness: regenerated from the prompt, its old trajectory with it.
    restored.begin_step(3, 1)
    assert restored.sample(ref).payload is None and len(restored.sample(ref).token_ids) == 0
