"""Each of our groups on each trainer verl 0.9.1 offers: it works, or the driver refuses it naming ``trainer.use_v1``.

verl's ``main()`` picks the trainer from ``trainer.use_v1`` (default true: the v1 PPOTrainer; false:
the legacy RayPPOTrainer via main_ppo_v0's TaskRunner). The tests run verl's own ``main()`` on the
config Hydra composes from the command line (``driver_entry``), up to where Ray would start; v1
cannot run here end to end (see docs/rollout-correction.md, "Trainer paths"), so its side is
decided and checked on the config both trainers receive.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from driver_entry import job_config, model_override, run_driver, task_runner_view
from omegaconf import OmegaConf
from verl.trainer.config.algorithm import RolloutCorrectionConfig as VerlRolloutCorrectionConfig
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.main_ppo_v0 import TaskRunner as TaskRunnerV0
from verl.utils.config import omega_conf_to_dataclass

from verl_partial.config.correction import PRESET_NAMES, VERL_PRESET_NAMES, preset, to_verl_fields
from verl_partial.glue import trainer_hooks

REPO = Path(__file__).resolve().parents[2]
RUNNERS = {False: TaskRunnerV0, True: TaskRunnerV1}


@pytest.fixture(scope="module")
def model(demo_assets) -> str:
    """verl's validate_config loads the model's config on some paths (e.g. the CPU backend's): a real tiny one."""
    return model_override(demo_assets)


# Groups that hook verl's legacy RayPPOTrainer -- every option of ours in these groups, so a new preset is
# covered too: they work on v0 and are refused on v1. Value: what the refusal must name. An option that writes
# `<group>: null` defines no block for the hooks to key on (backend/cpu_vllm_v1.yaml: verl's v1 trainer on vLLM's
# CPU build, tested in test_cpu_vllm_v1_backend.py), so it is not one of them.
V0_ONLY_GROUPS = {
    f"+{group}={path.stem}": f"+backend={path.stem}" if group == "backend" else f"+{group}"
    for group in ("backend", "partial", "balance")
    for path in sorted((REPO / "hydra_configs" / group).glob("*.yaml"))
    if OmegaConf.load(path).get(group, "") is not None
}


@pytest.mark.parametrize("group", V0_ONLY_GROUPS)
def test_v0_only_group_works_on_the_legacy_trainer(group: str, model: str) -> None:
    run = run_driver(model, group, "trainer.use_v1=false")
    assert run.task_runner is TaskRunnerV0
    block = group.removeprefix("+").partition("=")[0]
    assert run.config.get(block) is not None, "the group's block reaches the TaskRunner"


@pytest.mark.parametrize("group", V0_ONLY_GROUPS)
def test_v0_only_group_is_refused_on_v1_at_start_up(group: str, model: str) -> None:
    with pytest.raises(ValueError, match=r"trainer\.use_v1 must be false") as error:
        run_driver(model, group, "trainer.use_v1=true")
    assert V0_ONLY_GROUPS[group] in str(error.value)
    assert "Set trainer.use_v1=false" in str(error.value)


@pytest.mark.parametrize("group", [group for group in V0_ONLY_GROUPS if not group.startswith("+balance")])
def test_groups_that_need_v0_select_it(group: str, model: str) -> None:
    assert run_driver(model, group).task_runner is TaskRunnerV0


def test_rollout_correction_alone_keeps_verls_default_trainer(model: str) -> None:
    assert run_driver(model, "+rollout_correction=token_is").task_runner is TaskRunnerV1


def _without(config, *keys: str) -> dict:
    container = OmegaConf.to_container(config, resolve=True)
    for key in keys:
        container.pop(key, None)
    return container


# Every preset on v1 (verl's default trainer); on v0 one of each kind: the driver's v0/v1 branch sees the same config.
PRESET_PATHS = [(name, True) for name in PRESET_NAMES] + [
    (name, False) for name in ("token_is", "pure_is", "geo_rs", "decoupled_token_icepop", "bypass_ppo_clip_k3_rs")
]


@pytest.mark.parametrize(
    ("name", "use_v1"), PRESET_PATHS, ids=[f"{n}-{'v1' if v1 else 'v0'}" for n, v1 in PRESET_PATHS]
)
def test_preset_reaches_verls_keys_and_the_worker_through_the_composed_config(
    name: str, use_v1: bool, model: str
) -> None:
    """``--cfg job --resolve`` == what the TaskRunner resolves == what the actor worker builds."""
    overrides = (model, f"+rollout_correction={name}", f"trainer.use_v1={str(use_v1).lower()}")
    shown = task_runner_view(job_config(*overrides))
    run = run_driver(*overrides)
    assert run.task_runner is RUNNERS[use_v1]
    received = task_runner_view(run.config)
    # The driver adds one env var to Ray's runtime env (the all-rejected guard) and edits nothing else.
    assert _without(received, "ray_kwargs") == _without(shown, "ray_kwargs")

    fields = to_verl_fields(preset(name))
    assert OmegaConf.to_container(received.algorithm.rollout_correction) == fields  # what both trainers read
    policy_loss = omega_conf_to_dataclass(received.actor_rollout_ref.actor).policy_loss  # the worker's init_model
    assert policy_loss.loss_mode == ("bypass_mode" if preset(name).bypass_mode else "vanilla")
    assert dict(policy_loss.rollout_correction) == fields  # the bypass loss reads it with .get()
    if name in VERL_PRESET_NAMES:  # verl's own classmethod of that name gives the same keys
        assert VerlRolloutCorrectionConfig(**fields) == getattr(VerlRolloutCorrectionConfig, name)()

    before = OmegaConf.to_container(received)
    trainer_hooks.before_trainer_init(received)  # the TaskRunner's hook (v0) checks, never rewrites
    assert OmegaConf.to_container(received) == before


def test_overrides_of_our_keys_reach_verls_keys(model: str) -> None:
    overrides = (
        model,
        "+rollout_correction=decoupled_token_icepop",
        "rollout_correction.is_threshold=4.0",
        "rollout_correction.is_threshold_lower=0.25",
        "rollout_correction.rs_mode=seq_mean_k3",
        "rollout_correction.rs_threshold=0.05",
    )
    received = task_runner_view(run_driver(*overrides).config)
    ours = dataclasses.replace(
        preset("decoupled_token_icepop"),
        is_threshold=4.0,
        is_threshold_lower=0.25,
        rs_mode="seq_mean_k3",
        rs_threshold=0.05,
    )
    assert OmegaConf.to_container(received.algorithm.rollout_correction) == to_verl_fields(ours)
    assert received.algorithm.rollout_correction.rollout_is_threshold == "0.25_4.0"


def test_cfg_job_shows_where_verls_keys_come_from() -> None:
    """Unresolved, ``--cfg job`` names our block as the source; resolved, it shows the values (test above)."""
    block = job_config("+rollout_correction=seq_is_rs").algorithm.rollout_correction
    assert OmegaConf.to_container(block, resolve=False)["rollout_is"] == "${rollout_correction.is_level}"
    assert OmegaConf.to_container(block, resolve=False)["rollout_rs_threshold"] == (
        "${verl_partial.rollout_correction:rollout_rs_threshold}"
    )


def test_max_staleness_works_with_partial(model: str) -> None:
    run = run_driver(model, "+partial=default", "+rollout_correction=token_is", "rollout_correction.max_staleness=1")
    assert run.config.rollout_correction.max_staleness == 1
