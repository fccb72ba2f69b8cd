"""Rows built while the step generates (``PartialAgentLoopWorker.score`` then ``hand_over``).

The hand-over ran verl's ``_agent_loop_postprocess`` for every trained sample at the step end, while every engine
idled (50-80 ms a step for 64 short answers on the peer benchmark; per sample it pads to the prompt and response
budgets, so it grows with them). Rows are now built after a group is scored, during the step. These tests run the
real worker class with verl's own ``_agent_loop_postprocess`` and ``_postprocess`` on the demo tokenizer, and check
that a row built ahead is the row the hand-over would have built, that only the same answer reuses it, and that the
rows of groups that will never be handed over are dropped.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl import DataProto

from verl_partial.core.partial.group_filter import SampleScore
from verl_partial.glue.partial.agent_loop import FinishedSample, PartialAgentLoopWorker

PROMPT_LENGTH, RESPONSE_LENGTH = 8, 6


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


class CountingWorker(PartialAgentLoopWorker):
    """The real worker; it counts the rows it builds (verl's method runs unchanged)."""

    rows_built = 0

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        self.rows_built += 1
        return await super()._agent_loop_postprocess(output, validate, **kwargs)


def worker_with(tokenizer, distillation: bool = False) -> CountingWorker:
    """The worker with only the state verl's row building reads (verl's AgentLoopWorker needs a cluster)."""
    worker = CountingWorker.__new__(CountingWorker)
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.mm_processor_kwargs = None
    worker.rollout_config = SimpleNamespace(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    worker.reward_loop_worker_handles = None  # _compute_score is verl's; a scored sample never reaches it
    worker.distillation_enabled = distillation
    worker.tool_loop = None
    worker.rows_ahead = {}
    return worker


def sample(tokens: list[int], reward: float) -> FinishedSample:
    return FinishedSample(
        np.array([3, 4, 5], np.int32),
        np.array(tokens, np.int32),
        np.linspace(-0.5, -0.1, len(tokens)).astype(np.float32),
        score=SampleScore(reward, {"acc": reward}),
    )


def row(prompt: str) -> dict[str, object]:
    return {"raw_prompt": [{"role": "user", "content": prompt}], "data_source": "demo"}


def objects(values: list[object]) -> np.ndarray:
    """A 1-D object column, one value a row (``np.array`` would make a 2-D array of a list of lists)."""
    column = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        column[index] = value
    return column


def trainer_rows(prompts: list[str]) -> DataProto:
    """The trainer's prompt rows as the hand-over gets them (a uid the workers never saw included)."""
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": objects([row(p)["raw_prompt"] for p in prompts]),
            "data_source": np.array(["demo"] * len(prompts), dtype=object),
            "uid": np.array([f"u{i}" for i in range(len(prompts))], dtype=object),
        }
    )


def assert_same_rows(ours: DataProto, theirs: DataProto) -> None:
    assert set(ours.batch.keys()) == set(theirs.batch.keys())
    for key in ours.batch.keys():
        assert torch.equal(ours.batch[key], theirs.batch[key]), key
    assert set(ours.non_tensor_batch) == set(theirs.non_tensor_batch)
    for key, values in ours.non_tensor_batch.items():
        assert values.tolist() == theirs.non_tensor_batch[key].tolist(), key


def ahead_then_fresh(tokenizer, scored, handed) -> tuple[DataProto, DataProto, CountingWorker]:
    """Rows of one group built ahead from ``scored`` and handed over as ``handed``, beside the same hand-over on a
    worker that built nothing ahead."""
    keys = [("g", index) for index in range(len(scored))]
    trainer = trainer_rows(["p"] * len(scored))

    async def run() -> tuple[DataProto, DataProto, CountingWorker]:
        ahead = worker_with(tokenizer)
        ahead._build_rows_ahead([row("p")] * len(scored), scored, keys)
        reused = await ahead.hand_over(trainer, handed, keys, keep=[])
        return reused, await worker_with(tokenizer).hand_over(trainer, handed, keys, keep=[]), ahead

    return asyncio.run(run())


