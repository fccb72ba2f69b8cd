"""Rollout-correction config: presets vs verl's classmethods, YAML group, validation, trainer hand-over.

The hand-over tests reproduce, without Ray, what happens to the config in verl 0.9.1: the workers
get ``actor_rollout_ref`` by value in ``init_workers`` (modelled by a deep copy) and ``fit`` then
runs verl's real ``apply_bypass_mode`` on the driver's copy.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlConfig
from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS, apply_bypass_mode
from verl.utils.config import omega_conf_to_dataclass

from verl_partial.config.correction import (
    BYPASS_LOSS_MODE,
    DEFAULT_PRESET,
    PRESET_NAMES,
    RENAMED_KEYS,
    RS_MODES,
    SEED_PRESET_NAMES,
    VERL_PRESET_NAMES,
    RolloutCorrectionConfig,
    check_against_trainer,
    from_mapping,
    preset,
    to_verl_fields,
    veto_k2_threshold,
)
from verl_partial.config.job import correction_config
from verl_partial.glue.correction import to_verl_config

REPO = Path(__file__).resolve().parents[2]
YAML_DIR = REPO / "hydra_configs" / "rollout_correction"
VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
FIELDS = [field.name for field in dataclasses.fields(RolloutCorrectionConfig)]


def _verl_fields(config: VerlConfig) -> dict[str, object]:
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.name != "_target_"}


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


def test_preset_names_are_the_seed_names_plus_every_verl_classmethod() -> None:
    verl_classmethods = {name for name, value in vars(VerlConfig).items() if isinstance(value, classmethod)}
    assert set(VERL_PRESET_NAMES) == verl_classmethods
    assert set(PRESET_NAMES) == set(SEED_PRESET_NAMES) | verl_classmethods
    assert len(PRESET_NAMES) == len(set(PRESET_NAMES)) == 25


@pytest.mark.parametrize("name", VERL_PRESET_NAMES)
def test_verl_named_preset_gives_verl_classmethod_fields(name: str) -> None:
    ours = preset(name)
    assert ours.preset == name
    assert to_verl_fields(ours) == _verl_fields(getattr(VerlConfig, name)())
    assert to_verl_config(ours) == getattr(VerlConfig, name)()


@pytest.mark.parametrize(
    ("seed", "verl_name"),
    [
        ("token_is", "decoupled_token_is"),
        ("seq_is", "decoupled_seq_is"),
        ("seq_is_rs", "decoupled_seq_is_rs"),
        ("ppo_is_bypass", "bypass_ppo_clip"),
        ("pure_is", "bypass_pg_is"),
        ("disabled", "disabled"),
    ],
)
def test_seed_preset_gives_its_verl_counterpart(seed: str, verl_name: str) -> None:
    assert to_verl_fields(preset(seed)) == _verl_fields(getattr(VerlConfig, verl_name)())


def test_geo_rs_is_symmetric_geometric_band_plus_sequence_max_k2_veto() -> None:
    assert to_verl_fields(preset("geo_rs")) == {
        "rollout_is": None,
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": False,
        "rollout_rs": "seq_mean_k1,seq_max_k2",
        "rollout_rs_threshold": f"1.001,{veto_k2_threshold(1e-4)}",
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    }
    assert veto_k2_threshold(1e-4) == pytest.approx(0.5 * 9.2103**2, rel=1e-4)


def test_rs_modes_are_verls() -> None:
    assert set(RS_MODES) == SUPPORTED_ROLLOUT_RS_OPTIONS


def test_defaults_are_the_disabled_preset() -> None:
    assert RolloutCorrectionConfig() == preset("disabled")
    assert not preset("disabled").corrects and preset("token_is").corrects


def test_asymmetric_k1_bounds_are_reflected_for_verl() -> None:
    cfg = RolloutCorrectionConfig(rs_mode="seq_mean_k1", rs_threshold=1.5, rs_threshold_lower=0.8)
    assert to_verl_fields(cfg)["rollout_rs_threshold"] == "0.666666666666667_1.25"
    symmetric = dataclasses.replace(cfg, rs_threshold_lower=None)
    assert to_verl_fields(symmetric)["rollout_rs_threshold"] == 1.5  # verl infers the lower bound 1/1.5


# --------------------------------------------------------------------------------------------
# YAML group
# --------------------------------------------------------------------------------------------


def test_every_preset_has_a_yaml_and_every_yaml_is_a_preset() -> None:
    assert sorted(path.stem for path in YAML_DIR.glob("*.yaml")) == sorted(PRESET_NAMES)


def _compose(*overrides: str) -> DictConfig:
    """What ``main_ppo <overrides>`` composes (real Hydra, verl's ppo_trainer, our groups)."""
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(
            config_name="ppo_trainer", overrides=[f"hydra.searchpath=[file://{REPO / 'hydra_configs'}]", *overrides]
        )


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_yaml_composes_to_the_preset_field_by_field(name: str) -> None:
    config = _compose(f"+rollout_correction={name}")
    block = OmegaConf.to_container(config.rollout_correction)
    # Every field, in the dataclass's order, then the deprecated alias (null: it changes nothing).
    assert list(block) == [*FIELDS, *RENAMED_KEYS] and all(block[old] is None for old in RENAMED_KEYS)
    expected = preset(name)
    for field in FIELDS:
        assert block[field] == getattr(expected, field), field
    assert correction_config(config) == expected
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    assert policy_loss.loss_mode == (BYPASS_LOSS_MODE if expected.bypass_mode else "vanilla")
    # verl's own keys hold the preset's values, for the driver's copy and the bypass loss alike.
    verl_keys = OmegaConf.to_container(config.algorithm.rollout_correction, resolve=True)
    assert verl_keys == to_verl_fields(expected)
    assert OmegaConf.to_container(policy_loss.rollout_correction, resolve=True) == verl_keys
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True


@pytest.mark.parametrize("name", sorted(set(PRESET_NAMES) - {DEFAULT_PRESET}))
def test_yaml_restates_only_what_differs_from_disabled(name: str) -> None:
    """The ~20 shared lines (verl's keys, the hand-over to the bypass loss) live in disabled.yaml alone."""
    path = YAML_DIR / f"{name}.yaml"
    assert path.read_text().splitlines()[0] == "# @package _global_"
    raw = OmegaConf.to_container(OmegaConf.load(path))
    assert raw.pop("defaults") == [f"/rollout_correction/{DEFAULT_PRESET}", "_self_"]
    expected, disabled = preset(name), preset(DEFAULT_PRESET)
    assert raw.pop("rollout_correction") == {
        field: getattr(expected, field) for field in FIELDS if getattr(expected, field) != getattr(disabled, field)
    }
    assert raw == (
        {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": BYPASS_LOSS_MODE}}}}
        if expected.bypass_mode
        else {}
    )


def test_hydra_selects_a_preset_and_takes_overrides() -> None:
    """``main_ppo +rollout_correction=seq_is_rs rollout_correction.is_threshold=3.0``, composed like verl does."""
    config = _compose("+rollout_correction=seq_is_rs", "rollout_correction.is_threshold=3.0")
    assert correction_config(config) == dataclasses.replace(preset("seq_is_rs"), is_threshold=3.0)
    assert OmegaConf.to_container(config.algorithm.rollout_correction, resolve=True) == {
        **_verl_fields(VerlConfig.decoupled_seq_is_rs()),
        "rollout_is_threshold": 3.0,
    }


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def test_from_mapping_starts_from_the_named_preset() -> None:
    assert from_mapping({"preset": "seq_is_rs"}) == preset("seq_is_rs")
    assert from_mapping({}) == preset("disabled")
    assert from_mapping({"preset": "token_is", "is_threshold": 5}).is_threshold == 5
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rollout_correction.rollout_is'\]; allowed keys"):
        from_mapping({"preset": "token_is", "rollout_is": "token"})


def test_the_old_staleness_key_still_works_and_warns_naming_both_keys() -> None:
    with pytest.warns(
        FutureWarning,
        match=r"rollout_correction.max_token_staleness is deprecated.*"
        r"rollout_correction.max_staleness",
    ):
        assert from_mapping({"preset": "token_is", "max_token_staleness": 1}).max_staleness == 1
    with pytest.raises(ValueError, match=r"rollout_correction.max_token_staleness must be unset or equal to "):
        with pytest.warns(FutureWarning):
            from_mapping({"max_token_staleness": 1, "max_staleness": 2})
    with pytest.warns(FutureWarning, match="max_token_staleness is deprecated: use max_staleness"):
        assert preset("disabled").max_token_staleness is None  # code reading the old attribute


def test_the_old_staleness_key_overrides_the_preset_on_the_command_line() -> None:
    """``rollout_correction.max_token_staleness=1`` (no ``+``) as written before the rename."""
    config = _compose("+rollout_correction=token_is", "rollout_correction.max_token_staleness=1")
    with pytest.warns(FutureWarning, match="use rollout_correction.max_staleness"):
        assert correction_config(config) == dataclasses.replace(preset("token_is"), max_staleness=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"preset": "tis"}, r"rollout_correction.preset must be one of \['token_is', 'seq_is'"),
        ({"is_level": "tokens"}, r"rollout_correction.is_level must be null or one of \['token', 'sequence'\]"),
        ({"is_level": "token", "is_threshold": 0.5}, "rollout_correction.is_threshold must be a number >= 1"),
        ({"is_level": "token", "is_threshold": True}, "rollout_correction.is_threshold must be a number"),
        ({"is_level": "token", "is_threshold_lower": 1.5}, r"rollout_correction.is_threshold_lower must be null or"),
        ({"is_threshold_lower": 0.5}, "rollout_correction.is_threshold_lower must be null when is_level is null"),
        ({"is_batch_normalize": True}, "rollout_correction.is_batch_normalize must be false when is_level is null"),
        ({"rs_mode": "geometric", "rs_threshold": 1.001}, r"rollout_correction.rs_mode must be null or one of \["),
        ({"rs_mode": "seq_mean_k1"}, "rollout_correction.rs_threshold must be a number > 1"),
        ({"rs_mode": "seq_mean_k1", "rs_threshold": 0.9}, "rollout_correction.rs_threshold must be a number > 1"),
        ({"rs_mode": "seq_mean_k1", "rs_threshold": 1.0}, "rollout_correction.rs_threshold must be a number > 1"),
        ({"rs_mode": "seq_mean_k3"}, "rollout_correction.rs_threshold must be a number >= 1e-06"),
        (
            {"rs_mode": "seq_mean_k3", "rs_threshold": 1e-300},
            "rollout_correction.rs_threshold must be a number >= 1e-06",
        ),
        (
            {"is_level": "token", "is_threshold": 1.0, "is_threshold_lower": 1.0},
            "rollout_correction.is_threshold_lower must be below is_threshold=1.0",
        ),
        ({"rs_threshold": 2.0}, "rollout_correction.rs_threshold must be null when rs_mode is null"),
        (
            {"rs_mode": "seq_mean_k3", "rs_threshold": 0.01, "rs_threshold_lower": 0.5},
            "rollout_correction.rs_threshold_lower must be null for rs_mode=seq_mean_k3",
        ),
        (
            {"rs_mode": "token_k1", "rs_threshold": 2.0, "rs_threshold_lower": 1.2},
            r"rollout_correction.rs_threshold_lower must be null \(= 1/rs_threshold\) or a number in \(0, 1\)",
        ),
        ({"rs_token_veto": 2.0}, r"rollout_correction.rs_token_veto must be null or a number in \(0, 0.998\]"),
        ({"rs_token_veto": 0.9999}, r"rollout_correction.rs_token_veto must be null or a number in \(0, 0.998\]"),
        (
            {"rs_mode": "seq_max_k2", "rs_threshold": 40.0, "rs_token_veto": 1e-4},
            "rollout_correction.rs_mode must be not seq_max_k2 when rs_token_veto is set",
        ),
        ({"loss_type": "pg"}, r"rollout_correction.loss_type must be one of \['ppo_clip', 'reinforce'\]"),
        ({"loss_type": "reinforce"}, "rollout_correction.loss_type must be 'ppo_clip' when bypass_mode is false"),
        ({"bypass_mode": True, "is_level": "token"}, "rollout_correction.is_level must be null with bypass_mode=true"),
        ({"bypass_mode": "yes"}, r"rollout_correction.bypass_mode must be a bool \(true or false\), got 'yes'"),
        ({"max_staleness": -1}, "rollout_correction.max_staleness must be null or an integer >= 0"),
        ({"max_staleness": 1.5}, "rollout_correction.max_staleness must be null or an integer, got 1.5"),
        ({"log_by_lag": "yes"}, r"rollout_correction.log_by_lag must be a bool \(true or false\)"),
    ],
)
def test_invalid_values_name_the_key_and_the_allowed_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutCorrectionConfig(**overrides)


