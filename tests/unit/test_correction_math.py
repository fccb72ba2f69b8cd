"""Rollout-correction presets against verl 0.9.1's own math, on tensors, without Ray or a trainer.

Every expected value comes from calling verl's ``rollout_corr_helper`` / ``core_algos`` directly:
the point is that our config reaches verl's functions unchanged, that the ratio-bound direction is
what the docs say, and that the lag split and the all-rejected guard are thin layers over verl.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

from verl_partial.config.correction import PRESET_NAMES, VERL_PRESET_NAMES, RolloutCorrectionConfig, preset
from verl_partial.core.correction.math import split_by_lag, token_lags
from verl_partial.glue.correction import ALL_REJECTED_METRIC, guard_all_rejected, to_verl_config
from verl_partial.glue.dataproto import (
    POLICY_VERSION_KEY,
    STALE_TOKENS_METRIC,
    apply_staleness_mask,
    compute_lag_split_metrics,
)
from verl_partial.patches.correction import install_all_rejected_guard

torch.set_num_threads(1)

# The verl preset each seed-era name reproduces exactly; geo_rs has none (see test_geo_rs_*).
SEED_COUNTERPARTS = {
    "token_is": "decoupled_token_is",
    "seq_is": "decoupled_seq_is",
    "seq_is_rs": "decoupled_seq_is_rs",
    "ppo_is_bypass": "bypass_ppo_clip",
    "pure_is": "bypass_pg_is",
    "disabled": "disabled",
}
COMPARED_PRESETS = [name for name in PRESET_NAMES if name in VERL_PRESET_NAMES or name in SEED_COUNTERPARTS]
# Per-row log-ratio scales: from ~on-policy (kept by every band) to far off-policy (rejected by all).
ROW_SCALES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 0.1, 0.3, 1.0)


def _log_probs(seed: int, length: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, response_mask) with right padding and one mismatch scale per row."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(ROW_SCALES)
    rollout = -3.0 * torch.rand(rows, length, generator=generator)
    noise = torch.randn(rows, length, generator=generator) * torch.tensor(ROW_SCALES).unsqueeze(-1)
    lengths = torch.randint(3, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(-1)).float()
    return (rollout + noise) * mask, rollout * mask, mask


def _actor_config(rollout_correction: VerlConfig, loss_agg_mode: str = "token-mean") -> ActorConfig:
    """The actor config verl's worker builds, with the global batch info ``ppo_loss`` fills in."""
    config = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rollout_correction),
    )
    config.global_batch_info.update(dp_size=1, batch_num_tokens=64, global_batch_size=8, loss_scale_factor=None)
    return config


def _verl_preset(name: str) -> VerlConfig:
    return getattr(VerlConfig, SEED_COUNTERPARTS.get(name, name))()


def _assert_same_metrics(ours: dict[str, float], theirs: dict[str, float]) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value == theirs[key] or (math.isnan(value) and math.isnan(theirs[key])), key


def _driver_correction(config: VerlConfig, seed: int) -> tuple[DataProto, dict[str, float]]:
    old, rollout, mask = _log_probs(seed)
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    return compute_rollout_correction_and_add_to_batch(batch, config)


# --------------------------------------------------------------------------------------------
# (a) presets through our config == verl's own presets, on verl's functions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", COMPARED_PRESETS)
def test_preset_matches_verl_preset_on_tensors(name: str, seed: int) -> None:
    ours, theirs = to_verl_config(preset(name)), _verl_preset(name)
    if ours.bypass_mode:
        # Bypass: verl corrects inside the actor's loss against the current policy.
        old, rollout, mask = _log_probs(seed)
        advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))
        loss_fn = core_algos.get_policy_loss_fn("bypass_mode")
        results = [
            loss_fn(
                old_log_prob=rollout, log_prob=old, advantages=advantages, response_mask=mask, config=_actor_config(c)
            )
            for c in (ours, theirs)
        ]
        assert torch.equal(results[0][0], results[1][0])
        _assert_same_metrics(results[0][1], results[1][1])
        return
    (ours_batch, ours_metrics), (theirs_batch, theirs_metrics) = (
        _driver_correction(ours, seed),
        _driver_correction(theirs, seed),
    )
    assert torch.equal(ours_batch.batch["response_mask"], theirs_batch.batch["response_mask"])
    assert ("rollout_is_weights" in ours_batch.batch.keys()) == (ours.rollout_is is not None)
    if ours.rollout_is is not None:
        assert torch.equal(ours_batch.batch["rollout_is_weights"], theirs_batch.batch["rollout_is_weights"])
    _assert_same_metrics(ours_metrics, theirs_metrics)