def test_a_row_built_ahead_is_the_row_the_hand_over_builds_and_the_hand_over_builds_none(tokenizer):
    samples = [sample([7, 8, 9], 1.0), sample([10, 2], 0.0)]
    with_rows_ahead, at_hand_over, ahead = ahead_then_fresh(tokenizer, samples, samples)
    assert ahead.rows_built == 2 and ahead.rows_ahead == {}  # each row built once, ahead
    assert_same_rows(with_rows_ahead, at_hand_over)
    assert with_rows_ahead.batch["rm_scores"].sum().item() == 1.0
    assert with_rows_ahead.non_tensor_batch["raw_prompt"].tolist() == [row("p")["raw_prompt"]] * 2


def test_only_the_same_answer_with_the_same_reward_reuses_a_row_built_ahead(tokenizer):
    """A group restarted after it was scored finishes again with other tokens; a reward recorded differently must
    not ride on an old row either. Both are built again at the hand-over, from what is handed over."""
    scored = [sample([7, 8, 9], 1.0), sample([10, 2], 0.0)]
    handed = [sample([7, 8, 11], 1.0), sample([10, 2], 0.5)]
    reused, fresh, ahead = ahead_then_fresh(tokenizer, scored, handed)
    assert ahead.rows_built == 4  # ahead, then again from what was handed over
    assert_same_rows(reused, fresh)
    assert reused.batch["responses"][0, :3].tolist() == [7, 8, 11]


def test_rows_of_groups_neither_handed_over_nor_in_the_pool_are_dropped(tokenizer):
    """A group the filter took out (or one restarted) is never handed over: its rows must not pile up on the
    worker step after step; those of groups still in the pool stay for a later hand-over."""
    samples = [sample([7, 8], 1.0)]

    async def run() -> CountingWorker:
        worker = worker_with(tokenizer)
        for key in ("trained", "filtered", "waiting"):
            worker._build_rows_ahead([row("p")], samples, [(key, 0)])
        await worker.hand_over(trainer_rows(["p"]), samples, [("trained", 0)], keep=["waiting"])
        return worker

    worker = asyncio.run(run())
    assert list(worker.rows_ahead) == [("waiting", 0)]


def test_no_row_is_built_ahead_for_a_distilled_run_or_a_multi_turn_trajectory(tokenizer):
    """The distillation teacher reads the trainer's row at the hand-over, and a trajectory's row comes from the tool
    loop: both are built there, as before."""
    worker = worker_with(tokenizer, distillation=True)
    worker._build_rows_ahead([row("p")], [sample([7], 1.0)], [("g", 0)])
    assert worker.rows_ahead == {}
    trajectory = FinishedSample(np.array([3], np.int32), np.array([7], np.int32), np.array([-0.1], np.float32), {})
    worker = worker_with(tokenizer)
    worker._build_rows_ahead([row("p")], [trajectory], [("g", 0)])
    assert worker.rows_ahead == {}


def test_a_row_built_ahead_holds_32_bytes_a_prompt_budget_token_and_44_a_response_budget_token(tokenizer):
    """What rows built ahead cost a worker's memory (docs/method/partial-rollout.md: 736 KiB a row at 1k/16k budgets,
    up to 1.4 GiB per worker at 512 x 16): verl pads each row to both budgets, whatever the answer's length. A change
    in verl's row layout changes that bound, and this fails."""

    async def built() -> object:
        worker = worker_with(tokenizer)
        worker._build_rows_ahead([row("p")], [sample([7, 8], 1.0)], [("g", 0)])
        return await worker.rows_ahead[("g", 0)].row

    output = asyncio.run(built())
    tensors = [value for value in vars(output).values() if isinstance(value, torch.Tensor)]
    assert sum(tensor.untyped_storage().nbytes() for tensor in tensors) == 32 * PROMPT_LENGTH + 44 * RESPONSE_LENGTH