def test_check_against_trainer() -> None:
    check_against_trainer(preset("token_is"), calculate_log_probs=True, policy_loss_mode="gspo")
    check_against_trainer(preset("disabled"), calculate_log_probs=False, policy_loss_mode="vanilla")
    check_against_trainer(preset("pure_is"), calculate_log_probs=True, policy_loss_mode="bypass_mode")
    with pytest.raises(ValueError, match="policy_loss.loss_mode must be 'bypass_mode' with rollout_correction.bypass"):
        check_against_trainer(preset("pure_is"), calculate_log_probs=True, policy_loss_mode="vanilla")
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.calculate_log_probs must be true"):
        check_against_trainer(preset("seq_is_rs"), calculate_log_probs=False, policy_loss_mode="vanilla")
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.calculate_log_probs must be true"):
        stale_only = dataclasses.replace(preset("disabled"), max_staleness=2)
        check_against_trainer(stale_only, calculate_log_probs=False, policy_loss_mode="vanilla")
    with pytest.raises(ValueError, match="policy_loss.loss_mode must be 'bypass_mode'"):
        check_against_trainer(preset("pure_is"), calculate_log_probs=True, policy_loss_mode="gspo")
    with pytest.raises(ValueError, match="loss_mode='bypass_mode' requires rollout_correction.bypass_mode=true"):
        check_against_trainer(preset("token_is"), calculate_log_probs=True, policy_loss_mode="bypass_mode")