def test_rejection_presets_reject_some_rows_and_keep_others() -> None:
    """The random batch exercises both outcomes, so the comparison above is not vacuous."""
    for name in ("seq_is_rs", "decoupled_geo_rs", "decoupled_k3_rs", "geo_rs"):
        batch, _ = _driver_correction(to_verl_config(preset(name)), seed=0)
        kept_rows = batch.batch["response_mask"].sum(dim=-1) > 0
        assert kept_rows.any() and not kept_rows.all(), name


def test_geo_rs_keeps_geometric_mean_ratio_in_symmetric_band() -> None:
    """Seed geo_rs: sequence kept iff exp(mean log r) in [1/1.001, 1.001] (and no token vetoed)."""
    geometric_means = torch.tensor([1.0005, 1 / 1.0005, 1.0015, 1 / 1.0015])
    rollout = torch.full((4, 6), -1.0)
    old = rollout + geometric_means.log().unsqueeze(-1)
    mask = torch.ones(4, 6)
    _, kept, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, **_rejection_kwargs(preset("geo_rs"))
    )
    assert kept.sum(dim=-1).gt(0).tolist() == [True, True, False, False]


def test_geo_rs_veto_rejects_sequence_with_one_catastrophic_token() -> None:
    """A single token with r < 1e-4 (or > 1e4) rejects its sequence even when the band would keep it."""
    wide_band = dataclasses.replace(preset("geo_rs"), rs_threshold=10.0)  # geometric mean in [0.1, 10]
    rollout = torch.full((3, 12), -1.0)
    log_ratio = torch.zeros(3, 12)
    log_ratio[0, 5] = math.log(1e-5)  # vetoed: below 1e-4
    log_ratio[1, 5] = math.log(1e-3)  # kept: extreme, but above the veto
    log_ratio[2, 5] = math.log(1e5)  # vetoed: above 1/1e-4
    _, kept, _ = compute_rollout_correction_and_rejection_mask(
        rollout + log_ratio, rollout, torch.ones(3, 12), **_rejection_kwargs(wide_band)
    )
    assert kept.sum(dim=-1).gt(0).tolist() == [False, True, False]


def _rejection_kwargs(cfg: RolloutCorrectionConfig) -> dict[str, object]:
    verl = to_verl_config(cfg)
    return {
        "rollout_is": verl.rollout_is,
        "rollout_rs": verl.rollout_rs,
        "rollout_rs_threshold": verl.rollout_rs_threshold,
    }


# --------------------------------------------------------------------------------------------
# (b) direction of the k1 bounds
# --------------------------------------------------------------------------------------------

RATIOS = torch.tensor([[0.7, 0.75, 0.9, 1.2, 1.3, 1.4]])


def test_verl_k1_lower_upper_bounds_one_over_r() -> None:
    """verl's token_k1 "0.8_1.5" keeps r in [1/1.5, 1/0.8] = [0.667, 1.25], not r in [0.8, 1.5]."""
    kept, _ = compute_rollout_rejection_mask(RATIOS.log(), torch.ones_like(RATIOS), "token_k1", "0.8_1.5")
    assert kept.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]


def test_our_k1_bounds_bound_r_itself() -> None:
    """rs_threshold_lower=0.8, rs_threshold=1.5 keeps exactly the tokens with 0.8 <= r <= 1.5."""
    cfg = RolloutCorrectionConfig(rs_mode="token_k1", rs_threshold=1.5, rs_threshold_lower=0.8)
    verl = to_verl_config(cfg)
    kept, _ = compute_rollout_rejection_mask(
        RATIOS.log(), torch.ones_like(RATIOS), verl.rollout_rs, verl.rollout_rs_threshold
    )
    assert kept.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0, 1.0]]


