"""Partial rollout inside verl's RayPPOTrainer, without touching ``fit()``.

``fit()`` draws a batch of prompts, generates for exactly those, and unions prompts with outputs row
by row. Partial rollout trains groups whose generation started in earlier steps, so the prompts of a
step are only known once generation is over. We therefore generate one step ahead, inside the
training dataloader:

1. ``PartialRolloutLoader.__iter__`` (what ``fit()`` iterates) keeps the pool full from the real
   dataloader, runs :func:`verl_partial.core.partial.scheduler.run_step` until ``train_batch_size`` groups
   are finished, and yields exactly those groups' prompt rows;
2. ``fit()`` assigns uids and calls ``PartialAgentLoopManager.generate_sequences``, which returns
   the outputs already generated for those rows, plus a per-token policy-version tensor;
3. validation calls go straight to verl's own ``generate_sequences``.

Generation time is moved back into verl's ``timing_s/gen`` and ``timing_s/step`` so throughput
metrics keep their meaning (see ``patches.trainer``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopManager

from verl_partial.config.job import group_filter_of
from verl_partial.config.partial import STATE_FILE, PartialConfig
from verl_partial.core.engines.adapter import check_take_back, engine_adapter, read_gpu_names, read_kv_cache_tokens
from verl_partial.core.partial.group_filter import SampleScore
from verl_partial.core.partial.length_batching import LengthBatcher
from verl_partial.core.partial.on_policy import length_estimator
from verl_partial.core.partial.pool import GroupState, RolloutPool, SampleState
from verl_partial.core.partial.scheduler import StepResult, run_step
from verl_partial.core.partial.turn_metrics import parked_turn_metrics, trained_turn_metrics
from verl_partial.cpu_backend.occupancy import phase_slots
from verl_partial.glue.dataproto import (
    PARTIAL_KEY,
    attach_versions,
    concat_chunks,
    group_keys,
    hand_over_rows,
    is_validation,
    response_tokens,
    row_chunks,
    set_hand_over_meta,
)
from verl_partial.glue.partial.agent_loop import FinishedSample, PartialAgentLoopWorker
from verl_partial.glue.partial.segment_backend import WORKER_MAX_CONCURRENCY, WorkerSegmentBackend, worker_of
from verl_partial.glue.partial.step_loop import run_on_own_loop
from verl_partial.patches import guard
from verl_partial.sim.hardware import knee_of_servers

if TYPE_CHECKING:
    from verl import DataProto

logger = logging.getLogger("verl_partial.partial")

# How long validation waits for servers whose step-end abort outlived the step (their resume is chained on it).
# vLLM's abort waits up to 60 s for its admission barrier, then drains; five times that is a broken server.
REOPEN_TIMEOUT_S = 300.0

Row = dict[str, Any]


# ---------------------------------------------------------------------------------------------- rows
def split_rows(batch_dict: dict[str, Any]) -> list[Row]:
    """One dict per prompt from a collated dataloader batch (tensors and numpy arrays alike)."""
    size = len(next(iter(batch_dict.values())))
    return [{key: value[i] for key, value in batch_dict.items()} for i in range(size)]


def stack_rows(rows: list[Row]) -> dict[str, Any]:
    """Inverse of :func:`split_rows`; object arrays are filled element-wise so lists stay lists."""
    stacked: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if isinstance(values[0], torch.Tensor):
            stacked[key] = torch.stack(values)
        else:
            array = np.empty(len(values), dtype=object)
            for index, value in enumerate(values):
                array[index] = value
            stacked[key] = array
    return stacked


def reward_fields(row: Row) -> dict[str, Any]:
    """A prompt row's non-tensor fields: the keyword arguments verl's reward loop reads (data_source, reward_model,
    extra_info, raw_prompt, ...), as ``_agent_loop_postprocess`` passes them from the trainer's batch."""
    return {key: value for key, value in row.items() if not isinstance(value, torch.Tensor)}


