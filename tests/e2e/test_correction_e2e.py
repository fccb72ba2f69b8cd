"""Rollout-correction presets take effect in the actor workers (issue 4), on the CPU backend.

The decoupled family is exercised by the partial-rollout run (``decoupled_token_is``, see
test_partial_e2e.py); the plain-verl counterpart of this test is in test_plain_verl_e2e.py.
"""

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
    assert [key for key in metrics if key.startswith("actor/rollout_corr/")], sorted(metrics)
    run.metric(1, "actor/pg_loss")
