"""Every CPU back-end gives verl's trainer workers the machine's cores (issue 25, "A fair harness").

Ray sets ``OMP_NUM_THREADS=1`` in a worker created without ``num_cpus`` unless the variable is already set, and verl
creates its FSDP workers that way (``RayClassWithInitArgs`` on a placement-group bundle). Without our driver
exporting the variable, verl's trainer trained on one core whatever the machine had; with a Ray set-up hook that
imported torch first (the old benchmark's partial modes), on all of them. Here: verl's ``main()`` up to ``run_ppo``
(``driver_entry.run_driver``), then ``ray.init`` as verl's ``run_ppo`` calls it, then a worker group built by verl's
own ``RayResourcePool`` / ``RayWorkerGroup``, asked for ``torch.get_num_threads()``.
"""

from __future__ import annotations

import sys

import pytest
import ray
from driver_entry import model_override, run_driver
from omegaconf import OmegaConf
from verl.plugin.platform import get_platform, set_platform
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

from verl_partial.cpu_backend.platform import PlatformCPU
from verl_partial.patches.driver import cpu_threads


class ThreadProbe(Worker):
    """A verl worker like the FSDP one: created by verl's worker group, without ``num_cpus``."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def threads(self) -> tuple[int, str | None]:
        import os

        import torch

        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


@pytest.fixture(scope="module")
def model(demo_assets) -> str:
    return model_override(demo_assets)


@pytest.mark.parametrize("backend", ["cpu", "cpu_vllm", "cpu_sglang", "cpu_vllm_v1", "cpu_v1"])
def test_trainer_workers_get_the_machines_cores(model: str, backend: str) -> None:
    if cpu_threads() < 2:
        pytest.skip("one core: Ray's cap of 1 thread and the machine's cores cannot be told apart")
    config = run_driver(f"+backend={backend}", model).config
    # verl's run_ppo: its default runtime env merged with ray_kwargs.ray_init.runtime_env, then ray.init.
    ray_init = config.ray_kwargs.ray_init
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.runtime_env)
    kwargs = OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}), resolve=True)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    platform = get_platform()
    set_platform(PlatformCPU())
    ray.init(**kwargs)
    try:
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=True, max_colocate_count=3)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(ThreadProbe)), device_name="cpu")
        [(threads, omp)] = group.threads()
    finally:
        ray.shutdown()
        set_platform(platform)
    assert (threads, omp) == (cpu_threads(), str(cpu_threads()))


THREADS = "+ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS"


def test_a_thread_count_read_as_a_number_is_refused_naming_the_key(model: str) -> None:
    """Hydra reads ``OMP_NUM_THREADS=1`` as an int; Ray would refuse it inside ``ray.init`` naming no config key."""
    with pytest.raises(ValueError, match=r"env_vars\.OMP_NUM_THREADS=1: Ray takes environment variables as strings"):
        run_driver("+backend=cpu", model, f"{THREADS}=1")
    config = run_driver("+backend=cpu", model, f"{THREADS}='1'").config
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS == "1"  # the user's value, not ours
