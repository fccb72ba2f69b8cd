"""``+backend=cpu_vllm_v1``: verl's v1 PPOTrainer on vLLM's CPU build with one override (the peer benchmark's path).

Run through verl's own ``main()`` up to ``run_ppo`` (``driver_entry.run_driver``): what the TaskRunner would receive.
"""

from __future__ import annotations

import pytest
from driver_entry import model_override, run_driver, task_runner_view

from verl_partial.glue.engines.vllm import VLLM_CPU_ENV
from verl_partial.patches.cpu import CPU_PLATFORM_ENV


@pytest.fixture(scope="module")
def model(demo_assets) -> str:
    return model_override(demo_assets)


def test_v1_runs_on_the_cpu_platform_with_vllm(model: str) -> None:
    """Without the driver following the Ray processes' VERL_PLATFORM, verl's auto_set_device would set
    trainer.device=cuda on this machine and every worker would ask for NCCL."""
    run = run_driver("+backend=cpu_vllm_v1", model)
    config = task_runner_view(run.config)
    assert "TaskRunnerV1" in repr(run.task_runner)
    assert config.trainer.use_v1 is True
    assert config.trainer.device == "cpu"
    assert config.get("backend") is None  # the legacy-trainer block our checks refuse on v1
    assert config.actor_rollout_ref.rollout.name == "vllm"
    assert config.actor_rollout_ref.rollout.enable_sleep_mode is False
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars[CPU_PLATFORM_ENV] == "cpu"
    assert env_vars[VLLM_CPU_ENV] == "1"


@pytest.mark.parametrize("group", ["+partial=default", "+balance=group"])
def test_v1_backend_still_refuses_legacy_trainer_groups(model: str, group: str) -> None:
    """Our groups that hook RayPPOTrainer would silently not run on v1: the v1 backend does not lift that check."""
    with pytest.raises(ValueError, match="trainer.use_v1 must be false"):
        run_driver("+backend=cpu_vllm_v1", group, "trainer.use_v1=true", model)
