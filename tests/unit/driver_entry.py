"""``python -m verl.trainer.main_ppo <overrides>`` in-process, up to the point where Ray would start.

``compose_main_ppo`` composes verl's ``ppo_trainer`` through real Hydra, our groups found by our
search-path plugin exactly as on the command line (no search path handed in). ``run_driver`` then
calls verl's own ``main`` (the function under ``@hydra.main``) on it: our driver hook, verl's
``validate_config``, the v0/v1 branch. verl's ``run_ppo`` (``ray.init`` and the TaskRunner) is
replaced by a recorder, so what it receives is exactly what Ray would ship to the TaskRunner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import verl
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.plugin.platform import get_platform, set_platform
from verl.trainer import main_ppo

from verl_partial.patches.cpu import CPU_PLATFORM_ENV as PLATFORM_ENV

VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
# verl's defaults leave every micro-batch size unset, which its own validate_config refuses.
MICRO_BATCHES = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.model.path=${actor_rollout_ref.model.path}",
)


def model_override(assets: Any) -> str:
    """Point actor, ref and critic at the demo's tiny model (verl loads its config when validating some paths)."""
    return f"actor_rollout_ref.model.path={assets.model_dir}"


def compose_main_ppo(*overrides: str) -> DictConfig:
    """The composed config with its ``hydra`` node (what ``--cfg all`` prints)."""
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*MICRO_BATCHES, *overrides], return_hydra_config=True)


def job_config(*overrides: str) -> DictConfig:
    """What ``--cfg job`` prints: the composed config without the ``hydra`` node."""
    config = compose_main_ppo(*overrides)
    with open_dict(config):
        del config["hydra"]
    return config


@dataclass
class DriverRun:
    config: DictConfig  # what run_ppo received (Ray would pickle it to the TaskRunner)
    task_runner: Any  # verl's TaskRunner (v0) or TaskRunnerV1 class


def run_driver(*overrides: str) -> DriverRun:
    """verl's ``main()`` up to ``run_ppo``; raises whatever the driver raises before Ray starts."""
    config = compose_main_ppo(*overrides)
    received: dict[str, Any] = {}
    original = main_ppo.run_ppo
    main_ppo.run_ppo = lambda config, task_runner_class: received.update(config=config, runner=task_runner_class)
    HydraConfig.instance().set_config(config)
    platform, platform_env = get_platform(), os.environ.get(PLATFORM_ENV)  # +backend=cpu switches both
    try:
        with open_dict(config):
            del config["hydra"]
        main_ppo.main.__wrapped__(config)
    finally:
        main_ppo.run_ppo = original
        HydraConfig.instance().cfg = None
        set_platform(platform)
        if platform_env is None:
            os.environ.pop(PLATFORM_ENV, None)
        else:
            os.environ[PLATFORM_ENV] = platform_env
    return DriverRun(config=received["config"], task_runner=received["runner"])


def task_runner_view(config: DictConfig) -> DictConfig:
    """The TaskRunner's first act (both trainers): ``OmegaConf.resolve(config)``; workers get parts of this."""
    resolved = config.copy()
    OmegaConf.resolve(resolved)
    return resolved
