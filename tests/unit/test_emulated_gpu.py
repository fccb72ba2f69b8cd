"""``backend.emulate_gpu``: a GPU-shaped CPU engine, its typed setting, and the engine counters slot occupancy reads.

The engine runs a real forward of a tiny model, then idles until the step has lasted what the simulator's roofline
(``ServerSpec.step_seconds``, the same function the simulator uses) gives for the step's batch. The models here are
the simulator's with a stated derating, chosen so that the condition tested holds on purpose: a step modelled at
~0.9 s against a tiny model's few-ms forward (no overrun), or a model of a thousand weights (every step overruns).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time

import pytest
import torch
from driver_entry import model_override, run_driver, task_runner_view
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.workers.config import HFModelConfig, RolloutConfig

from verl_partial.config.backend import (
    EMULATE_GPU_CHOICES,
    EMULATE_GPU_ENV,
    ENGINE_STATS_DIR_ENV,
    BackendConfig,
    EmulatedGpu,
)
from verl_partial.config.job import backend_config
from verl_partial.cpu_backend.engine import CpuBatchedEngine, SamplingParams
from verl_partial.cpu_backend.occupancy import full_step_seconds, phase_slots
from verl_partial.cpu_backend.rollout import CpuRolloutServer, FixedCpuSglangServer
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import GPUS, H100_SXM, MODELS, QWEN25_7B, Efficiency, ModelSpec

torch.set_num_threads(1)

VOCAB = 256
# 7B on one H100 at 0.5 % of its peak: a step of ~0.9 s, far above the tiny model's forward (ms, even on a busy
# machine), so no step overruns by design.
SLOW_GPU = ServerSpec(H100_SXM, QWEN25_7B, efficiency=Efficiency(bandwidth=0.005, compute=0.005))
# A model of a thousand weights: every modelled step is far shorter than any real forward.
TINY = ServerSpec(H100_SXM, ModelSpec("tiny", 1e3, 1, 8, 1, 1, 8))


@pytest.fixture(scope="module")
def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config).eval()


def _generate(model, spec: ServerSpec, prompts: list[list[int]], max_tokens: int, prefix_caching: bool = False):
    """Run the prompts together; return the engine's stats, the wall time and each step's modelled time."""
    shapes: list[tuple[int, float, int, float]] = []

    def step_time(*shape):
        shapes.append(shape)
        return spec.step_seconds(*shape)

    engine = CpuBatchedEngine(
        model, eos_token_ids={VOCAB + 1}, max_num_seqs=8, step_time=step_time, seed=0, prefix_caching=prefix_caching
    )

    async def run():
        loop = asyncio.get_running_loop()
        began = loop.time()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        wall = loop.time() - began
        await engine.close()
        return wall

    wall = asyncio.run(run())
    # The engine also asks for each prefilling step's time without its prefill (``modelled_prefill_s``): the call right
    # after that step's, with its decodes and context and nothing prefilled. It is not a step.
    shapes = [
        shape
        for i, shape in enumerate(shapes)
        if not (i and shape[2:] == (0, 0.0) and shapes[i - 1][2] and shapes[i - 1][:2] == shape[:2])
    ]
    return engine.stats, wall, [spec.step_seconds(*shape) for shape in shapes], shapes


def test_a_step_lasts_the_modelled_time(tiny_model):
    stats, wall, modelled, shapes = _generate(tiny_model, SLOW_GPU, [[1, 2, 3], [4, 5, 6, 7]], max_tokens=3)
    assert stats.steps == len(modelled) == 3  # one prefill step with both prompts, then 2 decode steps
    # The step shapes the model saw: the prefill (2 prompts, 7 tokens, 3x3/2 + 4x4/2 pairs), then 2 decodes a step.
    assert shapes[0] == (0, 0.0, 7, 12.5)
    assert shapes[1] == (2, 3 + 4 + 2, 0, 0.0)
    assert stats.overruns == 0 and stats.overrun_s == 0
    assert stats.modelled_s == pytest.approx(sum(modelled))
    # The prefill's part: what the first step costs beyond the same step without its 7 prompt tokens; the decodes add
    # none.
    prefill = SLOW_GPU.step_seconds(*shapes[0]) - SLOW_GPU.step_seconds(0, 0.0, 0, 0.0)
    assert stats.modelled_prefill_s == pytest.approx(prefill) and 0 < prefill < stats.modelled_s
    assert stats.compute_s < stats.modelled_s
    # Each step sleeps the rest of its modelled time: the run lasts at least the modelled total, and no step much
    # longer (a ratio, not a machine's seconds: the modelled steps are ~0.9 s each).
    assert stats.step_s >= sum(modelled)
    assert wall >= sum(modelled)
    assert stats.step_s <= 1.5 * sum(modelled)


def test_a_step_longer_than_modelled_is_counted_as_an_overrun(tiny_model):
    stats, _, modelled, _ = _generate(tiny_model, TINY, [[1, 2, 3]], max_tokens=4)
    assert stats.steps == stats.overruns == len(modelled) == 4
    assert stats.compute_s > stats.modelled_s
    assert stats.overrun_s == pytest.approx(stats.compute_s - stats.modelled_s)  # every step: all its excess
    assert stats.step_s >= stats.compute_s  # an overrun step lasts its compute, it is not shortened


def test_with_a_prefix_cache_a_groups_siblings_are_charged_their_prompt_once(tiny_model):
    """4 samples of one 40-token prompt join in one step: the first prefills it all, each sibling only the 8 tokens
    past its 2 whole cached blocks (vLLM's rules, ``core/engines/prefix_cache.py``); without the cache all 160."""
    prompt = list(range(1, 41))
    stats, _, _, shapes = _generate(tiny_model, TINY, [prompt] * 4, max_tokens=2, prefix_caching=True)
    assert shapes[0] == (0, 0.0, 40 + 3 * 8, 40 * 40 / 2 + 3 * 8 * (32 + 8 / 2))
    assert (stats.prefill_tokens, stats.cached_tokens) == (64, 96)
    stats, _, _, shapes = _generate(tiny_model, TINY, [prompt] * 4, max_tokens=2)
    assert shapes[0] == (0, 0.0, 160, 4 * 40 * 40 / 2)
    assert (stats.prefill_tokens, stats.cached_tokens) == (160, 0)


def test_nothing_is_cached_across_a_weight_load_or_a_reset(tiny_model):
    """verl resets vLLM's prefix cache after every weight update and at every step-end abort: a resumed sample
    prefills its prompt again on the new weights."""
    engine = CpuBatchedEngine(
        tiny_model, eos_token_ids={VOCAB + 1}, step_time=TINY.step_seconds, prefix_caching=True, seed=0
    )
    prompt, params = list(range(1, 41)), SamplingParams(max_tokens=1, ignore_eos=True)

    async def cached_after(between) -> int:
        await engine.generate("first", prompt, params)
        between()
        before = engine.stats.cached_tokens
        await engine.generate("second", prompt, params)
        return engine.stats.cached_tokens - before

    async def run():
        kept = await cached_after(lambda: None)
        loaded = await cached_after(lambda: engine.load_weights(tiny_model.state_dict().items()))
        reset = await cached_after(engine.reset_prefix_cache)
        await engine.close()
        return kept, loaded, reset

    assert asyncio.run(run()) == (32, 0, 0)


def test_virtual_step_and_step_time_are_exclusive(tiny_model):
    with pytest.raises(ValueError, match="virtual_step_s and step_time"):
        CpuBatchedEngine(tiny_model, eos_token_ids={0}, virtual_step_s=0.01, step_time=SLOW_GPU.step_seconds)


def test_slot_counters_of_a_phase(tiny_model):
    """The counters slot occupancy reads, and the full-batch step time it divides by (the modelled one)."""
    engine = CpuBatchedEngine(tiny_model, eos_token_ids={VOCAB + 1}, max_num_seqs=8, step_time=SLOW_GPU.step_seconds)

    async def run():
        await asyncio.gather(
            *(engine.generate(f"r{i}", [1, 2, 3], SamplingParams(3, ignore_eos=True)) for i in range(2))
        )
        await engine.close()

    before = {**dataclasses.asdict(engine.stats), "max_num_seqs": 8, "emulate_gpu": "H100-SXM/Qwen2.5-7B"}
    asyncio.run(run())
    after = {**dataclasses.asdict(engine.stats), "max_num_seqs": 8, "emulate_gpu": "H100-SXM/Qwen2.5-7B"}
    assert after["decode_tokens"] == 4 and after["decode_context_tokens"] == (4 + 5) * 2
    full = full_step_seconds(before, after)
    spec = EmulatedGpu("H100-SXM", "Qwen2.5-7B").server_spec(8)
    assert full == pytest.approx(spec.step_seconds(8, 8 * 4.5))
    slots = phase_slots([before], [after], wall_s=10 * full)
    assert slots.capacity == pytest.approx(80)
    assert slots.decode_rows == 4 and slots.prefill_tokens == 6 and slots.steps == 3
    metrics = slots.metrics(trained_tokens=6, discarded_tokens=0)
    assert metrics["partial/slot_occupancy"] == pytest.approx(6 / 80)
    assert metrics["partial/slot/idle_fraction"] == pytest.approx(1 - 4 / 80)
    # A phase in which the engine ran no step: capacity 0 is reported (a run sums it), no ratio is.
    assert phase_slots([after], [after], wall_s=1.0).metrics(6, 0) == {
        "partial/slot/capacity": 0.0,
        "partial/engine/prefill_tokens": 0.0,
        "partial/engine/steps": 0.0,
        "partial/engine/overruns": 0.0,
    }


# ------------------------------------------------------------------------------------------ the setting
def test_the_choices_are_every_pair_of_the_hardware_tables_that_fits_one_gpu():
    fitting = set()
    for gpu, model in itertools.product(GPUS, MODELS):
        try:
            ServerSpec(GPUS[gpu], MODELS[model])
        except ValueError:
            continue
        fitting.add(f"{gpu}/{model}")
    assert set(EMULATE_GPU_CHOICES) == fitting


def test_the_setting_is_typed_and_names_its_key():
    assert BackendConfig("cpu", "H100-SXM/Qwen2.5-7B").emulated_gpu == EmulatedGpu("H100-SXM", "Qwen2.5-7B")
    assert BackendConfig("cpu").emulated_gpu is None
    for bad in ("h100/7b", "H100-SXM/Qwen2.5-32B", 7):  # a name, a pair that does not fit one GPU, a number
        with pytest.raises(ValueError, match=r"backend.emulate_gpu must be null or one of \['H100-SXM/Qwen2.5-7B'"):
            BackendConfig("cpu", bad)


@pytest.fixture(scope="module")
def model(demo_assets) -> str:
    return model_override(demo_assets)


EMULATE = "backend.emulate_gpu=H100-SXM/Qwen2.5-7B"


@pytest.mark.parametrize("backend", ["cpu", "cpu_sglang"])
def test_the_driver_hands_the_setting_to_every_ray_process(model, backend):
    config = task_runner_view(run_driver(f"+backend={backend}", EMULATE, model).config)
    assert backend_config(config).emulated_gpu == EmulatedGpu("H100-SXM", "Qwen2.5-7B")
    assert config.ray_kwargs.ray_init.runtime_env.env_vars[EMULATE_GPU_ENV] == "H100-SXM/Qwen2.5-7B"


def test_without_the_setting_no_server_emulates(model):
    config = task_runner_view(run_driver("+backend=cpu", model).config)
    assert EMULATE_GPU_ENV not in config.ray_kwargs.ray_init.runtime_env.env_vars


def test_refused_where_vllm_runs_the_engine(model):
    with pytest.raises(ValueError, match=r"backend.emulate_gpu is applied by verl-partial's CPU engine only"):
        run_driver("+backend=cpu_vllm", EMULATE, model)
    with pytest.raises(ValueError, match="trainer.use_v1 must be false"):  # v1 carries no backend block at all
        run_driver("+backend=cpu_vllm_v1", "+" + EMULATE, model)


V1_EMULATE = f"+ray_kwargs.ray_init.runtime_env.env_vars.{EMULATE_GPU_ENV}=H100-SXM/Qwen2.5-7B"


def test_on_verls_v1_trainer_the_env_var_is_the_setting(model):
    """``+backend=cpu_v1`` carries no backend block: the env var is set directly, and reaches every Ray process."""
    config = task_runner_view(run_driver("+backend=cpu_v1", V1_EMULATE, model).config)
    assert config.trainer.use_v1 is True and config.actor_rollout_ref.rollout.name == "cpu"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars[EMULATE_GPU_ENV] == "H100-SXM/Qwen2.5-7B"


def test_the_env_var_is_checked_as_strictly_as_the_typed_key(model):
    with pytest.raises(ValueError, match=r"CPU engine only \(actor_rollout_ref.rollout.name=cpu\)"):
        run_driver("+backend=cpu_vllm_v1", V1_EMULATE, model)  # vLLM would ignore it in silence
    with pytest.raises(ValueError, match=r"backend.emulate_gpu.*H100-SXM/Qwen2.5-7B"):  # names the allowed values
        run_driver("+backend=cpu_v1", V1_EMULATE.replace("H100-SXM", "A100"), model)


def test_a_server_started_with_the_drivers_env_runs_the_modelled_engine(demo_assets, monkeypatch, tmp_path):
    """What a Ray-launched server does: read ``VERL_PARTIAL_EMULATE_GPU``; its engine takes that GPU's step time and
    KV-cache capacity, and its ``engine_stats`` carry the setting and the capacity."""
    monkeypatch.setenv(EMULATE_GPU_ENV, "H100-SXM/Qwen2.5-7B")
    monkeypatch.setenv(ENGINE_STATS_DIR_ENV, str(tmp_path))
    config = RolloutConfig(name="cpu", prompt_length=32, response_length=8, max_num_seqs=4)
    server = CpuRolloutServer(
        config=config, model_config=HFModelConfig(path=str(demo_assets.model_dir)), replica_rank=0
    )
    spec = EmulatedGpu("H100-SXM", "Qwen2.5-7B").server_spec(4)

    async def run():
        params = {"max_tokens": 4, "ignore_eos": True, "temperature": 1.0}
        await server.generate(prompt_ids=[1, 2, 3], sampling_params=params, request_id="a")
        server.engine.mark("sleep", 0)  # a trainer's stamp carries the engine's modelled time so far
        await server.engine.close()

    asyncio.run(run())
    stats = server.engine_stats()
    assert (stats["emulate_gpu"], stats["max_num_seqs"], stats["steps"]) == ("H100-SXM/Qwen2.5-7B", 4, 4)
    assert stats["kv_capacity_tokens"] == server.engine.kv_capacity_tokens == spec.kv_capacity_tokens == 798_339
    assert stats["preemptions"] == 0
    assert stats["prefix_caching"] and server.engine.prefix_caching  # verl's enable_prefix_caching, on by default
    # The prefill of 3 tokens, then 3 decodes at contexts 4, 5, 6: the simulator's step times for these shapes.
    expected = spec.step_seconds(0, 0.0, 3, 4.5) + sum(spec.step_seconds(1, float(c)) for c in (4, 5, 6))
    assert stats["modelled_s"] == pytest.approx(expected)
    # What a benchmark reads under any trainer (verl's own never ask): the same counters, written as the loop ended.
    written = json.loads((tmp_path / "engine-0.json").read_text())
    ((event, step, _, modelled, prefill, steps),) = written.pop("marks")
    # every step ran before the stamp; the prefill's part is the first step's beyond a step without it
    prefilled = spec.step_seconds(0, 0.0, 3, 4.5) - spec.step_seconds(0, 0.0, 0, 0.0)
    assert (event, step, modelled, steps) == ("sleep", 0, pytest.approx(expected), 4)
    assert prefill == pytest.approx(prefilled) == pytest.approx(stats["modelled_prefill_s"])
    assert written == {key: stats[key] for key in written} and written["steps"] == 4


@pytest.mark.parametrize(("name", "server_class"), [("cpu", CpuRolloutServer), ("sglang", FixedCpuSglangServer)])
def test_weight_loads_and_sleeps_are_stamped_in_the_file_a_benchmark_reads(
    demo_assets, monkeypatch, tmp_path, name, server_class
):
    """What lets the peer benchmark time every trainer's step cycle and rollout window from the engine's side: each
    weight load (with the trainer's step) and each sleep, on the wall clock, written at once (a Ray run ends by
    killing the server, so nothing may wait for the loop's end). The SGLang double's sleep releases its memory after
    the stamp."""
    monkeypatch.setenv(ENGINE_STATS_DIR_ENV, str(tmp_path))
    config = RolloutConfig(name=name, prompt_length=32, response_length=8, max_num_seqs=4)
    server = server_class(config=config, model_config=HFModelConfig(path=str(demo_assets.model_dir)), replica_rank=0)
    weights: dict[str, torch.Tensor] = {}  # the stamp, not the copy, is under test

    def marks() -> list[list]:
        return json.loads((tmp_path / "engine-0.json").read_text())["marks"]

    began = time.time()
    asyncio.run(server.load_weights(weights, 0))
    assert [mark[:2] for mark in marks()] == [["weights", 0]]
    asyncio.run(server.sleep())
    asyncio.run(server.load_weights(weights, 1))
    stamped = marks()
    assert [mark[:2] for mark in stamped] == [["weights", 0], ["sleep", 0], ["weights", 1]]
    times = [mark[2] for mark in stamped]
    assert began <= times[0] <= times[1] <= times[2] <= time.time()


@pytest.mark.parametrize(("emulate", "enable_prefix_caching", "expected"), [(True, False, False), (False, True, False)])
def test_the_prefix_cache_follows_verls_setting_and_only_shapes_a_modelled_engine(
    demo_assets, monkeypatch, emulate, enable_prefix_caching, expected
):
    """``rollout.enable_prefix_caching=False`` turns it off; the plain CPU engine's steps take their real compute,
    which a prefix cache the forward does not use could not shorten, so it keeps none."""
    if emulate:
        monkeypatch.setenv(EMULATE_GPU_ENV, "H100-SXM/Qwen2.5-7B")
    else:
        monkeypatch.delenv(EMULATE_GPU_ENV, raising=False)
    config = RolloutConfig(
        name="cpu", prompt_length=32, response_length=8, max_num_seqs=4, enable_prefix_caching=enable_prefix_caching
    )
    server = CpuRolloutServer(
        config=config, model_config=HFModelConfig(path=str(demo_assets.model_dir)), replica_rank=0
    )
    assert server.engine.prefix_caching is expected and server.engine_stats()["prefix_caching"] is expected


def test_a_step_end_abort_resets_the_servers_prefix_cache(demo_assets, monkeypatch):
    """verl's ``abort_all_requests(reset_prefix_cache=True)``, as at every step end: a sample resumed after it
    prefills its prompt again, where one sent without the abort hits its sibling's blocks."""
    monkeypatch.setenv(EMULATE_GPU_ENV, "H100-SXM/Qwen2.5-7B")
    config = RolloutConfig(name="cpu", prompt_length=48, response_length=8, max_num_seqs=4)
    server = CpuRolloutServer(
        config=config, model_config=HFModelConfig(path=str(demo_assets.model_dir)), replica_rank=0
    )
    prompt, params = list(range(1, 41)), {"max_tokens": 1, "ignore_eos": True, "temperature": 1.0}

    async def cached(request_id: str) -> int:
        before = server.engine.stats.cached_tokens
        await server.generate(prompt_ids=prompt, sampling_params=params, request_id=request_id)
        return server.engine.stats.cached_tokens - before

    async def run():
        first, sibling = await cached("a"), await cached("b")
        await server.abort_all_requests(reset_prefix_cache=True)
        await server.resume_generation()
        resumed = await cached("c")
        await server.engine.close()
        return first, sibling, resumed

    assert asyncio.run(run()) == (0, 32, 0)
