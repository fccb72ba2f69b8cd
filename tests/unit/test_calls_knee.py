"""``partial.max_calls_per_server=auto``: calls per server capped at the compute knee of the servers' GPU, found by
the name each engine reports.

Past the knee a decode step's linear layers are compute-bound: a request more adds step time, not throughput, so the
phase start's burst of calls costs what the tail's half-empty steps could have absorbed (docs/evidence.md#sim-knee).
The lookup (the simulator's hardware table), the cap the pool applies, what each engine's server reports (our engine
emulating a GPU, verl's SGLang server under the fix, through NVML) and the driver's read are checked here; the vLLM
server's read, and the names in the table against the pinned vLLM wheel, in the vLLM tier
(tests/unit/test_vllm_device_names.py); through verl's trainer and Ray in tests/e2e/test_partial_e2e.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
import sys
from types import ModuleType, SimpleNamespace

import pytest
from sim_engine import SimEngine, SimServer
from test_cpu_rollout_server import make_server
from test_kv_cache_read import make_sglang, resolve
from test_partial_scheduler import check_groups, check_ledger, simulate
from test_sglang_server import verl_server, verl_sglang_server  # noqa: F401 -- the fixture: verl's SGLangHttpServer

from verl_partial.config.backend import EMULATE_GPU_CHOICES, EMULATE_GPU_ENV, EmulatedGpu
from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PRESETS, PartialConfig
from verl_partial.core.engines.adapter import GPU_NAME_METHOD, read_gpu_names
from verl_partial.core.partial.pool import RolloutPool
from verl_partial.glue.engines.sglang import nvml_gpu_name
from verl_partial.glue.partial.rollout import server_call_knee
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.hardware import GPUS, GPUS_BY_DEVICE_NAME, MODELS, compute_knee, knee_of_servers

H20, H200, H100 = "NVIDIA H20", "NVIDIA H200", "NVIDIA H100 80GB HBM3"


# ------------------------------------------------------------------------------------------ the table
def test_the_knee_is_the_gpus_and_the_simulators_for_every_model_that_fits():
    """The model's size cancels (its weights' read and its per-request FLOPs both scale with it): one knee per GPU,
    the one the simulator's servers turn compute-bound at."""
    for gpu in GPUS.values():
        for model in MODELS.values():
            try:
                spec = ServerSpec(gpu, model)
            except ValueError:  # does not fit one GPU: tensor parallelism divides both terms alike
                spec = ServerSpec(gpu, model, tp=4)
            assert spec.compute_knee == compute_knee(gpu), (gpu.name, model.name)


def test_the_knees_the_docstring_names_are_the_tables():
    source = " ".join(inspect.getsource(PartialConfig).split())
    stated = re.search(r"(\d+) on an H20, (\d+) on an H200, (\d+) on an H100", source)
    assert stated, "partial.max_calls_per_server's docstring no longer names the knees"
    assert (
        tuple(int(value) for value in stated.groups())
        == tuple(compute_knee(GPUS_BY_DEVICE_NAME[name]) for name in (H20, H200, H100))
        == (26, 147, 210)
    )


def test_every_emulated_gpu_reports_a_name_the_table_finds():
    for choice in EMULATE_GPU_CHOICES:
        gpu = EmulatedGpu.parse(choice)
        assert gpu is not None and GPUS_BY_DEVICE_NAME[gpu.device_name] is GPUS[gpu.gpu]


def test_the_smallest_knee_over_the_servers_and_none_without_a_gpu():
    assert knee_of_servers({"a": H200, "b": H20}) == 26
    assert knee_of_servers({"a": H200, "b": None}) == 147  # a server on no GPU does not lower the others' cap
    assert knee_of_servers({"a": None, "b": None}) is None
    assert knee_of_servers({}) is None


def test_a_gpu_the_table_does_not_know_is_refused_naming_the_key_the_gpu_and_its_servers():
    with pytest.raises(ValueError) as error:
        knee_of_servers({"s0": H20, "s1": "NVIDIA GeForce RTX 4090", "s2": "NVIDIA GeForce RTX 4090"})
    message = str(error.value)
    assert "partial.max_calls_per_server=auto" in message and "an integer" in message
    assert "['NVIDIA GeForce RTX 4090']" in message and "['s1', 's2']" in message and H20 in message


# ------------------------------------------------------------------------------------------ the pool
def pool(max_calls_per_server: int | str, knee: int | None) -> RolloutPool:
    config = dataclasses.replace(PRESETS["default"], max_calls_per_server=max_calls_per_server)
    return RolloutPool(config, group_size=2, batch_groups=2, response_length=8, server_call_knee=knee)


def test_the_default_caps_at_the_knee_up_to_the_ceiling_and_an_integer_is_the_cap_itself():
    assert PartialConfig().max_calls_per_server == "auto" and CALLS_PER_SERVER_CEILING == 512
    assert pool("auto", 26).calls_cap() == 26
    assert pool("auto", None).calls_cap() == CALLS_PER_SERVER_CEILING  # no GPU: the cap before ``auto``
    assert pool("auto", 4096).calls_cap() == CALLS_PER_SERVER_CEILING  # below Ray's 1000 concurrent calls
    assert pool(40, 26).calls_cap() == 40  # set by hand: the knee is not consulted


