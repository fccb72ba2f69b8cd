"""Registration with verl, the version guard, our presets against their typed definitions, and fail-fast
validation of our config blocks.

Configs are composed by real Hydra from verl's ``ppo_trainer`` and our groups, i.e. what
``python -m verl.trainer.main_ppo +group=option`` composes (our presets inherit through Hydra ``defaults:``).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import verl
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from verl_partial.config import balance as balance_module
from verl_partial.config import partial as partial_module
from verl_partial.config.job import balance_config, partial_config, validate_root_config
from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PartialConfig
from verl_partial.patches import apply, guard, imports

REPO = Path(__file__).resolve().parents[2]
GROUPS = REPO / "hydra_configs"
VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


def compose(*groups: str, **dotted: object):
    """verl's ``ppo_trainer`` with ``+group=option`` for each ``group/option``, then ``a__b=value`` set as ``a.b``."""
    overrides = [f"hydra.searchpath=[file://{GROUPS}]", *(f"+{group.replace('/', '=')}" for group in groups)]
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        config = hydra_compose(config_name="ppo_trainer", overrides=overrides)
    for key, value in dotted.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    return config


@pytest.mark.parametrize("version", ["0.8.5", "0.10.0", "1.0.0"])
def test_unsupported_verl_is_refused_loudly(version):
    with pytest.raises(guard.UnsupportedVerlError, match=r"verl >=0\.9\.0,<0\.10\.0"):
        guard.check_verl_version(version)


def test_supported_verl_passes():
    guard.check_verl_version("0.9.1")
    guard.check_verl_version(verl.__version__)


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
    monkeypatch.setattr(apply, "install", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
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


def test_the_typed_default_is_the_default_preset():
    """Code building ``PartialConfig()`` (the simulator, tests, benchmarks) gets what ``+partial=default`` runs."""
    assert PartialConfig() == partial_module.PRESETS["default"] == partial_config(compose("partial/default"))


@pytest.mark.parametrize(
    ("group", "presets", "parse"),
    [("partial", partial_module.PRESETS, partial_config), ("balance", balance_module.PRESETS, balance_config)],
)
def test_every_preset_yaml_composes_to_its_typed_definition(group, presets, parse):
    """Each ``+group=name`` gives exactly ``PRESETS[name]``, field by field, and nothing else is a preset."""
    assert sorted(path.stem for path in (GROUPS / group).glob("*.yaml")) == sorted(presets)
    for name, expected in presets.items():
        block = OmegaConf.to_container(compose(f"{group}/{name}")[group])
        assert list(block) == [field.name for field in dataclasses.fields(expected)], name
        for key, value in block.items():
            assert value == getattr(expected, key), f"{group}/{name}.yaml: {group}.{key}"
        assert parse(compose(f"{group}/{name}")) == expected


@pytest.mark.parametrize("name", sorted(set(partial_module.PRESETS) - {"default"}))
def test_partial_presets_restate_only_what_differs_from_default(name):
    """The shared keys (and the trainer wiring) come from ``default.yaml`` through Hydra ``defaults:``."""
    raw = OmegaConf.to_container(OmegaConf.load(GROUPS / "partial" / f"{name}.yaml"))
    assert raw.pop("defaults") == ["/partial/default", "_self_"]
    assert list(raw) == ["partial"], "the trainer wiring belongs to default.yaml"
    default = partial_module.PRESETS["default"]
    assert all(value != getattr(default, key) for key, value in raw["partial"].items()), raw["partial"]


def test_our_presets_validate_cleanly():
    validate_root_config(compose("backend/cpu", "partial/default", "balance/group", "rollout_correction/seq_is_rs"))
    for name in partial_module.PRESETS:
        validate_root_config(compose(f"partial/{name}"))


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
        ({"partial__schedule": "shortest_first"}, r"partial.schedule must be one of \['fifo', 'longest_first'\]"),
        ({"partial__refill": "yes"}, r"partial.refill must be a bool \(true or false\), got 'yes'"),
        (
            {"partial__refill": False, "partial__extra_groups": 100_000},
            r"partial\.extra_groups must be <= partial\.max_staleness x data\.train_batch_size",
        ),
        (
            {"partial__extra_groups": 4},
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
    with pytest.raises(ValueError, match=r"backend.name must be one of \[.cpu., .cpu_vllm."):
        validate_root_config(compose("backend/cpu", backend__name="tpu"))


def test_trainer_hooks_are_inert_without_our_blocks():
    from verl_partial.glue import trainer_hooks

    config = compose()
    trainer = SimpleNamespace(config=config, train_dataloader=object())
    loader = trainer.train_dataloader
    trainer_hooks.before_trainer_init(config)
    trainer_hooks.after_trainer_init(trainer)
    assert trainer.train_dataloader is loader
    assert config == compose(), "the hooks must not edit a config without our blocks"


def test_disabled_partial_leaves_the_dataloader_alone():
    from verl_partial.glue import trainer_hooks

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
    imports.after_import("vp_hooked_module", lambda module: fired.append(f"first:{module.VALUE}"))
    imports.after_import("vp_hooked_module", lambda module: fired.append(f"second:{module.VALUE}"))
    try:
        importlib.import_module("vp_hooked_module")
    finally:
        sys.modules.pop("vp_hooked_module", None)
    assert sorted(fired) == ["first:1", "second:1"]


def test_reading_our_config_loads_no_glue_verl_or_torch():
    """The driver validates (and finds the partial-rollout state file) before anything heavy is imported."""
    import subprocess
    import sys

    script = (
        "import sys, verl_partial.config.job; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'torch', 'ray') "
        "or m.startswith('verl_partial.glue')); print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_simulator_modes_are_the_presets_under_their_names():
    """``verl-partial simulate`` projects exactly what ``+partial=<name>`` runs (stall detection aside)."""
    from verl_partial.sim.run import RENAMED_MODES, mode_configs

    modes = mode_configs(batch=16)
    for name, preset in partial_module.PRESETS.items():
        assert modes[name] == dataclasses.replace(preset, request_timeout_s=modes[name].request_timeout_s)
    # sync is restart without extra groups: a step waits for its slowest sample, nothing is parked or carried, and
    # every request goes out at once, whatever the servers' KV cache and compute knee.
    assert modes["sync"] == dataclasses.replace(
        modes["restart"], extra_groups=0, kv_tokens_per_server="off", max_calls_per_server=CALLS_PER_SERVER_CEILING
    )
    assert set(RENAMED_MODES.values()) <= set(modes) and not set(RENAMED_MODES) & set(modes)


def test_old_simulator_mode_names_still_work_and_warn():
    from verl_partial.sim.cli import _current_mode_name

    with pytest.warns(FutureWarning, match=r"--modes stream is deprecated: it is the \+partial=default preset"):
        assert _current_mode_name("stream") == "default"
    with pytest.warns(FutureWarning, match="use --modes restart"):
        assert _current_mode_name("partial") == "restart"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _current_mode_name("on_policy") == "on_policy"