def test_our_geometric_bounds_bound_the_geometric_mean_ratio() -> None:
    """geo_rs with asymmetric bounds [0.8, 1.5] keeps sequences by exp(mean log r), in that direction."""
    cfg = dataclasses.replace(preset("geo_rs"), rs_threshold=1.5, rs_threshold_lower=0.8, rs_token_veto=None)
    rollout = torch.full((6, 4), -1.0)
    old = rollout + RATIOS.reshape(6, 1).log()
    _, kept, _ = compute_rollout_correction_and_rejection_mask(old, rollout, torch.ones(6, 4), **_rejection_kwargs(cfg))
    assert kept.sum(dim=-1).gt(0).tolist() == [False, False, True, True, True, True]


def test_verl_icepop_lower_upper_bounds_r_itself() -> None:
    """Unlike k1 rejection, the IS threshold "lower_upper" (IcePop) applies to r directly: no reflection."""
    weights, _ = compute_rollout_correction_weights(RATIOS.log(), torch.ones_like(RATIOS), "token", "0.8_1.5")
    assert torch.equal(weights > 0, torch.tensor([[False, False, True, True, True, True]]))
    assert to_verl_config(preset("decoupled_token_icepop")).rollout_is_threshold == "0.5_5.0"


# --------------------------------------------------------------------------------------------
# (d) lag-split metrics and the staleness mask
# --------------------------------------------------------------------------------------------

CURRENT_VERSION = 7


def _versioned_batch() -> DataProto:
    """Rows mixing lag 0 and lag 1 tokens (lag 1 further off-policy), one row of lag 2, padding."""
    generator = torch.Generator().manual_seed(3)
    rollout = -2.0 * torch.rand(4, 8, generator=generator)
    lags = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 0, 0],  # resumed sample: stale head, fresh tail
            [0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0],  # last two positions are padding
            [2, 2, 1, 1, 0, 0, 0, 0],
        ]
    )
    mask = torch.ones(4, 8)
    mask[2, 6:] = 0
    noise = torch.randn(4, 8, generator=generator) * (0.01 + 0.2 * lags)
    return DataProto.from_dict(
        tensors={
            "old_log_probs": (rollout + noise) * mask,
            "rollout_log_probs": rollout * mask,
            "response_mask": mask,
            POLICY_VERSION_KEY: CURRENT_VERSION - lags,
        }
    )


def test_lag_split_metrics_equal_verl_metrics_on_each_lag_subset() -> None:
    batch = _versioned_batch()
    cfg = preset("seq_is_rs")
    metrics = compute_lag_split_metrics(batch, cfg, CURRENT_VERSION)
    tensors = batch.batch
    lags = CURRENT_VERSION - tensors[POLICY_VERSION_KEY]
    for lag, expected_fraction in ((0, 17 / 30), (1, 11 / 30), (2, 2 / 30)):
        of_lag = (lags == lag) & tensors["response_mask"].bool()
        rows = of_lag.any(dim=-1)
        _, _, expected = compute_rollout_correction_and_rejection_mask(
            tensors["old_log_probs"][rows],
            tensors["rollout_log_probs"][rows],
            of_lag[rows].float(),
            **{k: v for k, v in to_verl_config(cfg).items() if k not in ("bypass_mode", "loss_type", "_target_")},
        )
        prefix = f"rollout_corr/lag_{lag}/"
        ours = {key.replace(prefix, "rollout_corr/"): value for key, value in metrics.items() if key.startswith(prefix)}
        assert ours.pop("rollout_corr/token_fraction") == pytest.approx(expected_fraction)
        _assert_same_metrics(ours, expected)
    assert metrics["rollout_corr/lag_1/kl"] != metrics["rollout_corr/lag_0/kl"]


def test_lag_split_in_bypass_mode_reports_token_fractions_only() -> None:
    metrics = compute_lag_split_metrics(_versioned_batch(), preset("pure_is"), CURRENT_VERSION)
    assert sorted(metrics) == [f"rollout_corr/lag_{lag}/token_fraction" for lag in (0, 1, 2)]