def test_through_the_scheduler_no_server_holds_more_calls_than_the_knee():
    """The real scheduler over servers of 16 slots each: without a knee a server gets every call a step has; at a
    knee of 3 none holds more than 3, whole groups are still trained once each, and the metrics name the knee."""
    n, batch, length, seed, steps = 4, 4, 60, 5, 4
    results = {}
    for knee in (None, 3):
        engine = SimEngine(seed, length, [SimServer("s0", max_num_seqs=16), SimServer("s1", max_num_seqs=16)])
        run = simulate(
            PRESETS["default"], n=n, batch=batch, steps=steps, response_length=length, seed=seed, engine=engine,
            server_call_knee=knee,
        )  # fmt: skip
        check_groups(run.trained, PRESETS["default"], n, batch, length, seed)
        check_ledger(run, batch, 0)
        results[knee] = (max(engine.max_outstanding.values()), run.metrics)
    uncapped, capped = results[None], results[3]
    assert uncapped[0] > 3 and capped[0] == 3
    assert {m["partial/server_load/calls_knee"] for m in capped[1]} == {3.0}
    assert {m["partial/server_load/calls_cap"] for m in capped[1]} == {3.0}
    assert {m["partial/server_load/calls_knee"] for m in uncapped[1]} == {0.0}


# ------------------------------------------------------------------------------------------ the servers
@pytest.mark.parametrize("emulate", [None, "H20/Qwen2.5-32B", "H200-SXM/Qwen2.5-32B"])
def test_our_servers_name_the_gpu_they_emulate_on_both_semantics(demo_assets, monkeypatch, emulate):
    """The plain CPU engine runs on no GPU; an emulated one names its GPU as vLLM and NVML would. The SGLang double
    answers for the hardware it emulates (the fix's NVML read would see this machine)."""
    if emulate:
        monkeypatch.setenv(EMULATE_GPU_ENV, emulate)
    expected = {None: None, "H20/Qwen2.5-32B": H20, "H200-SXM/Qwen2.5-32B": H200}[emulate]
    for server in (make_server(demo_assets), make_sglang(demo_assets)):
        assert asyncio.run(server.gpu_name()) == expected


class _FakeNvml(ModuleType):
    """What ``nvml_gpu_name`` uses of ``pynvml`` (nvidia-ml-py): two GPUs, by index and by UUID."""

    class NVMLError(Exception):
        pass

    def __init__(self, names: dict[int, bytes | str], fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.names, self.fail_init, self.open = names, fail_init, 0

    def nvmlInit(self) -> None:  # noqa: N802 -- NVML's names
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")
        self.open += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.open -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if index not in self.names:
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:  # noqa: N802
        return int(uuid.removeprefix("GPU-"))

    def nvmlDeviceGetName(self, handle: int) -> bytes | str:  # noqa: N802
        return self.names[handle]


def test_nvml_names_the_first_visible_gpu_by_index_or_uuid_and_none_without_one(monkeypatch):
    nvml = _FakeNvml({0: b"NVIDIA H100 80GB HBM3", 3: "NVIDIA H20"})  # older nvidia-ml-py returns bytes
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert nvml_gpu_name("3,0") == H20
    assert nvml_gpu_name(None) == H100  # unset: device 0
    assert nvml_gpu_name("GPU-3") == H20
    assert nvml_gpu_name("") is None  # no GPU visible
    assert nvml_gpu_name("7") is None  # NVML does not see it
    assert nvml.open == 0  # every read shuts NVML down again
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml({}, fail_init=True))
    assert nvml_gpu_name("0") is None  # no driver (a CPU machine, an AMD GPU)


def test_verls_sglang_server_under_the_fix_names_its_gpu_through_nvml(verl_sglang_server, monkeypatch):  # noqa: F811
    """verl's own class, fixed by the plugin's hook: device 0 of the ``CUDA_VISIBLE_DEVICES`` verl's server sets."""
    assert hasattr(verl_sglang_server, GPU_NAME_METHOD)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml({0: H200, 5: H20}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    server = object.__new__(verl_sglang_server)
    assert asyncio.run(server.gpu_name()) == H20


# ------------------------------------------------------------------------------------------ the driver's read
class _Handle:
    """What ``read_gpu_names`` uses of a Ray actor handle: ``handle.gpu_name.remote()``."""

    def __init__(self, server):
        self.gpu_name = SimpleNamespace(remote=server.gpu_name)


def test_the_driver_reads_every_servers_gpu_and_refuses_a_server_without_the_method(demo_assets, monkeypatch):
    plain = make_server(demo_assets)
    monkeypatch.setenv(EMULATE_GPU_ENV, "H20/Qwen2.5-32B")
    emulated = make_server(demo_assets)
    names = read_gpu_names({"a": _Handle(emulated), "b": _Handle(plain)}, resolve)
    assert names == {"a": H20, "b": None} and knee_of_servers(names) == 26
    with pytest.raises(RuntimeError, match=rf"partial.max_calls_per_server=auto .*\['s1'\].* {GPU_NAME_METHOD}"):
        read_gpu_names({"s1": SimpleNamespace()}, resolve)


def test_a_server_of_several_data_parallel_engines_gets_the_knee_of_each():
    """The knee is one engine's batch; a verl replica of ``data_parallel_size`` engines batches that many."""
    assert server_call_knee({"a": H20, "b": H20}, SimpleNamespace(data_parallel_size=2)) == 52
    assert server_call_knee({"a": H20}, SimpleNamespace(data_parallel_size=None)) == 26
    assert server_call_knee({"a": None}, SimpleNamespace(data_parallel_size=2)) is None
