"""Rollout-correction presets take effect in the actor workers (issue 4), on the CPU backend."""

from __future__ import annotations

import pytest
from harness import run_trainer

pytestmark = pytest.mark.e2e


def test_bypass_preset_reaches_the_actor_and_skips_the_old_log_prob_pass(demo_assets, tmp_path):
    run = run_trainer(demo_assets, tmp_path, steps=1, extra=["+rollout_correction=pure_is", "trainer.test_freq=0"])
    run.assert_ok()
    metrics = run.steps[1]
    assert "timing_s/old_log_prob" not in metrics, "bypass uses the rollout log-probs as the old policy"
    # verl's bypass loss computes its correction inside the actor workers: only then do these appear.
    actor_corr = [key for key in metrics if key.startswith("actor/rollout_corr/")]
    assert actor_corr, sorted(metrics)
    run.metric(1, "actor/pg_loss")


def test_verl_native_bypass_never_reaches_the_workers(demo_assets, tmp_path):
    """The bug we fix: without our block, verl's own bypass flag leaves the workers on the default loss."""
    run = run_trainer(
        demo_assets,
        tmp_path,
        steps=1,
        extra=[
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=token",
            "trainer.test_freq=0",
        ],
    )
    run.assert_ok()
    assert not [key for key in run.steps[1] if key.startswith("actor/rollout_corr/")]
