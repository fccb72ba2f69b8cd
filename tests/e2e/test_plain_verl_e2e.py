"""What plain verl 0.9.1 does where verl-partial steps in, observed in one run of verl's own code paths.

The run uses verl's default ``_balance_batch`` (measured, not changed, by ``balance.enable=false``) and
verl's native bypass-mode rollout correction (no block of ours, so our fix stays inert). It is the
"before" half of the group-balancing and bypass end-to-end checks.
"""

from __future__ import annotations

import pytest
from harness import Run, run_trainer
from test_balance_e2e import TWO_RANKS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def plain_run(demo_assets, tmp_path_factory) -> Run:
    run = run_trainer(
        demo_assets,
        tmp_path_factory.mktemp("plain_verl"),
        steps=2,
        extra=[
            *TWO_RANKS,
            "+balance=group",
            "balance.enable=false",
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=token",
        ],
    )
    run.assert_ok()
    return run


def test_verls_default_balancing_splits_groups(plain_run):
    assert max(plain_run.metric(step, "balance/groups_split") for step in (1, 2)) > 0


def test_verl_native_bypass_never_reaches_the_workers(plain_run):
    """verl #4912/#4272: the driver skips the old-log-prob pass, but the workers keep their default loss."""
    for step in (1, 2):
        assert "timing_s/old_log_prob" not in plain_run.steps[step]
        assert not [key for key in plain_run.steps[step] if key.startswith("actor/rollout_corr/")]