class WorkerGroupScorer:
    """The scheduler's :class:`verl_partial.core.partial.scheduler.GroupScorer` over verl's AgentLoopWorkers: one
    Ray call per worker per batch of finished groups (a group goes to the worker that ran its segments, which then
    builds their rows for the hand-over)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def score(self, groups: list[GroupState[Row]]) -> list[list[SampleScore]]:
        by_worker: dict[int, list[GroupState[Row]]] = {}
        for group in groups:
            by_worker.setdefault(worker_of(group.group_id, len(self.workers)), []).append(group)
        refs = [
            self.workers[index].score.remote(
                [reward_fields(group.prompt) for group in batch for _ in group.samples],
                [
                    FinishedSample(group.prompt_ids, sample.token_ids, sample.log_probs, sample.payload)
                    for group in batch
                    for sample in group.samples
                ],
                [(group.key, index) for group in batch for index in range(len(group.samples))],
            )
            for index, batch in by_worker.items()
        ]
        answers = await asyncio.gather(*[asyncio.wrap_future(ref.future()) for ref in refs])
        scores: dict[int, list[SampleScore]] = {}
        for batch, answer in zip(by_worker.values(), answers, strict=True):
            position = 0
            for group in batch:
                scores[group.group_id] = list(answer[position : position + len(group.samples)])
                position += len(group.samples)
        return [scores[group.group_id] for group in groups]


def prompt_identity(row: Row) -> Any:
    """What the ledger names a prompt by: the dataset's ``extra_info.index`` when it has one."""
    extra = row.get("extra_info")
    if isinstance(extra, dict) and "index" in extra:
        return extra["index"]
    return row.get("index")