def test_lag_split_is_off_without_versions_or_when_disabled() -> None:
    batch = _versioned_batch()
    assert compute_lag_split_metrics(batch, dataclasses.replace(preset("token_is"), log_by_lag=False), 7) == {}
    batch.batch.pop(POLICY_VERSION_KEY)
    assert compute_lag_split_metrics(batch, preset("token_is"), CURRENT_VERSION) == {}


def test_token_lags_rejects_tokens_newer_than_the_current_policy() -> None:
    batch = _versioned_batch()
    with pytest.raises(ValueError, match="newer than the current version 6"):
        token_lags(batch.batch[POLICY_VERSION_KEY], 6, batch.batch["response_mask"])
    with pytest.raises(ValueError, match="integer versions"):
        token_lags(batch.batch[POLICY_VERSION_KEY].float(), 7, batch.batch["response_mask"])


def test_split_by_lag_keeps_only_rows_holding_the_lag() -> None:
    batch = _versioned_batch()
    lags = token_lags(batch.batch[POLICY_VERSION_KEY], CURRENT_VERSION, batch.batch["response_mask"])
    slices = {s.lag: s for s in split_by_lag(lags, batch.batch["response_mask"])}
    assert sorted(slices) == [0, 1, 2]
    assert slices[2].rows.tolist() == [3] and slices[2].mask.tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]
    # Row 2's lag-0 positions are padding: it holds no lag-0 token.
    assert slices[0].rows.tolist() == [0, 1, 3] and slices[1].rows.tolist() == [0, 2, 3]
    assert sum(s.num_tokens for s in slices.values()) == int(batch.batch["response_mask"].sum())


def test_staleness_mask_zeroes_tokens_older_than_the_limit_and_counts_them() -> None:
    batch = _versioned_batch()
    before = batch.batch["response_mask"].clone()
    metrics = apply_staleness_mask(batch, dataclasses.replace(preset("token_is"), max_staleness=1), 7)
    assert metrics == {STALE_TOKENS_METRIC: 2.0}
    expected = before.clone()
    expected[3, :2] = 0
    assert torch.equal(batch.batch["response_mask"], expected)
    metrics = apply_staleness_mask(batch, dataclasses.replace(preset("token_is"), max_staleness=0), 7)
    assert metrics == {STALE_TOKENS_METRIC: 11.0}  # the lag-1 tokens: 3 + 6 + 2


def test_staleness_mask_is_off_by_default_and_needs_versions_when_on() -> None:
    batch = _versioned_batch()
    before = batch.batch["response_mask"].clone()
    assert apply_staleness_mask(batch, preset("token_is"), CURRENT_VERSION) == {}
    assert torch.equal(batch.batch["response_mask"], before)
    batch.batch.pop(POLICY_VERSION_KEY)
    with pytest.raises(ValueError, match="rollout_correction.max_staleness=1 needs the per-token"):
        apply_staleness_mask(batch, dataclasses.replace(preset("token_is"), max_staleness=1), 7)


# --------------------------------------------------------------------------------------------
# (e) micro-batch with no trainable token (verl #6485)
# --------------------------------------------------------------------------------------------


