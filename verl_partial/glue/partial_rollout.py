"""Partial rollout inside verl's RayPPOTrainer, without touching ``fit()``.

``fit()`` draws a batch of prompts, generates for exactly those, and unions prompts with outputs row
by row. Partial rollout trains groups whose generation started in earlier steps, so the prompts of a
step are only known once generation is over. We therefore generate one step ahead, inside the
training dataloader:

1. ``PartialRolloutLoader.__iter__`` (what ``fit()`` iterates) keeps the pool full from the real
   dataloader, runs :func:`verl_partial.core.scheduler.run_step` until ``train_batch_size`` groups
   are finished, and yields exactly those groups' prompt rows;
2. ``fit()`` assigns uids and calls ``PartialAgentLoopManager.generate_sequences``, which returns
   the outputs already generated for those rows, plus a per-token policy-version tensor;
3. validation calls go straight to verl's own ``generate_sequences``.

Generation time is moved back into verl's ``timing_s/gen`` and ``timing_s/step`` so throughput
metrics keep their meaning (see ``verl_patches``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
import torch
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopManager

from verl_partial.core.partial_config import PartialConfig
from verl_partial.core.pool import GroupState, RolloutPool, SegmentRequest
from verl_partial.core.scheduler import SegmentResult, StepResult, run_step
from verl_partial.glue.partial_agent_loop import (
    PARTIAL_AGENT_NAME,
    RESULT_FIELDS,
    SEGMENT_KEY,
    PartialAgentLoopWorker,
)

logger = logging.getLogger("verl_partial.partial")

PARTIAL_KEY = "partial_key"
VERSION_KEY = "rollout_policy_version"
META_KEY = "verl_partial"
STATE_FILE = "verl_partial_state.pt"

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


# ---------------------------------------------------------------------------------------------- backend
class AgentLoopSegmentBackend:
    """Runs one segment per call on verl's AgentLoopWorkers; aborts/resumes through verl's replicas."""

    def __init__(self, manager: PartialAgentLoopManager, replicas: list[Any], step: int) -> None:
        self.manager = manager
        self.replicas = replicas
        self.step = step

    async def generate(self, group: GroupState[Row], request: SegmentRequest) -> SegmentResult:
        sample = group.samples[request.ref.index]
        segment = {
            "request_id": request.request_id,
            "prompt_ids": group.prompt_ids,
            "prefix_ids": request.prefix_ids,
            "prefix_log_probs": list(sample.log_probs),
            "max_new_tokens": request.max_new_tokens,
        }
        non_tensor: dict[str, np.ndarray] = {}
        for key, value in group.prompt.items():
            if isinstance(value, torch.Tensor):
                continue
            array = np.empty(1, dtype=object)
            array[0] = value
            non_tensor[key] = array
        for key, value in ((SEGMENT_KEY, segment), ("agent_name", PARTIAL_AGENT_NAME)):
            array = np.empty(1, dtype=object)
            array[0] = value
            non_tensor[key] = array
        row = DataProto(batch=None, non_tensor_batch=non_tensor, meta_info={"global_steps": self.step})
        worker = self.manager.worker_for(request.request_id)
        output: DataProto = await worker.generate_sequences.remote(row)
        fields = output.non_tensor_batch
        return SegmentResult(
            new_ids=[int(t) for t in fields["partial_new_ids"][0]],
            new_log_probs=[float(v) for v in fields["partial_new_log_probs"][0]],
            eos=bool(fields["partial_eos"][0]),
            prompt_ids=[int(t) for t in fields["partial_prompt_ids"][0]],
            output=output,
            route=fields["partial_route"][0],
        )

    async def abort_all(self) -> None:
        await asyncio.gather(*[replica.abort_all_requests() for replica in self.replicas])

    async def resume(self) -> None:
        await asyncio.gather(*[replica.resume_generation() for replica in self.replicas])


# ---------------------------------------------------------------------------------------------- manager
class PartialAgentLoopManager(AgentLoopManager):
    """verl's AgentLoopManager plus the hand-over of groups finished by partial rollout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.agent_loop_workers_class = ray.remote(PartialAgentLoopWorker)
        super().__init__(*args, **kwargs)
        self._prepared: dict[str, GroupState[Row]] | None = None
        self._prepared_meta: dict[str, Any] = {}

    def worker_for(self, request_id: str) -> Any:
        # Same sample, same worker: keeps its segments' bookkeeping on one process.
        return self.agent_loop_workers[hash(request_id) % len(self.agent_loop_workers)]

    def prepare(self, result: StepResult[Row], version: int, extra_metrics: dict[str, float]) -> None:
        self._prepared = {group.key: group for group in result.trained}
        self._prepared_meta = {
            "metrics": {**result.metrics, **extra_metrics},
            "gen_seconds": result.seconds,
            "version": version,
        }

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if prompts.meta_info.get("validate", False) or PARTIAL_KEY not in prompts.non_tensor_batch:
            if self._prepared is not None and PARTIAL_KEY not in prompts.non_tensor_batch:
                raise RuntimeError(
                    "partial rollout prepared this step's groups but the trainer asked to generate other "
                    "prompts; unsupported trainer path (e.g. REMAX baseline rollouts)"
                )
            return super().generate_sequences(prompts)
        return self._hand_over(prompts)

    def _hand_over(self, prompts: DataProto) -> DataProto:
        if self._prepared is None:
            raise RuntimeError("partial rollout has no prepared groups for this training step")
        prepared, self._prepared = self._prepared, None
        keys = prompts.non_tensor_batch[PARTIAL_KEY]
        rows, versions, next_sample = [], [], dict.fromkeys(prepared, 0)
        response_length = self.rollout_config.response_length
        for key in keys:
            sample = prepared[key].samples[next_sample[key]]
            next_sample[key] += 1
            rows.append(sample.output)
            version_row = torch.full((response_length,), -1, dtype=torch.int64)
            version_row[: len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.int64)
            versions.append(version_row)
        if any(count != len(prepared[key].samples) for key, count in next_sample.items()):
            raise RuntimeError("the trainer's batch does not hold every sample of the prepared groups")
        row_metrics = [row.meta_info.pop("metrics") for row in rows]
        output = DataProto.concat(rows)
        for key in (SEGMENT_KEY, PARTIAL_KEY, "agent_name", *RESULT_FIELDS):
            output.non_tensor_batch.pop(key, None)
        # Keys both sides hold must match row for row in fit()'s union: take the trainer's own values.
        for key, value in prompts.non_tensor_batch.items():
            if key in output.non_tensor_batch:
                output.non_tensor_batch[key] = value
        output.batch[VERSION_KEY] = torch.stack(versions)
        timing = self._performance_metrics(row_metrics, output)
        output.meta_info = {
            **{k: v for k, v in output.meta_info.items() if k != "metrics"},
            "timing": timing,
            META_KEY: self._prepared_meta,
        }
        return output