# ---------------------------------------------------------------------------------------------- source
class PromptStream:
    """The real dataloader as an endless stream of prompt rows across its epochs, checkpointable."""

    def __init__(self, loader: Any, total_epochs: int) -> None:
        self.loader = loader
        self.total_epochs = total_epochs
        self.epoch = 0  # epochs of the real loader started so far
        self.drawn = 0
        self.pending: list[Row] = []
        self._iterator: Iterator | None = None

    def next_prompt(self) -> tuple[Row, str] | None:
        while not self.pending:
            if self._iterator is None:
                if self.epoch >= self.total_epochs:
                    return None
                self._iterator = iter(self.loader)
                self.epoch += 1
            try:
                self.pending = split_rows(next(self._iterator))
            except StopIteration:
                self._iterator = None
        row = self.pending.pop(0)
        key = f"e{self.epoch}-{self.drawn}"
        self.drawn += 1
        return row, key

    def state_dict(self) -> dict[str, Any]:
        return {
            "loader": self.loader.state_dict(),
            "epoch": self.epoch,
            "drawn": self.drawn,
            "pending": self.pending,
            "iterating": self._iterator is not None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.drawn, self.pending = state["epoch"], state["drawn"], list(state["pending"])
        self.loader.load_state_dict(state["loader"])
        # A StatefulDataLoader resumes mid-epoch on the next iter(); only re-open it if it was open.
        self._iterator = iter(self.loader) if state["iterating"] else None


# ---------------------------------------------------------------------------------------------- manager
class PartialAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager plus the hand-over of groups finished by partial rollout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        guard.check_glue_reach()
        # A worker holds one streaming call per launch wave until its slowest segment ends; the concurrency cap
        # must never make a cancel wait behind them (Ray's default for async actors is 1000).
        self.agent_loop_workers_class = ray.remote(max_concurrency=WORKER_MAX_CONCURRENCY)(PartialAgentLoopWorker)
        super().__init__(*args, **kwargs)
        self._prepared: dict[str, GroupState[Row]] | None = None
        self._in_flight: list[GroupState[Row]] = []
        self._prepared_meta: dict[str, Any] = {}
        self._backend: WorkerSegmentBackend | None = None
        self._on_hand_over: Callable[[list[tuple[GroupState[Row], int]], DataProto], None] | None = None

    def segment_backend(self, server_manager: Any) -> WorkerSegmentBackend:
        """The backend over this manager's workers and ``server_manager``'s servers (verl's LLMServerManager)."""
        if self._backend is None:
            servers = server_handles(server_manager)
            ray.get([worker.set_servers.remote(servers) for worker in self.agent_loop_workers])
            check_take_back(servers, ray.get)  # fails here, before the first call, not mid-step
            self._backend = WorkerSegmentBackend(
                self.agent_loop_workers,
                servers,
                server_manager.get_replicas(),
                engine_adapter(self.rollout_config.name),
                tool_loop=self.rollout_config.agent.default_agent_loop == "tool_agent",
            )
        return self._backend

    def prepare(
        self,
        result: StepResult[Row],
        version: int,
        extra_metrics: dict[str, float],
        seconds: float,
        on_hand_over: Callable[[list[tuple[GroupState[Row], int]], DataProto], None] | None = None,
        in_flight: Collection[GroupState[Row]] = (),
    ) -> None:
        """Hold this step's finished groups until ``fit()`` asks for them; ``on_hand_over(order, output)`` sees
        the rows built for them (``order[i]`` = group and sample index of row ``i``). ``seconds``: the step's time in
        the loader, which ``fit()`` does not time, added to its ``timing_s/gen`` and ``timing_s/step``.
        ``in_flight``: the groups left in the pool, whose rows built ahead the workers keep."""
        self._on_hand_over = on_hand_over
        self._in_flight = list(in_flight)
        self._prepared = {group.key: group for group in result.trained}
        self._prepared_meta = {
            "metrics": {**result.metrics, **extra_metrics},
            "gen_seconds": seconds,
            "version": version,
        }

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        keys = group_keys(prompts)
        if is_validation(prompts) or keys is None:
            if self._prepared is not None and keys is None:
                raise RuntimeError(
                    "partial rollout prepared this step's groups but the trainer asked to generate other "
                    "prompts; unsupported trainer path (e.g. REMAX baseline rollouts)"
                )
            if self._backend is not None:  # validation right after a step end: the servers must be open again
                self._backend.wait_reopened(REOPEN_TIMEOUT_S)
            return super().generate_sequences(prompts)
        return self._hand_over(prompts, keys)

    def _hand_over(self, prompts: DataProto, keys: np.ndarray) -> DataProto:
        """verl's rows for the prepared groups, each group's by the worker that scored it and built its rows while
        the step generated (one call per run of consecutive rows on one worker: one per worker, as the loader
        orders the groups)."""
        if self._prepared is None:
            raise RuntimeError("partial rollout has no prepared groups for this training step")
        started = time.perf_counter()
        prepared, self._prepared = self._prepared, None
        order, next_sample = [], dict.fromkeys(prepared, 0)
        for key in keys:
            order.append((prepared[key], next_sample[key]))
            next_sample[key] += 1
        samples = [group.samples[index] for group, index in order]
        if any(count != len(prepared[key].samples) for key, count in next_sample.items()):
            raise RuntimeError("the trainer's batch does not hold every sample of the prepared groups")
        workers = len(self.agent_loop_workers)
        runs = worker_runs([worker_of(group.group_id, workers) for group, _ in order])
        rows = row_chunks(hand_over_rows(prompts), [(start, stop) for _, start, stop in runs])
        keep: list[list[str]] = [[] for _ in range(workers)]
        for group in self._in_flight:
            keep[worker_of(group.group_id, workers)].append(group.key)
        chunks = [
            self.agent_loop_workers[worker].hand_over.remote(
                chunk,
                [
                    FinishedSample(
                        prepared[keys[i]].prompt_ids,
                        sample.token_ids,
                        sample.log_probs,
                        sample.payload,
                        _score(*order[i]),
                    )
                    for i, sample in zip(range(start, stop), samples[start:stop], strict=True)
                ],
                [(group.key, index) for group, index in order[start:stop]],
                keep[worker],
            )
            for chunk, (worker, start, stop) in zip(rows, runs, strict=True)
        ]
        output, row_metrics = concat_chunks(ray.get(chunks))
        attach_versions(output, samples, self.rollout_config.response_length)
        # Inside verl's timing_s/gen while every engine is idle (the step's calls were taken back): a fixed cost of
        # each step's rollout phase that v1, building rows as trajectories finish, does not pay at its end.
        self._prepared_meta["metrics"]["partial/hand_over_s"] = time.perf_counter() - started
        set_hand_over_meta(output, self._performance_metrics(row_metrics, output), self._prepared_meta)
        if self._on_hand_over is not None:
            self._on_hand_over(order, output)
        return output


def _score(group: GroupState[Row], index: int) -> SampleScore | None:
    """The reward the group filter computed for a sample (reused at hand-over), None without a filter."""
    return None if group.scores is None else group.scores[index]


def _response_len(sample: SampleState) -> int:
    """Response tokens a sample trained: its tokens, or its whole trajectory (tool output included)."""
    return len(sample.token_ids) if sample.payload is None else len(sample.payload["response_ids"])


def worker_runs(row_workers: list[int]) -> list[tuple[int, int, int]]:
    """``(worker, start, stop)`` for each run of consecutive rows held by one worker."""
    runs: list[tuple[int, int, int]] = []
    for row, worker in enumerate(row_workers):
        if runs and runs[-1][0] == worker:
            runs[-1] = (worker, runs[-1][1], row + 1)
        else:
            runs.append((worker, row, row + 1))
    return runs


def server_handles(server_manager: Any) -> dict[str, Any]:
    """verl's LLMServerManager's servers by address (one per replica: each replica's first server)."""
    return dict(zip(server_manager.server_addresses, server_manager.server_handles, strict=True))


def engines_per_server(rollout_config: Any) -> int:
    """Engines one server (a verl replica) runs, each with its own batch: ``rollout.data_parallel_size``."""
    return int(getattr(rollout_config, "data_parallel_size", 1) or 1)


def engine_slots(rollout_config: Any, servers: int) -> int:
    """Samples the servers can run at once (``partial.fill_engine``): each server runs :func:`engines_per_server` of
    ``max_num_seqs`` slots; vLLM and SGLang both take ``rollout.max_num_seqs`` (verl passes it as vLLM's
    ``max_num_seqs`` and SGLang's ``max_running_requests``)."""
    return servers * int(rollout_config.max_num_seqs) * engines_per_server(rollout_config)


def server_call_knee(device_names: dict[str, str | None], rollout_config: Any) -> int | None:
    """Calls per server at the GPUs' compute knee (``partial.max_calls_per_server=auto``): the knee is each engine's
    batch, and a server runs :func:`engines_per_server` of them. None where no server names a GPU."""
    knee = knee_of_servers(device_names)  # refuses a GPU it does not know, naming it
    return None if knee is None else knee * engines_per_server(rollout_config)


def engine_counters(server_handles: list[Any]) -> list[dict[str, Any]] | None:
    """Every server's engine counters (one Ray call each), or None where the servers keep none (vLLM, SGLang)."""
    if not server_handles or not all(hasattr(handle, "engine_stats") for handle in server_handles):
        return None
    return ray.get([handle.engine_stats.remote() for handle in server_handles])


# ---------------------------------------------------------------------------------------------- loader
class PartialRolloutLoader:
    """Stands in for ``trainer.train_dataloader``: each item is a step's finished groups, generated here."""

    def __init__(self, trainer: Any, config: PartialConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.loader = trainer.train_dataloader
        rollout = trainer.config.actor_rollout_ref.rollout
        batch_groups = trainer.config.data.train_batch_size
        # partial.schedule=longest_first and partial.length_window_steps: expected lengths from finished siblings and
        # the prompt's earlier epochs (checkpointed: the batches a resumed run composes depend on it).
        self.length_estimator = length_estimator(config, prompt_identity)
        self.pool: RolloutPool[Row] = RolloutPool(
            config,
            group_size=rollout.n,
            batch_groups=batch_groups,
            response_length=rollout.response_length,
            priority=None if self.length_estimator is None else self.length_estimator.priority,
            group_filter=group_filter_of(trainer.config),
        )
        self.stream = PromptStream(self.loader, trainer.config.trainer.total_epochs)
        self.batcher = self.length_estimator and LengthBatcher.for_config(
            config, self.stream, batch_groups, self._expected_length
        )
        self.steps_in_epoch = 0
        self.servers_read = False

    def __len__(self) -> int:
        return len(self.loader)

    def _read_servers(self, servers: dict[str, Any], rollout_config: Any) -> None:
        """What the ``auto`` settings take from the engines, once per run at the first step (the servers start after
        the trainer that builds the pool): the KV cache (``partial.kv_tokens_per_server``) and the GPU's compute
        knee (``partial.max_calls_per_server``), each logged with what it sets."""
        if self.config.kv_tokens_per_server == "auto":
            self.pool.server_kv_tokens = read_kv_cache_tokens(servers, ray.get)
            logger.info(
                "partial.kv_tokens_per_server=auto: %s",
                "no engine reports its KV cache; calls are not capped by it"
                if self.pool.server_kv_tokens is None
                else f"{self.pool.server_kv_tokens:,} tokens of KV cache per server, as the engines report",
            )
        if self.config.max_calls_per_server == "auto":
            names = read_gpu_names(servers, ray.get)
            self.pool.server_call_knee = server_call_knee(names, rollout_config)
            logger.info(
                "partial.max_calls_per_server=auto: %s calls per server (GPUs %s)",
                self.pool.calls_cap(),
                sorted({str(name) for name in names.values()}),
            )
        self.servers_read = True

    def _expected_length(self, row: Row) -> float | None:
        """A prompt's expected length for ``partial.length_window_steps``; refuses a data set whose rows carry no
        identity across epochs, which would make the window silently keep the dataloader's order."""
        if prompt_identity(row) is None:
            raise ValueError(
                "partial.length_window_steps needs each prompt's identity across epochs (extra_info.index or index "
                "in the data set's rows), found none; add it to the data or set partial.length_window_steps=0"
            )
        assert self.length_estimator is not None
        return self.length_estimator.prompt_history(row)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.steps_in_epoch >= len(self.loader):
            self.steps_in_epoch = 0
        while self.steps_in_epoch < len(self.loader):
            batch = self._next_step()
            self.steps_in_epoch += 1
            yield batch

    def _next_step(self) -> dict[str, Any]:
        # All of it is rollout time outside fit()'s timers (run_step's, and the driver's work around it).
        started = time.perf_counter()
        trainer = self.trainer
        manager: PartialAgentLoopManager = trainer.async_rollout_manager
        if not isinstance(manager, PartialAgentLoopManager):
            raise RuntimeError(
                "partial rollout needs actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "verl_partial.glue.partial.rollout.PartialAgentLoopManager (set by +partial=...)"
            )
        step = trainer.global_steps
        backend = manager.segment_backend(trainer.llm_server_manager)
        self.pool.engine_slots = engine_slots(manager.rollout_config, len(trainer.llm_server_manager.server_handles))
        if not self.servers_read:
            self._read_servers(server_handles(trainer.llm_server_manager), manager.rollout_config)
        backend.begin_step(self.pool)
        if self.batcher is not None:
            self.batcher.begin_step(step)
        counters_before = engine_counters(trainer.llm_server_manager.server_handles)
        # Generation for step t runs on the weights synced after step t-1 (verl: update_weights(global_steps)).
        # Rewards while the step generates, as verl's own loop computes each answer's as it ends (its reward loop
        # workers): the hand-over reuses them rather than computing them all while every engine idles. A group filter
        # judges by them. Without reward loop workers (a reward model colocated with the actor) verl scores in fit().
        early = self.pool.group_filter is not None or manager.reward_loop_worker_handles is not None
        scorer = WorkerGroupScorer(manager.agent_loop_workers) if early else None
        result = run_on_own_loop(
            run_step(
                self.pool,
                backend,
                self.batcher or self.stream,
                step=step,
                version=step - 1,
                server_version=step - 1,
                scorer=scorer,
            )
        )
        if self.length_estimator is not None:
            self.length_estimator.record(result.trained)
        extra: dict[str, float] = {}
        if counters_before is not None:
            slots = phase_slots(
                counters_before, engine_counters(trainer.llm_server_manager.server_handles), result.seconds
            )
            extra.update(
                slots.metrics(result.metrics["partial/tokens_trained"], result.metrics["partial/tokens_discarded"])
            )
        if self.batcher is not None:
            extra["partial/window_delay_steps/max"] = float(max(self.batcher.delays, default=0))
        if step >= trainer.total_training_steps:
            # Prompts already drawn from verl's dataloader but not yet admitted are as untrained as in-flight groups.
            held_back = len(self.stream.pending) + (0 if self.batcher is None else len(self.batcher.pending))
            extra["partial/untrained_groups_at_end"] = float(len(self.pool.groups) + held_back)
            logger.warning(
                "training ends with %d partial-rollout groups in flight and %d drawn prompts not started, untrained",
                len(self.pool.groups),
                held_back,
            )
        dump = None if self.config.dump_dir is None else functools.partial(self._dump, step)
        if manager.rollout_config.agent.default_agent_loop == "tool_agent":
            extra.update(trained_turn_metrics([s.payload for g in result.trained for s in g.samples], step - 1))
            parked = [s.payload for g in self.pool.groups.values() for s in g.samples if s.payload is not None]
            extra.update(parked_turn_metrics(parked))
        self._write_ledger(step)
        # Ordered by the worker that holds each group's rows, so the hand-over is one call per worker.
        workers = len(manager.agent_loop_workers)
        trained = sorted(result.trained, key=lambda group: worker_of(group.group_id, workers))
        rows = stack_rows([{**group.prompt, PARTIAL_KEY: group.key} for group in trained])
        manager.prepare(
            result,
            step - 1,
            extra,
            time.perf_counter() - started,
            on_hand_over=dump,
            in_flight=list(self.pool.groups.values()),
        )
        return rows

    def _write_ledger(self, step: int) -> None:
        events, self.pool.events = self.pool.events, []
        if self.config.ledger_path is None or not events:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.config.ledger_path)), exist_ok=True)
        with open(self.config.ledger_path, "a") as ledger:
            for event, key in events:
                ledger.write(json.dumps({"step": step, "event": event, "key": key}) + "\n")

    def _dump(self, step: int, order: list[tuple[GroupState[Row], int]], output: DataProto) -> None:
        """Every trained sample as generated (ids, log-probs, versions) next to the padded row verl trains on."""
        responses = response_tokens(output)
        samples = []
        for row, (group, index) in enumerate(order):
            sample = group.samples[index]
            samples.append(
                {
                    "key": group.key,
                    "prompt_id": prompt_identity(group.prompt),
                    "index": index,
                    "prompt_ids": group.prompt_ids.tolist(),
                    "token_ids": sample.token_ids.tolist(),
                    "log_probs": sample.log_probs.tolist(),
                    "versions": sample.versions.tolist(),
                    "segments": sample.segments,
                    "finish": sample.finish.value if sample.finish is not None else None,
                    "trained_responses": responses[row, : _response_len(sample)].tolist(),
                    "trajectory": sample.payload,
                }
            )
        os.makedirs(self.config.dump_dir, exist_ok=True)
        torch.save(
            {"step": step, "version": step - 1, "samples": samples},
            os.path.join(self.config.dump_dir, f"step_{step}.pt"),
        )

    # verl saves/restores ``data.pt`` through these, but skips the restore at epoch boundaries; our
    # complete state (including the real loader's) lives in STATE_FILE, written before verl's tracker.
    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        state = {
            "pool": self.pool.state_dict(),
            "stream": self.stream.state_dict(),
            "steps_in_epoch": self.steps_in_epoch,
            "window": None if self.batcher is None else self.batcher.state_dict(),
            "length_history": None if self.length_estimator is None else dict(self.length_estimator.history),
        }
        path = os.path.join(folder, STATE_FILE)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    def load(self, folder: str) -> bool:
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            return False
        state = torch.load(path, weights_only=False)
        self.pool.load_state_dict(state["pool"])
        self.stream.load_state_dict(state["stream"])
        self.steps_in_epoch = state["steps_in_epoch"]
        window = state.get("window")
        if window is not None and window["pending"] and self.batcher is None:
            raise ValueError(
                f"partial.length_window_steps: the checkpoint in {folder} holds {len(window['pending'])} drawn prompts "
                "of a length window that this run would never admit; resume with the length_window_steps it was "
                "saved with (>= 2)"
            )
        if self.batcher is not None and window is not None:
            self.batcher.load_state_dict(window)
        if self.length_estimator is not None and state.get("length_history"):
            self.length_estimator.history.update(state["length_history"])
        return True