def _micro_batch(rows: int = 2, length: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    rollout = -torch.rand(rows, length, generator=generator)
    log_prob = (rollout + 0.05 * torch.randn(rows, length, generator=generator)).requires_grad_()
    return rollout, log_prob, torch.randn(rows, length, generator=generator)


BYPASS_RS = to_verl_config(preset("bypass_pg_geo_rs"))


def test_verl_bypass_loss_crashes_on_a_micro_batch_without_valid_tokens() -> None:
    rollout, log_prob, advantages = _micro_batch()
    with pytest.raises(ValueError, match="response_mask must contain at least one valid token"):
        core_algos.get_policy_loss_fn("bypass_mode")(
            old_log_prob=rollout,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=torch.zeros_like(rollout, dtype=torch.bool),
            config=_actor_config(BYPASS_RS),
        )


def test_guard_turns_an_empty_micro_batch_into_exact_zero_loss_with_a_count() -> None:
    rollout, log_prob, advantages = _micro_batch()
    guarded = guard_all_rejected(core_algos.get_policy_loss_fn("bypass_mode"))
    config = _actor_config(BYPASS_RS)
    kwargs = {"old_log_prob": rollout, "log_prob": log_prob, "advantages": advantages, "config": config}
    loss, metrics = guarded(response_mask=torch.zeros_like(rollout, dtype=torch.bool), **kwargs)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(log_prob.grad, torch.zeros_like(log_prob))
    assert metrics[ALL_REJECTED_METRIC] == 1.0
    # Same keys as a normal micro-batch: verl's dp aggregation needs them on every rank.
    _, normal_metrics = guarded(response_mask=torch.ones_like(rollout, dtype=torch.bool), **kwargs)
    assert metrics.keys() == normal_metrics.keys()


def test_guard_leaves_normal_micro_batches_to_verl() -> None:
    rollout, log_prob, advantages = _micro_batch()
    mask = torch.ones_like(rollout, dtype=torch.bool)
    mask[1, 3:] = False
    config = _actor_config(to_verl_config(preset("pure_is")))
    kwargs = {"old_log_prob": rollout, "log_prob": log_prob, "advantages": advantages, "response_mask": mask}
    verl_loss, verl_metrics = core_algos.get_policy_loss_fn("bypass_mode")(config=config, **kwargs)
    loss, metrics = guard_all_rejected(core_algos.get_policy_loss_fn("bypass_mode"))(config=config, **kwargs)
    assert torch.equal(loss, verl_loss)
    assert metrics == {**verl_metrics, ALL_REJECTED_METRIC: 0.0}


def test_guard_counts_a_micro_batch_the_bypass_rejection_empties() -> None:
    """Bypass RS rejecting every token does not crash verl (loss 0) but is an all-rejected micro-batch."""
    rollout, _, advantages = _micro_batch()
    far_off = (rollout + 0.5).requires_grad_()  # geometric-mean ratio e^0.5, far outside [0.999, 1.001]
    mask = torch.ones_like(rollout, dtype=torch.bool)
    loss, metrics = guard_all_rejected(core_algos.get_policy_loss_fn("bypass_mode"))(
        old_log_prob=rollout,
        log_prob=far_off,
        advantages=advantages,
        response_mask=mask,
        config=_actor_config(BYPASS_RS),
    )
    assert loss.item() == 0.0 and metrics[ALL_REJECTED_METRIC] == 1.0


def test_guard_keeps_decoupled_loss_finite_when_the_whole_mini_batch_is_rejected() -> None:
    """Decoupled RS on the driver can empty a whole mini-batch: verl's token-mean is then 0/0."""
    rollout, log_prob, advantages = _micro_batch()
    config = _actor_config(to_verl_config(preset("seq_is_rs")))
    config.global_batch_info["batch_num_tokens"] = 0  # what the engine counts for an all-rejected mini-batch
    kwargs = {"old_log_prob": rollout, "log_prob": log_prob, "advantages": advantages, "config": config}
    empty = torch.zeros_like(rollout, dtype=torch.bool)
    verl_loss, _ = core_algos.get_policy_loss_fn("vanilla")(response_mask=empty, **kwargs)
    assert torch.isnan(verl_loss)
    loss, metrics = guard_all_rejected(core_algos.get_policy_loss_fn("vanilla"))(response_mask=empty, **kwargs)
    assert loss.item() == 0.0 and metrics[ALL_REJECTED_METRIC] == 1.0


def test_install_guards_the_registry_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", dict(core_algos.POLICY_LOSS_REGISTRY))
    original = core_algos.get_policy_loss_fn("bypass_mode")
    install_all_rejected_guard()
    guarded = core_algos.get_policy_loss_fn("bypass_mode")
    assert guarded is not original and guarded.__wrapped__ is original
    install_all_rejected_guard(["bypass_mode"])
    assert core_algos.get_policy_loss_fn("bypass_mode") is guarded
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        install_all_rejected_guard(["no_such_loss"])
