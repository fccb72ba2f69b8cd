"""Run the real scheduler (``run_step`` + ``RolloutPool``, unchanged) against simulated GPU servers.

One call simulates ``steps`` rollout phases of one mode and returns what the projection tables report: rollout
seconds per step, trained and thrown-away tokens, staleness, trained response lengths (for the length-bias KS
distance) and how many steps each trained group waited. Training time and weight-sync time are not modelled:
the figures are the rollout phase only, like the published "gen" timings they are compared with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PRESETS, PartialConfig
from verl_partial.core.partial.length_batching import LengthBatcher
from verl_partial.core.partial.on_policy import length_estimator
from verl_partial.core.partial.pool import GroupState, RolloutPool, SampleState
from verl_partial.core.partial.scheduler import run_step
from verl_partial.sim.backend import SimBackend
from verl_partial.sim.bound import StepCostFloor, phase_floor
from verl_partial.sim.clock import run_virtual
from verl_partial.sim.engine import EngineStats, ServerSpec
from verl_partial.sim.stats import ks_distance
from verl_partial.sim.workload import PromptCycle, Workload

# The simulated engine never hangs; stall detection (tested elsewhere) must not fire on a long answer.
_NO_STALLS = {"request_timeout_s": 1e9}


def mode_configs(batch: int) -> dict[str, PartialConfig]:
    """The modes the projection compares: every ``+partial`` preset under its name (``PRESETS``), and variants.

    ``default``, ``restart``, ``kimi``, ``on_policy``: the presets of hydra_configs/partial/, as
    ``verl_partial.config.partial.PRESETS`` defines them. ``sync``: ``restart`` without over-provisioning,
    so a step waits for its slowest sample and nothing is parked, and every request sent at once whatever the servers'
    KV cache and compute knee -- verl's synchronous rollout. ``keep``:
    ``restart`` with ``staleness_policy=keep``. ``on_policy_over``: ``on_policy`` with over-provisioning
    (unfinished samples are restarted on the new weights, their tokens thrown away). ``default_extra``: ``default``'s
    bound with a batch of extra groups admitted at each step start instead of refill (v1's one batch ahead).
    """
    presets = {name: dataclasses.replace(config, **_NO_STALLS) for name, config in PRESETS.items()}
    return {
        "sync": dataclasses.replace(
            presets["restart"],
            extra_groups=0,
            kv_tokens_per_server="off",
            max_calls_per_server=CALLS_PER_SERVER_CEILING,
        ),
        **presets,
        "keep": dataclasses.replace(presets["restart"], staleness_policy="keep"),
        "on_policy_over": dataclasses.replace(presets["on_policy"], extra_groups=batch // 4),
        "default_extra": dataclasses.replace(presets["default"], refill=False, extra_groups=batch),
    }


#: Mode names before they became the preset names: ``partial`` was the old default (now ``restart``), ``stream``
#: today's (``default``). ``verl-partial simulate --modes`` still takes them, with a warning.
RENAMED_MODES = {"partial": "restart", "stream": "default"}


@dataclass
class ModeRun:
    """Per-step records of one simulated run."""

    seconds: list[float] = field(default_factory=list)
    tokens_generated: list[float] = field(default_factory=list)
    tokens_trained: list[float] = field(default_factory=list)
    tokens_discarded: list[float] = field(default_factory=list)
    staleness_mean: list[float] = field(default_factory=list)
    staleness_max: list[float] = field(default_factory=list)
    trained_lengths: list[np.ndarray] = field(default_factory=list)
    group_waits: list[np.ndarray] = field(default_factory=list)
    # Every server's counters summed over the whole run, warm-up included (as the emulated engine's are): what
    # benchmarks/sim_check_emulated.py sets beside the real engine's to locate a miss.
    engine: EngineStats = field(default_factory=EngineStats)

    def steady(self, warmup: int, steps: int | None = None) -> ModeRun:
        """The records of ``steps`` steps (default: all) after the first ``warmup`` (the pool starts empty).

        A mode and sync must be compared over the same steps: with a prompt set a few batches long, a step's
        length depends on which prompts it draws, and sync's phases differ by up to 2.5x from one step to the next.
        """
        end = None if steps is None else warmup + steps
        cut = {f.name: getattr(self, f.name)[warmup:end] for f in dataclasses.fields(self) if f.name != "engine"}
        return ModeRun(**cut, engine=self.engine)

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate(self.trained_lengths) if self.trained_lengths else np.zeros(0)

    @property
    def waits(self) -> np.ndarray:
        return np.concatenate(self.group_waits) if self.group_waits else np.zeros(0)


def simulate(
    config: PartialConfig,
    workload: Workload,
    spec: ServerSpec,
    servers: int,
    steps: int,
    clairvoyant: bool = False,
) -> ModeRun:
    """``steps`` rollout phases of ``config`` on ``servers`` simulated servers, in virtual time.

    ``partial.schedule=longest_first`` orders launches, and ``partial.length_window_steps`` composes batches, with a
    :class:`~verl_partial.core.partial.on_policy.LengthEstimator` over the prompts' history (prompt identity = its
    index in the workload's data set) and their finished siblings.

    ``clairvoyant``: launches go longest remaining answer first by the answers' true lengths, which no scheduler
    knows: a what-if that bounds what launch order alone could add to ``config`` (``partial.schedule`` is then
    ``longest_first`` with that order).
    """
    estimator = length_estimator(config, identity=lambda prompt: prompt)
    backend = SimBackend(spec, servers, workload)
    priority = estimator.priority if estimator else None
    if clairvoyant:
        config = dataclasses.replace(config, schedule="longest_first")

        def priority(group: GroupState[int], sample: SampleState) -> float:
            return -backend.remaining(group, next(i for i, s in enumerate(group.samples) if s is sample))

    async def main() -> ModeRun:
        pool: RolloutPool[int] = RolloutPool(
            config,
            group_size=workload.n,
            batch_groups=workload.batch,
            response_length=workload.response_length,
            priority=priority,
            engine_slots=servers * spec.max_num_seqs,
            server_kv_tokens=spec.kv_capacity_tokens,  # what each simulated server reports under ``auto``
            server_call_knee=spec.compute_knee,  # the knee of the GPU each simulated server names under ``auto``
        )
        source = PromptCycle(workload)
        batcher = estimator and LengthBatcher.for_config(config, source, workload.batch, estimator.prompt_history)
        record = ModeRun()
        for step in range(steps):
            source.step = step
            if batcher is not None:
                batcher.begin_step(step)
            result = await run_step(pool, backend, batcher or source, step=step, version=step, server_version=step)
            backend.update_weights(step + 1)
            if estimator is not None:
                estimator.record(result.trained)
            metrics = result.metrics
            record.seconds.append(result.seconds)
            record.tokens_generated.append(metrics["partial/tokens_generated"])
            record.tokens_trained.append(metrics["partial/tokens_trained"])
            record.tokens_discarded.append(metrics["partial/tokens_discarded"])
            record.staleness_mean.append(metrics["partial/staleness/mean"])
            record.staleness_max.append(metrics["partial/staleness/max"])
            record.trained_lengths.append(
                np.array([len(sample.token_ids) for group in result.trained for sample in group.samples])
            )
            record.group_waits.append(np.array([step - source.admitted_at[group.key] for group in result.trained]))
        for stats in (engine.stats for engine in backend.engines.values()):
            for name in (f.name for f in dataclasses.fields(EngineStats)):
                setattr(record.engine, name, getattr(record.engine, name) + getattr(stats, name))
        return record

    return run_virtual(main())


def throughput_limit(spec: ServerSpec, servers: int, workload: Workload) -> float:
    """The reference rate of the whole rollout: decode tokens/s of every server at full concurrency at the
    workload's mean running context. An estimate, not a limit (a run can exceed it: docs/method/gpu-simulator.md);
    the name and the ``share_of_limit`` key are kept so stored results still read."""
    return servers * spec.throughput_limit(workload.mean_running_context())


def summarize(run: ModeRun, sync: ModeRun, workload: Workload, limit: float) -> dict[str, float]:
    """One projection-table row: ``run`` and ``sync`` are steady-state records of the same workload."""
    seconds = float(np.mean(run.seconds))
    trained = float(np.mean(run.tokens_trained))
    return {
        "rollout_s": seconds,
        "rollout_s_std": float(np.std(run.seconds)),
        "rollout_s_min": float(np.min(run.seconds)),
        "rollout_s_max": float(np.max(run.seconds)),
        "speedup": float(np.mean(sync.seconds)) / seconds,
        "trained_tokens_per_s": trained / seconds,
        "share_of_limit": trained / seconds / limit,
        "staleness_mean": float(np.mean(run.staleness_mean)),
        "staleness_max": float(np.max(run.staleness_max)),
        "discarded_per_step": float(np.mean(run.tokens_discarded)),
        "discarded_fraction": float(np.sum(run.tokens_discarded) / max(1.0, np.sum(run.tokens_generated))),
        "ks_vs_sync": ks_distance(run.lengths, workload.reference_lengths()),
        "max_group_wait": float(run.waits.max()) if run.waits.size else 0.0,
        "mean_trained_length": float(run.lengths.mean()) if run.lengths.size else 0.0,
    }


def ceiling(
    sync: ModeRun,
    trained: ModeRun,
    workload: Workload,
    spec: ServerSpec,
    servers: int,
    max_staleness: int | None = None,
) -> float:
    """Highest speed-up over ``sync`` any colocated scheduler could reach training ``trained``'s batches at
    ``max_staleness`` (default: the staleness ``trained`` reached): sync's mean phase over the staleness floor
    (verl_partial/sim/bound.py). A bound for that batch composition only: schedules that regroup samples into other
    batches are not covered (the CLI labels it a bound, docs/method/gpu-simulator.md)."""
    staleness = int(max(trained.staleness_max)) if max_staleness is None else max_staleness
    floor = phase_floor(trained.trained_lengths, workload.prompt_len, StepCostFloor.of_server(spec), servers, staleness)
    return float(np.mean(sync.seconds)) / floor