# --------------------------------------------------------------------------------------------
# Hand-over to the trainer config (and the verl 0.9.1 bypass bug it fixes)
# --------------------------------------------------------------------------------------------

_VERL_DEFAULTS = OmegaConf.load(VERL_CONFIG_DIR / "_generated_ppo_trainer.yaml")


def _trainer_config(block: dict[str, object] | None = None) -> DictConfig:
    """verl's default trainer config (struct mode, as Hydra hands it over) plus our block."""
    config = copy.deepcopy(_VERL_DEFAULTS)
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1  # lets the worker view instantiate
    if block is not None:
        config.rollout_correction = block
    OmegaConf.set_struct(config, True)
    return config


def _worker_policy_loss(config: DictConfig):
    """What the actor worker's ``init_model`` builds from its copy: ``omega_conf_to_dataclass(config.actor)``."""
    return omega_conf_to_dataclass(config.actor).policy_loss


def _run_fit_bypass_step(config: DictConfig) -> None:
    """The bypass branch of RayPPOTrainer.fit (ray_trainer.py:1574-1583), on the driver's config."""
    rollout = torch.zeros(2, 3)
    batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": torch.ones(2, 3)})
    apply_bypass_mode(
        batch=batch,
        rollout_corr_config=config.algorithm.rollout_correction,
        policy_loss_config=config.actor_rollout_ref.actor.policy_loss,
    )


def test_verl_bypass_reaches_only_the_driver_copy() -> None:
    """verl 0.9.1 alone: the worker keeps 'vanilla', so bypass REINFORCE/RS are silently dropped."""
    config = _trainer_config()
    with open_dict(config.algorithm):
        config.algorithm.rollout_correction = _verl_fields(VerlConfig.bypass_pg_geo_rs())
    worker_copy = copy.deepcopy(config.actor_rollout_ref)  # init_workers ships the config by value
    _run_fit_bypass_step(config)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    assert _worker_policy_loss(worker_copy).loss_mode == "vanilla"


def test_composed_bypass_preset_reaches_the_worker_copy() -> None:
    """With ``+rollout_correction=<bypass preset>`` the workers' copy already holds bypass: nothing to patch in fit."""
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=["+rollout_correction=bypass_pg_geo_rs"])
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    OmegaConf.resolve(config)  # the TaskRunner's first act
    worker_copy = copy.deepcopy(config.actor_rollout_ref)
    _run_fit_bypass_step(config)
    policy_loss = _worker_policy_loss(worker_copy)
    assert policy_loss.loss_mode == "bypass_mode"
    assert dict(policy_loss.rollout_correction) == _verl_fields(VerlConfig.bypass_pg_geo_rs())