# ---------------------------------------------------------------------------------------------- loader
class PartialRolloutLoader:
    """Stands in for ``trainer.train_dataloader``: each item is a step's finished groups, generated here."""

    def __init__(self, trainer: Any, config: PartialConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.loader = trainer.train_dataloader
        rollout = trainer.config.actor_rollout_ref.rollout
        self.pool: RolloutPool[Row] = RolloutPool(
            config,
            group_size=rollout.n,
            batch_groups=trainer.config.data.train_batch_size,
            response_length=rollout.response_length,
        )
        self.stream = PromptStream(self.loader, trainer.config.trainer.total_epochs)
        self.steps_in_epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.steps_in_epoch >= len(self.loader):
            self.steps_in_epoch = 0
        while self.steps_in_epoch < len(self.loader):
            batch = self._next_step()
            self.steps_in_epoch += 1
            yield batch

    def _next_step(self) -> dict[str, Any]:
        trainer = self.trainer
        manager: PartialAgentLoopManager = trainer.async_rollout_manager
        if not isinstance(manager, PartialAgentLoopManager):
            raise RuntimeError(
                "partial rollout needs actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                "verl_partial.glue.partial_rollout.PartialAgentLoopManager (set by +partial=...)"
            )
        step = trainer.global_steps
        backend = AgentLoopSegmentBackend(manager, trainer.llm_server_manager.get_replicas(), step)
        result = asyncio.run(run_step(self.pool, backend, self.stream, step=step, version=step - 1))
        extra: dict[str, float] = {}
        if step >= trainer.total_training_steps:
            # Prompts already drawn from verl's dataloader but not yet admitted are as untrained as in-flight groups.
            held_back = len(self.stream.pending)
            extra["partial/untrained_groups_at_end"] = float(len(self.pool.groups) + held_back)
            logger.warning(
                "training ends with %d partial-rollout groups in flight and %d drawn prompts not started, untrained",
                len(self.pool.groups),
                held_back,
            )
        manager.prepare(result, step - 1, extra)
        self._write_ledger(step)
        self._dump(step, result.trained)
        rows = []
        for group in result.trained:
            rows.append({**group.prompt, PARTIAL_KEY: group.key})
        return stack_rows(rows)

    def _write_ledger(self, step: int) -> None:
        events, self.pool.events = self.pool.events, []
        if self.config.ledger_path is None or not events:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.config.ledger_path)), exist_ok=True)
        with open(self.config.ledger_path, "a") as ledger:
            for event, key in events:
                ledger.write(json.dumps({"step": step, "event": event, "key": key}) + "\n")

    def _dump(self, step: int, groups: list[GroupState[Row]]) -> None:
        if self.config.dump_dir is None:
            return
        samples = [
            {
                "key": group.key,
                "prompt_id": prompt_identity(group.prompt),
                "index": index,
                "prompt_ids": group.prompt_ids,
                "token_ids": sample.token_ids,
                "log_probs": sample.log_probs,
                "versions": sample.versions,
                "segments": sample.segments,
                # The padded row verl trains on, to check it holds exactly these tokens.
                "trained_responses": sample.output.batch["responses"][0].tolist(),
            }
            for group in groups
            for index, sample in enumerate(group.samples)
        ]
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
        return True
