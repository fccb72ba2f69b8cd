"""Registration with verl, the version guard, and fail-fast validation of our config blocks.

Configs are verl's own generated ``ppo_trainer`` config merged with our Hydra group files, i.e. what
``python -m verl.trainer.main_ppo +group=option`` composes.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import verl
from omegaconf import OmegaConf

from verl_partial import verl_patches
from verl_partial.config import validate_root_config

REPO = Path(__file__).resolve().parents[2]
VERL_CONFIG = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"


def compose(*groups: str, **dotted: object):
    config = OmegaConf.load(VERL_CONFIG)
    for group in groups:
        config = OmegaConf.merge(config, OmegaConf.load(REPO / "hydra_configs" / f"{group}.yaml"))
    for key, value in dotted.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    return config


@pytest.mark.parametrize("version", ["0.8.5", "0.10.0", "1.0.0"])
def test_unsupported_verl_is_refused_loudly(version):
    with pytest.raises(verl_patches.UnsupportedVerlError, match=r"verl >=0\.9\.0,<0\.10\.0"):
        verl_patches.check_verl_version(version)


def test_supported_verl_passes():
    verl_patches.check_verl_version("0.9.1")
    verl_patches.check_verl_version(verl.__version__)


def test_plugin_registered_the_cpu_backend_in_this_process():
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import verl_partial.plugin as plugin

    assert plugin.LOAD_ERROR is None
    assert PlatformRegistry.get("cpu") is not None
    assert RolloutReplicaRegistry.get("cpu").__name__ == "CpuReplica"


def test_a_failed_install_warns_and_then_refuses_configs_that_need_it(monkeypatch):
    import verl.utils.device as device

    import verl_partial.plugin as plugin

    monkeypatch.setattr(device, "auto_set_device", device.auto_set_device)  # restored after the test
    monkeypatch.setattr(verl_patches, "install", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.reload(plugin)
        assert any("failed to register" in str(w.message) for w in caught)
        assert isinstance(plugin.LOAD_ERROR, RuntimeError)
        with pytest.raises(RuntimeError, match=r"asks for verl-partial \(partial\).*boom"):
            device.auto_set_device(compose("partial/default"))
        device.auto_set_device(compose())  # configs without our blocks are untouched
    finally:
        monkeypatch.undo()
        importlib.reload(plugin)
    assert plugin.LOAD_ERROR is None


def test_our_presets_validate_cleanly():
    validate_root_config(compose("backend/cpu", "partial/default", "balance/group", "rollout_correction/seq_is_rs"))
    validate_root_config(compose("partial/kimi"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"trainer__use_v1": True}, "trainer.use_v1 must be false"),
        ({"algorithm__adv_estimator": "remax"}, "algorithm.adv_estimator=remax"),
        ({"actor_rollout_ref__rollout__calculate_log_probs": False}, "calculate_log_probs must be true"),
        ({"actor_rollout_ref__rollout__agent__agent_loop_manager_class": None}, "agent_loop_manager_class"),
        (
            {"actor_rollout_ref__rollout__agent__default_agent_loop": "react_agent"},
            r"default_agent_loop must be one of",
        ),
        ({"partial__extra_groups": -2}, "partial.extra_groups"),
        ({"partial__staleness_policy": "ignore"}, r"partial.staleness_policy must be one of \['restart'"),
        ({"partial__no_such_knob": 1}, r"partial.no_such_knob"),
        (
            {"partial__staleness_policy": "wait", "partial__refill": False, "partial__extra_groups": 100_000},
            r"partial\.extra_groups must be <= partial\.max_staleness x data\.train_batch_size",
        ),
        (
            {"partial__staleness_policy": "wait", "partial__refill": True, "partial__extra_groups": 4},
            r"partial\.extra_groups must be 0 with partial\.refill=true",
        ),
    ],
)
def test_partial_misconfiguration_fails_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_root_config(compose("partial/default", **overrides))


def test_disabled_partial_is_not_validated_against_the_trainer():
    validate_root_config(compose("partial/default", partial__enable=False, trainer__use_v1=True))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"actor_rollout_ref__actor__shuffle": True}, "actor_rollout_ref.actor.shuffle=false"),
        ({"trainer__balance_batch": False}, "trainer.balance_batch=true"),
        ({"balance__cost": "seconds"}, "balance.cost"),
    ],
)
def test_balance_misconfiguration_fails_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_root_config(compose("balance/group", **overrides))


def test_correction_without_rollout_log_probs_fails_naming_the_key():
    with pytest.raises(ValueError, match="calculate_log_probs"):
        validate_root_config(
            compose("rollout_correction/seq_is_rs", actor_rollout_ref__rollout__calculate_log_probs=False)
        )


def test_backend_name_is_validated():
    with pytest.raises(ValueError, match=r"backend.name must be one of \[.cpu., .cpu_vllm.\]"):
        validate_root_config(compose("backend/cpu", backend__name="tpu"))


def test_trainer_hooks_are_inert_without_our_blocks():
    from verl_partial import trainer_hooks

    config = compose()
    trainer = SimpleNamespace(config=config, train_dataloader=object())
    loader = trainer.train_dataloader
    trainer_hooks.before_trainer_init(config)
    trainer_hooks.after_trainer_init(trainer)
    assert trainer.train_dataloader is loader
    assert config == compose(), "the hooks must not edit a config without our blocks"


def test_disabled_partial_leaves_the_dataloader_alone():
    from verl_partial import trainer_hooks

    trainer = SimpleNamespace(config=compose("partial/default", partial__enable=False), train_dataloader=object())
    loader = trainer.train_dataloader
    trainer_hooks.after_trainer_init(trainer)
    assert trainer.train_dataloader is loader


def test_two_import_hooks_on_one_module_both_run_without_recursion(tmp_path, monkeypatch):
    """Patches installed twice in a process (as tests do) put two hooks on one module; both must fire once."""
    import sys

    (tmp_path / "vp_hooked_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    fired: list[str] = []
    verl_patches.after_import("vp_hooked_module", lambda module: fired.append(f"first:{module.VALUE}"))
    verl_patches.after_import("vp_hooked_module", lambda module: fired.append(f"second:{module.VALUE}"))
    try:
        importlib.import_module("vp_hooked_module")
    finally:
        sys.modules.pop("vp_hooked_module", None)
    assert sorted(fired) == ["first:1", "second:1"]
