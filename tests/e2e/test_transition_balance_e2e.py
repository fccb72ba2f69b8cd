"""One training row per transition (``balance.rows=transition``) on verl's real trainer, balanced by trajectory.

verl's ``ToolAgentLoop`` with the demo calculator on our CPU engine, 2 data-parallel FSDP ranks: every multi-turn
rollout is cut into one row per model turn where verl balances the batch, and ``+balance=group`` with
``balance.group_key=trajectory_id`` keeps each trajectory's transitions in one optimizer step. Everything asserted
comes from verl's own file logger. The control run groups by the turn number instead (a key that does not keep
trajectories together) and must report split trajectories, so the metric can fail.
"""

from __future__ import annotations

import pytest
from harness import Run, run_trainer

from verl_partial.demo.assets import tool_overrides
from verl_partial.demo.tools import TOOL_DELAY_ENV

pytestmark = pytest.mark.e2e

STEPS = 3
# 8 prompts x 4 samples = 32 trajectories; ppo_mini_batch_size 4 prompts -> mini-batches of 16 rows, 8 per rank.
# Transitions outnumber trajectories, so every step has several optimizer steps a trajectory could straddle.
TRANSITIONS = (
    *tool_overrides(),
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.test_freq=0",
    "+balance=group",
    "balance.rows=transition",
)
MINI_BATCH_ROWS = 16


def _run(assets, output_dir, steps: int, *extra: str, **options) -> Run:
    run = run_trainer(assets, output_dir, steps=steps, extra=[*TRANSITIONS, *extra], **options)
    run.assert_ok()
    for step in range(1, steps + 1):
        print(
            f"{output_dir.name} step {step}: "
            + ", ".join(
                f"{key}={run.metric(step, key):g}" for key in sorted(run.steps[step]) if key.startswith("balance/")
            )
        )
    return run


@pytest.fixture(scope="module")
def by_trajectory(demo_tool_assets, tmp_path_factory) -> Run:
    return _run(demo_tool_assets, tmp_path_factory.mktemp("by_trajectory"), STEPS, "balance.group_key=trajectory_id")


@pytest.fixture(scope="module")
def with_partial(demo_tool_assets, tmp_path_factory) -> Run:
    # A random 0-2 s tool delay makes step ends find conversations between turns, so parked and resumed
    # trajectories reach the transition cut (as in test_tool_agent_e2e).
    return _run(
        demo_tool_assets,
        tmp_path_factory.mktemp("with_partial"),
        STEPS,
        "balance.group_key=trajectory_id",
        partial="default",
        env={TOOL_DELAY_ENV: "2"},
    )


@pytest.fixture(scope="module")
def by_turn(demo_tool_assets, tmp_path_factory) -> Run:
    # Rows grouped by turn number: a turn's group is larger than a mini-batch, so it is cut (split mode).
    return _run(
        demo_tool_assets,
        tmp_path_factory.mktemp("by_turn"),
        2,
        "balance.group_key=turn_index",
        "balance.on_infeasible=split",
    )


@pytest.fixture(params=["sync", "partial"])
def transition_run(request) -> Run:
    return request.getfixturevalue("by_trajectory" if request.param == "sync" else "with_partial")


def test_transitions_of_a_trajectory_share_one_optimizer_step(transition_run):
    run = transition_run
    for step in range(1, STEPS + 1):
        trajectories = run.metric(step, "balance/trajectories")
        rows = run.metric(step, "balance/transition_rows")
        padding = run.metric(step, "balance/padding_rows")
        assert trajectories == 32
        assert rows > trajectories  # transitions were really emitted: the calculator adds turns
        assert run.metric(step, "balance/rows_per_trajectory/max") >= 2
        assert (rows + padding) % MINI_BATCH_ROWS == 0 and padding < MINI_BATCH_ROWS
        assert run.metric(step, "balance/num_minibatches") == (rows + padding) / MINI_BATCH_ROWS >= 2
        assert run.metric(step, "balance/trajectories_split") == 0
        assert run.metric(step, "balance/groups_split") == 0
        assert run.metric(step, "balance/efficiency") >= 1.0  # finite (Run.metric), reported every step
        # verl trained on the transition rows: its own sample count and the multi-turn reward path ran
        run.metric(step, "actor/pg_loss")
        assert 0 < run.metric(step, "critic/score/mean") <= 1


def test_a_key_that_ignores_trajectories_reports_them_split(by_turn):
    run = by_turn
    assert sum(run.metric(step, "balance/trajectories_split") for step in (1, 2)) > 0
    for step in (1, 2):
        assert run.metric(step, "balance/transition_rows") > run.metric(step, "balance/trajectories")


def test_parked_trajectories_are_cut_into_transitions_with_partial_rollout(with_partial):
    """``+partial=default`` hands the cut whole trajectories that were parked and resumed across steps: they keep
    their transitions together and their tokens within the staleness bound."""
    run = with_partial
    for step in range(1, STEPS + 1):
        assert run.metric(step, "partial/staleness/max") <= 1
        assert run.metric(step, "partial/tokens_discarded") == 0
    assert max(run.metric(step, "partial/resumed_fraction") for step in range(1, STEPS + 1)) > 0
