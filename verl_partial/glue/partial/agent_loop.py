"""The worker side of partial rollout: segments and the hand-over, run inside verl's AgentLoopWorker.

Why here: verl's AgentLoopWorker already holds what a segment needs (tokenizer, verl's continuous-token prompt
builder, sampling parameters from the rollout config) and what the hand-over needs (verl's own padding, position
ids and reward call: ``_agent_loop_postprocess`` and ``_postprocess``). The driver only schedules.

* :meth:`PartialAgentLoopWorker.run_segments` takes one wave's calls for this worker in ONE Ray call and streams a
  compact :class:`SegmentAnswer` back per call as soon as it ends (a Ray streaming generator). Each call goes to
  the server the driver's router chose, by its actor handle, with the call's own request id, so
  :meth:`take_back_segments` can abort that very request at its server (it returns its tokens), and
  :meth:`cancel_segments` can drop it as a last resort. A group's prompt is tokenised once (verl's
  ``ct_build_initial_tokens``) and cached here until the driver has the ids.
* :meth:`PartialAgentLoopWorker.score` computes finished samples' rewards through verl's reward loop
  (``_compute_score``) while the step generates, and then builds their padded rows in the background, as verl's own
  loop builds each answer's row as it ends.
* :meth:`PartialAgentLoopWorker.hand_over` gives verl's rows for the samples that go to training: the rows built
  ahead where the sample is the one scored, built now (``_agent_loop_postprocess``) otherwise, then ``_postprocess``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
)

from verl_partial.config.job import max_positions_of
from verl_partial.core.engines.adapter import check_model_len, engine_adapter
from verl_partial.core.partial.finish import Finish, eos_id_set
from verl_partial.core.partial.group_filter import SampleScore
from verl_partial.core.partial.pool import LOG_PROB_DTYPE, TOKEN_DTYPE
from verl_partial.core.partial.trajectory import Trajectory
from verl_partial.glue.dataproto import row_fields
from verl_partial.glue.partial.tool_loop import (
    PartialToolAgentLoop,
    agent_loop_kwargs,
    make_partial_tool_loop,
    run_tool_segment,
    runs_tools,
)

if TYPE_CHECKING:
    from verl import DataProto

logger = logging.getLogger("verl_partial.partial")

# Resilience testing (documented API, docs/engines.md "Resilience testing"): every call waits a random 0..this
# many seconds in its worker before it is sent, so that calls are in transit (launched, not yet at their server) at a
# step end on purpose -- on any engine, vLLM included. Unset (0) in real runs.
TRANSIT_DELAY_ENV = "VERL_PARTIAL_TRANSIT_DELAY_S"


@dataclass(frozen=True)
class SegmentCall:
    """One generate call, as the driver sends it: no dataset row, only what the server needs.

    ``prompt_ids`` is sent once the driver knows them; before that, the group's first call to this worker
    carries ``raw_prompt`` and later ones neither (the worker's cache tokenises once per group).
    """

    request_id: str
    server: str
    group_key: str
    prefix: np.ndarray  # int32, the sample's response tokens so far
    max_new_tokens: int
    prompt_ids: np.ndarray | None = None
    raw_prompt: Any = None
    # Multi-turn (verl's tool agent loop): the dataset row's fields the loop reads, and the parked trajectory
    # (``None`` on its first segment). Such a call runs ``partial_tool_loop.run_tool_segment`` instead.
    row: dict[str, Any] | None = None
    payload: dict[str, Any] | None = None


@dataclass(frozen=True)
class SegmentAnswer:
    """What a call produced, streamed back to the driver: new tokens only, or the error it raised."""

    request_id: str
    new_ids: np.ndarray  # int32
    new_log_probs: np.ndarray  # float32
    finish: Finish
    server_version: int | None
    prompt_ids: np.ndarray | None = None
    error: str | None = None
    payload: dict[str, Any] | None = None  # the trajectory to park (multi-turn)


@dataclass(frozen=True)
class FinishedSample:
    """A finished sample at hand-over: exact ids and log-probs, nothing padded."""

    prompt_ids: np.ndarray  # int32
    token_ids: np.ndarray  # int32
    log_probs: np.ndarray  # float32
    payload: dict[str, Any] | None = None  # multi-turn: the finished trajectory (mask, turns, tool output)
    score: SampleScore | None = None  # its reward, computed while its step generated: not scored again

    def same_as(self, other: FinishedSample) -> bool:
        """Whether ``other`` is this very answer with the same reward (a row built for one serves the other).
        Multi-turn trajectories are never compared: their rows are built at the hand-over."""
        return (
            self.payload is None
            and other.payload is None
            and _equal(self.score, other.score)
            and all(
                np.array_equal(mine, theirs)
                for mine, theirs in (
                    (self.prompt_ids, other.prompt_ids),
                    (self.token_ids, other.token_ids),
                    (self.log_probs, other.log_probs),
                )
            )
        )


def _equal(mine: Any, theirs: Any) -> bool:
    """``==`` that says False where the comparison itself fails (a reward's extra info holding arrays)."""
    try:
        return bool(mine == theirs)
    except (TypeError, ValueError):
        return False


# Which sample a row is for: its group's key and its index in the group.
SampleKey = tuple[str, int]


@dataclass
class RowAhead:
    """A finished sample's row, being built (or built) while the step generates, for the sample it was built from."""

    sample: FinishedSample
    row: asyncio.Future[Any]  # verl's _InternalAgentLoopOutput


def _empty_answer(call: SegmentCall, server_version: int | None = None, error: str | None = None) -> SegmentAnswer:
    return SegmentAnswer(
        call.request_id,
        np.zeros(0, TOKEN_DTYPE),
        np.zeros(0, LOG_PROB_DTYPE),
        Finish.ABORTED,
        server_version,
        error=error,
    )


def check_loaded_model_len(rollout_config: Any, hf_config: Any) -> None:
    """The model-length check on the model config verl loaded for this worker (issue 26, finding 7).

    The driver checks before Ray starts when it can read the model's config from local files; a hub id not
    downloaded yet, or a remote path, is only readable here. Raising here fails the worker's start, before any
    call: a context too small is never silently accepted.
    """
    check_model_len(
        rollout_config.max_model_len,
        rollout_config.prompt_length,
        rollout_config.response_length,
        max_position_embeddings=max_positions_of(hf_config),
        rollout_name=str(rollout_config.name),
    )


class PromptBuilder(AgentLoopBase):
    """verl's agent-loop base, used for its continuous-token prompt builder only (never selected as a loop).

    Partial rollout tokenises exactly as verl's single-turn loop does (``ct_build_initial_tokens``), so a sample's
    prompt ids are the ones verl would have trained on.
    """

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise TypeError("PromptBuilder only tokenises prompts; segments run in PartialAgentLoopWorker.run_segments")


def answer_end_ids(ignore_eos: bool, *model_eos_ids: int | list[int] | None) -> frozenset[int]:
    """The model's EOS ids at which the worker ends an answer it gets back, or none under ``rollout.ignore_eos``.

    The cut at the first EOS exists for engines that return tokens past it (a speculative run). Under ignore_eos the
    engine decodes through EOS on purpose and verl's own loop trains the whole run: cutting there would silently undo
    the user's setting (it did, answers of 4-36 tokens where the engine had decoded the whole 144).
    """
    return frozenset() if ignore_eos else eos_id_set(*model_eos_ids)


class PartialAgentLoopWorker(AgentLoopWorker):
    """verl's AgentLoopWorker plus streaming segments, cancellation and the hand-over of finished samples."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine_adapter(self.rollout_config.name)
        check_loaded_model_len(self.rollout_config, self.model_config.hf_config)
        generation_config = self.model_config.generation_config
        self.eos_from_model = answer_end_ids(
            self.rollout_config.ignore_eos,
            self.tokenizer.eos_token_id,
            getattr(generation_config, "eos_token_id", None) if generation_config else None,
        )
        self.servers: dict[str, Any] = {}
        self.prompts: dict[str, asyncio.Future[np.ndarray]] = {}
        # Per call of ours: its task here, and its server call and that server's address once sent.
        self.tasks: dict[str, asyncio.Task[SegmentAnswer]] = {}
        self.sent: dict[str, tuple[ray.ObjectRef, str]] = {}
        self.transit_delay_s = float(os.environ.get(TRANSIT_DELAY_ENV, "0") or 0)
        if self.transit_delay_s:
            logger.warning("%s=%s: calls are held in this worker before they are sent", TRANSIT_DELAY_ENV,
                           self.transit_delay_s)  # fmt: skip
        self.transit_rng = random.Random(0)
        self.builder: PromptBuilder | None = None
        self.tool_loop: PartialToolAgentLoop | None = None
        # Calls running tool calls: never cancelled (a tool that already ran would run again on resume).
        self.running_tools: set[str] = set()
        self.rows_ahead: dict[SampleKey, RowAhead] = {}

    def set_servers(self, servers: dict[str, Any]) -> None:
        """Server address -> server actor handle, from verl's replicas (the router's choices are addresses)."""
        self.servers = dict(servers)

    def sampling_params(self) -> dict[str, Any]:
        """verl's own sampling parameters for training rollouts (AgentLoopWorker.generate_sequences)."""
        config = self.rollout_config
        return dict(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            repetition_penalty=1.0,
            logprobs=config.calculate_log_probs,
            # verl's vLLM server adds this itself (setdefault, the same value); its SGLang server never does, so
            # without it ``rollout.ignore_eos`` would reach vLLM but not SGLang.
            ignore_eos=config.ignore_eos,
        )

    # ---------------------------------------------------------------- segments
    async def run_segments(self, calls: list[SegmentCall], forget: list[str]) -> AsyncIterator[SegmentAnswer]:
        """Run one wave's calls concurrently; yield each answer as it ends (call with ``num_returns="streaming"``).

        ``forget``: groups whose prompt ids the driver now holds (their cached tokenisation is dropped).
        """
        for key in forget:
            self.prompts.pop(key, None)
        sampling = self.sampling_params()
        tasks = []
        for call in calls:  # registered before any of them runs, so a cancel can never miss a call of this wave
            task = asyncio.ensure_future(self._segment(call, sampling))
            self.tasks[call.request_id] = task
            tasks.append(task)
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            # The driver stopped listening (cancelled or failed): nothing of this wave may keep generating.
            self._cancel([call.request_id for call, task in zip(calls, tasks, strict=True) if not task.done()])

    async def take_back_segments(self, request_ids: list[str]) -> None:
        """Abort these calls at their servers by request id: each call its engine holds then answers ABORTED with its
        tokens through its stream; a call not sent yet never will be (it answers ABORTED, empty). A call its server
        does not hold yet (in transit) is not affected; the driver escalates to :meth:`cancel_segments`."""
        by_server: dict[str, list[str]] = {}
        for request_id in self._not_running_tools(request_ids):
            sent = self.sent.get(request_id)
            if sent is not None:
                by_server.setdefault(sent[1], []).append(request_id)
            elif request_id in self.tasks:
                self.tasks[request_id].cancel()
        servers = list(by_server)
        outcomes = await asyncio.gather(
            *[self.engine.take_back(self.servers[server], by_server[server]) for server in servers],
            return_exceptions=True,  # every server gets its take-back even when another one fails
        )
        failed = [f"{server}: {type(error).__name__}: {error}" for server, error in zip(servers, outcomes, strict=True)
                  if isinstance(error, BaseException)]  # fmt: skip
        if failed:
            # Never swallowed: a take-back that failed is a broken server or an unsupported engine, not an answer.
            logger.error("take-back failed on %d server(s): %s", len(failed), "; ".join(failed))
            raise RuntimeError("take-back failed on: " + "; ".join(failed))

    async def cancel_segments(self, request_ids: list[str]) -> None:
        """Drop these calls (last resort): each then answers ABORTED through its stream, with no tokens -- real
        engines return nothing to a cancelled call."""
        self._cancel(request_ids)

    def _not_running_tools(self, request_ids: list[str]) -> list[str]:
        """Calls running tool calls are never interrupted: a tool that already ran would run again on resume."""
        return [request_id for request_id in request_ids if request_id not in self.running_tools]

    def _cancel(self, request_ids: list[str]) -> None:
        for request_id in self._not_running_tools(request_ids):
            sent = self.sent.get(request_id)
            if sent is not None:
                # Cancels the server's generate coroutine (vLLM's AsyncLLM aborts the request; SGLang does through
                # verl_partial.glue.engines.sglang).
                ray.cancel(sent[0])
            elif request_id in self.tasks:
                self.tasks[request_id].cancel()  # not sent yet: it never will be

    async def _segment(self, call: SegmentCall, sampling: dict[str, Any]) -> SegmentAnswer:
        try:
            return await self._generate(call, sampling)
        except (asyncio.CancelledError, ray.exceptions.TaskCancelledError):
            return _empty_answer(call)
        except Exception as error:  # answered as this call's failure; the wave's other calls go on
            return _empty_answer(call, error=f"{type(error).__name__}: {error}")
        finally:
            self.tasks.pop(call.request_id, None)
            self.sent.pop(call.request_id, None)

    async def _generate(self, call: SegmentCall, sampling: dict[str, Any]) -> SegmentAnswer:
        if call.row is not None:
            return await self._tool_segment(call, sampling)
        prompt_ids = call.prompt_ids
        if prompt_ids is None:
            prompt_ids = await self._prompt_ids(call)
        if self.transit_delay_s:
            await asyncio.sleep(self.transit_rng.uniform(0, self.transit_delay_s))
        server = self.servers.get(call.server)
        if server is None:
            raise KeyError(f"no server at {call.server!r}; known: {sorted(self.servers)}")
        ids = np.concatenate([prompt_ids, call.prefix]).tolist()
        ref = server.generate.remote(
            prompt_ids=ids,
            sampling_params={**sampling, "max_tokens": call.max_new_tokens},
            request_id=call.request_id,
        )
        self.sent[call.request_id] = (ref, call.server)
        output = await ref
        raw_ids = list(output.token_ids[: call.max_new_tokens])  # the server's own shape, as the mappers expect
        if output.log_probs is None or len(output.log_probs) < len(raw_ids):
            if len(raw_ids):
                raise RuntimeError("partial rollout needs per-token log-probs from the rollout server")
        eos_ids = self.eos_from_model | eos_id_set(sampling.get("stop_token_ids"))
        end = self.engine.finish(output.stop_reason, raw_ids, call.max_new_tokens, eos_ids)
        # Only the answer is parked and trained: a speculative run may carry tokens after its first EOS.
        new_ids = np.asarray(end.cut(raw_ids), dtype=TOKEN_DTYPE)
        new_log_probs = np.asarray(end.cut(list(output.log_probs or [])), dtype=LOG_PROB_DTYPE)
        return SegmentAnswer(
            call.request_id,
            new_ids,
            new_log_probs,
            end.finish,
            output.extra_fields.get("global_steps"),
            prompt_ids=prompt_ids if call.prompt_ids is None else None,
        )

    async def _tool_segment(self, call: SegmentCall, sampling: dict[str, Any]) -> SegmentAnswer:
        """One segment of verl's tool agent loop, its generate call sent like any other (cancellable at its
        server); a segment that runs tools is shielded from cancellation."""
        if self.tool_loop is None:
            self.tool_loop = make_partial_tool_loop(self)

        async def send(prompt_ids: list[int], params: dict[str, Any]) -> Any:
            if self.transit_delay_s:
                await asyncio.sleep(self.transit_rng.uniform(0, self.transit_delay_s))
            server = self.servers.get(call.server)
            if server is None:
                raise KeyError(f"no server at {call.server!r}; known: {sorted(self.servers)}")
            ref = server.generate.remote(prompt_ids=prompt_ids, sampling_params=params, request_id=call.request_id)
            self.sent[call.request_id] = (ref, call.server)
            return await ref

        if runs_tools(call.payload):
            self.running_tools.add(call.request_id)
        try:
            outcome = await run_tool_segment(
                self.tool_loop,
                payload=call.payload,
                row=call.row or {},
                request_id=call.request_id,
                max_new_tokens=call.max_new_tokens,
                eos_ids=self.eos_from_model,
                sampling_params=sampling,
                send=send,
            )
        finally:
            self.running_tools.discard(call.request_id)
        return SegmentAnswer(
            call.request_id,
            outcome.new_ids,
            outcome.new_log_probs,
            outcome.finish,
            outcome.server_version,
            prompt_ids=outcome.prompt_ids,
            payload=outcome.payload,
        )

    async def _prompt_ids(self, call: SegmentCall) -> np.ndarray:
        """The group's prompt ids, tokenised once per group on this worker (concurrent calls share it)."""
        cached = self.prompts.get(call.group_key)
        if cached is None:
            if call.raw_prompt is None:
                raise RuntimeError(f"group {call.group_key}: neither prompt ids nor its prompt reached this worker")
            cached = asyncio.ensure_future(self._tokenise(call.raw_prompt))
            self.prompts[call.group_key] = cached
        return await asyncio.shield(cached)

    async def _tokenise(self, raw_prompt: Any) -> np.ndarray:
        if self.builder is None:
            self.builder = PromptBuilder(**agent_loop_kwargs(self))
        messages = list(raw_prompt)
        if await self.builder.process_multi_modal_info(messages):
            raise ValueError("partial rollout supports text prompts only; this prompt carries images/videos/audio")
        return np.asarray(await self.builder.ct_build_initial_tokens(messages), dtype=TOKEN_DTYPE)

    # ---------------------------------------------------------------- hand-over
    async def hand_over(
        self,
        rows: DataProto,
        samples: list[FinishedSample],
        keys: list[SampleKey],
        keep: Collection[str],
    ) -> DataProto:
        """verl's rows for finished samples: ``_agent_loop_postprocess`` per sample (padding, position ids, reward)
        and ``_postprocess`` for the chunk, exactly as ``generate_sequences`` does for its own outputs.

        A row built ahead (:meth:`score`) for the same answer is reused; any other is built now. Rows built ahead
        for groups neither handed over now nor in ``keep`` (the groups still in the driver's pool) are dropped:
        their groups were filtered out or restarted."""
        fields, per_row = row_fields(rows, len(samples))
        outputs = await asyncio.gather(
            *[self._row(sample, kwargs, key) for sample, kwargs, key in zip(samples, per_row, keys, strict=True)]
        )
        self._drop_rows_ahead(set(keep))
        return self._postprocess(list(outputs), input_non_tensor_batch=fields, validate=False)

    async def _row(self, sample: FinishedSample, kwargs: dict[str, Any], key: SampleKey) -> Any:
        ahead = self.rows_ahead.pop(key, None)
        if ahead is not None and ahead.sample.same_as(sample):
            row = await ahead.row
            # The one keyword argument a scored row reads besides the reward's (verl 0.9.1 _agent_loop_postprocess).
            row.extra_fields["raw_prompt"] = kwargs["raw_prompt"]
            return row
        if ahead is not None:
            ahead.row.cancel()
        return await self._agent_loop_postprocess(self._finished_output(sample), False, **kwargs)

    def _drop_rows_ahead(self, keep: set[str]) -> None:
        for key in [key for key in self.rows_ahead if key[0] not in keep]:
            self.rows_ahead.pop(key).row.cancel()

    def _build_rows_ahead(
        self, rows: list[dict[str, Any]], samples: list[FinishedSample], keys: list[SampleKey]
    ) -> None:
        """Start building the rows of scored samples in the background, as verl's own loop builds each answer's row
        as it ends; the hand-over, while every engine idles, then only gathers them.

        Exact because a scored row reads nothing else of its keyword arguments but ``raw_prompt``, which the
        hand-over sets from the trainer's row: ``_compute_score`` leaves a scored output alone, and the other reader,
        the distillation teacher's routing key, is left to the hand-over (no row is built ahead with a teacher).
        Multi-turn trajectories are built at the hand-over too."""
        if self.distillation_enabled:
            return
        for row, sample, key in zip(rows, samples, keys, strict=True):
            if sample.payload is not None:
                continue
            previous = self.rows_ahead.pop(key, None)
            if previous is not None:
                previous.row.cancel()
            built = asyncio.ensure_future(self._agent_loop_postprocess(self._finished_output(sample), False, **row))
            self.rows_ahead[key] = RowAhead(sample, built)

    async def score(
        self, rows: list[dict[str, Any]], samples: list[FinishedSample], keys: list[SampleKey]
    ) -> list[SampleScore]:
        """Finished samples' rewards, computed as ``_agent_loop_postprocess`` does (verl's ``_compute_score`` through
        the reward loop workers, with the row's fields as its keyword arguments); their rows are then built in the
        background (:meth:`_build_rows_ahead`) for the hand-over."""
        if self.reward_loop_worker_handles is None:
            raise RuntimeError(
                "algorithm.filter_groups needs verl's reward loop during generation (rule-based reward or "
                "reward.reward_model.enable_resource_pool=true); this worker has no reward loop workers"
            )

        async def one(row: dict[str, Any], sample: FinishedSample) -> SampleScore:
            output = self._finished_output(sample)
            output.extra_fields["raw_prompt"] = row.get("raw_prompt")
            await self._compute_score([output], kwargs=row)
            if output.reward_score is None:
                raise RuntimeError("verl's reward loop returned no reward_score")
            return SampleScore(float(output.reward_score), dict(output.extra_fields.get("reward_extra_info", {})))

        scores = list(await asyncio.gather(*[one(row, sample) for row, sample in zip(rows, samples, strict=True)]))
        scored = [dataclasses.replace(sample, score=score) for sample, score in zip(samples, scores, strict=True)]
        self._build_rows_ahead(rows, scored, keys)
        return scores

    def _finished_output(self, sample: FinishedSample) -> AgentLoopOutput:
        output = self._unscored_output(sample)
        if sample.score is not None:  # ``_compute_score`` leaves an output with a reward_score alone
            output.reward_score = sample.score.reward
            output.extra_fields["reward_extra_info"] = dict(sample.score.extra)
        return output

    def _unscored_output(self, sample: FinishedSample) -> AgentLoopOutput:
        if sample.payload is not None:  # multi-turn: what verl's ToolAgentLoop.run returns for this trajectory
            if self.tool_loop is None:
                self.tool_loop = make_partial_tool_loop(self)
            fields = self.tool_loop.output_fields(Trajectory.from_state_dict(sample.payload))
            return AgentLoopOutput(**fields, metrics=AgentLoopMetrics())
        return AgentLoopOutput(
            prompt_ids=sample.prompt_ids.tolist(),
            response_ids=sample.token_ids.tolist(),
            response_mask=[1] * len(sample.token_ids),
            response_logprobs=sample.log_probs.tolist(),
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={"turn_scores": [], "tool_rewards": []},
        )
