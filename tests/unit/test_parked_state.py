"""What the pool reports about parked work matches what it holds, at production size (issue 19, failure 6).

``partial/parked_bytes`` is how a user sizes the driver's memory for partial rollout. It must count what parking
really holds: for a multi-turn sample that is the trajectory payload too (a second copy of its prompt and response
arrays, its message text), not only the model-token arrays. Measured independently with ``tracemalloc`` (numpy
reports its buffers to it), for real pool state built through the pool's own segment path.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from verl_partial.config.job import model_max_positions
from verl_partial.config.partial import PartialConfig
from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import REQUEST_ID_END, RolloutPool, SegmentResult
from verl_partial.core.partial.trajectory import Trajectory

# An ordinary job's scale per sample (512 prompts x 16 samples x 16k tokens): what matters is bytes per sample.
GROUPS, GROUP_SIZE, PROMPT, RESPONSE = 2, 16, 1_024, 16_384
TURNS, TOOL_OUTPUT, MESSAGE_CHARS = 4, 256, 2_000


def _pool() -> RolloutPool[dict]:
    return RolloutPool(
        PartialConfig(staleness_policy="keep", refill=False, extra_groups=GROUPS),
        group_size=GROUP_SIZE,
        batch_groups=1,
        response_length=RESPONSE + 4 * TOOL_OUTPUT,
    )


def _trajectory(seed: int, tokens: int) -> dict:
    """A tool-loop trajectory parked mid-turn: several model turns, tool outputs between them, the chat history."""
    rng = np.random.default_rng(seed)
    traj = Trajectory(prompt_ids=rng.integers(0, 150_000, PROMPT))
    per_turn = tokens // TURNS
    for turn in range(TURNS):
        traj.add_model_tokens(rng.integers(0, 150_000, per_turn), rng.standard_normal(per_turn), 0, 10**9)
        if turn < TURNS - 1:
            traj.end_model_turn([{"name": "calculator", "arguments": '{"x": 1}'}], 10**9)
            traj.add_tool_output(rng.integers(0, 150_000, TOOL_OUTPUT), 10**9)
    traj.messages = [
        {"role": role, "content": "".join(rng.choice(list("abcdefgh "), MESSAGE_CHARS))}
        for role in ("system", "user", "assistant", "tool", "assistant", "tool", "assistant")
    ]
    return traj.state_dict()


def _park(pool: RolloutPool[dict], multi_turn: bool) -> None:
    """Admit groups and give every sample one long segment, as the scheduler would (ABORTED: parked)."""
    for index in range(GROUPS):
        pool.admit({}, f"g{index}")
    pool.begin_step(1, 0)
    for ref in pool.runnable():
        request = pool.start(ref, "server")
        seed = ref.group_id * GROUP_SIZE + ref.index
        tokens = RESPONSE // 2 + seed
        rng = np.random.default_rng(seed)
        pool.finish_segment(
            ref,
            SegmentResult(
                new_ids=rng.integers(0, 150_000, tokens).astype(np.int32),
                new_log_probs=rng.standard_normal(tokens).astype(np.float32),
                finish=Finish.ABORTED,
                server=request.server,
                prompt_ids=np.arange(PROMPT, dtype=np.int32),
                payload=_trajectory(seed, tokens) if multi_turn else None,
            ),
        )


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "multi_turn"])
def test_parked_bytes_is_what_parking_holds(multi_turn):
    _park(_pool(), multi_turn)  # warm-up: lazy imports and caches must not land in the measurement
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = _pool()
        _park(pool, multi_turn)
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    reported = pool.step_metrics([])["partial/parked_bytes"]
    assert pool.step_metrics([])["partial/parked_samples"] == GROUPS * GROUP_SIZE
    assert abs(reported - measured) <= 0.05 * measured, (reported, measured)
    if multi_turn:
        # Before issue 19's fix the payload was left out: the report then missed most of a parked conversation.
        arrays_only = sum(s.token_ids.nbytes + s.log_probs.nbytes + s.versions.nbytes for g in pool.groups.values()
                          for s in g.samples)  # fmt: skip
        assert arrays_only < 0.5 * measured


def test_request_ids_are_prefix_free():
    """SGLang's per-request abort matches ids by prefix: key/0/1 must not also abort key/0/10."""
    pool = RolloutPool(PartialConfig(), group_size=2, batch_groups=1, response_length=4)
    pool.admit({}, "e1-5")
    pool.begin_step(1, 0)
    ids = []
    for _ in range(12):  # relaunch sample 0 after a release, as a take-back at the step end does
        request = pool.start(pool.runnable()[0], "s")
        ids.append(request.request_id)
        pool.release(request.ref)
    assert all(not a.startswith(b) for a in ids for b in ids if a != b)
    assert all(request_id.endswith(REQUEST_ID_END) for request_id in ids)
    with pytest.raises(ValueError, match="must not contain"):
        pool.admit({}, f"bad{REQUEST_ID_END}key")


def test_the_models_positions_come_from_its_local_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert model_max_positions(str(tmp_path)) == 4096
    assert model_max_positions(str(tmp_path / "missing")) is None  # a hub id: the workers resolve it later
    assert model_max_positions(None) is None
