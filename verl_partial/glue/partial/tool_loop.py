"""verl's ``ToolAgentLoop``, driven one segment at a time from a parked ``core.trajectory.Trajectory``.

Why a subclass: users select verl's tool loop (``agent.default_agent_loop=tool_agent``, their tool config, their
``multi_turn.format``), and partial rollout must run *that* loop -- its tokenisation (continuous-token builder), its
tool parser, its tool calls and its termination rules -- only stopping and resuming it at segment boundaries. verl's
``run()`` keeps the whole trajectory in one coroutine; this class keeps it in a ``Trajectory`` between calls and
reuses verl's own handlers for everything but the generate call:

* :meth:`start` tokenises the prompt with verl's ``_handle_pending_state``;
* a **model segment** sends ``prompt + response so far`` with ``max_tokens`` = the grant, appends the new tokens
  (mask 1, log-probs, policy version) through verl's ``ct_merge_assistant_token``, and -- once the turn has ended --
  parses the *whole turn* (every segment of it) with verl's tool parser and applies verl's termination order;
* a **tool segment** runs the pending calls through verl's ``_handle_processing_tools_state`` (tool execution,
  tool messages, ``ct_merge_context_msg``), then records the appended tokens (mask 0) and clears the calls, so
  they can never run again.

A model segment never runs tools: the state it returns (tokens, pending calls) is complete the moment the server
answers, so an abort at a step end loses nothing and re-runs nothing. A tool segment makes no model tokens and must
not be cancelled half-way (the glue lets it finish; tools are expected to be fast or to time out themselves).
Validation keeps verl's own ``run()``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall
from verl.workers.rollout.replica import TokenOutput

from verl_partial.core.engines.adapter import finish_mapper
from verl_partial.core.partial.finish import Finish, eos_id_set
from verl_partial.core.partial.trajectory import TOKEN_DTYPE, Phase, Trajectory

GenerateFn = Callable[[list[int], dict[str, Any]], Awaitable[TokenOutput]]
# Keys of Trajectory.extra this loop owns.
_EXTRA_FIELDS, _TOOL_REWARDS, _TURN_SCORES, _TOOL_SELECTION = "extra_fields", "tool_rewards", "turn_scores", "tools"


@dataclass(frozen=True)
class SegmentReport:
    """What one segment did (the trajectory itself is updated in place)."""

    phase: Phase
    model_tokens: int  # new model tokens (count against step_token_budget)
    new_tokens: int  # new response tokens of any kind, minus tokens a context merge trimmed
    tool_calls: int  # tool calls executed by this segment
    finish: Finish | None  # how the generate call ended (model segments)
    server_version: int | None = None  # the answering server's global_steps (model segments)

    @property
    def pool_finish(self) -> Finish:
        """The finish to report to the rollout pool, which keeps the model's tokens only: EOS once the trajectory
        is done, otherwise an unfinished sample (ABORTED when the call was aborted, else LENGTH)."""
        if self.phase is Phase.DONE:
            return Finish.EOS
        return Finish.ABORTED if self.finish is Finish.ABORTED else Finish.LENGTH


class PartialToolAgentLoop(ToolAgentLoop):
    """verl's tool agent loop as a resumable state machine; constructed exactly like ``ToolAgentLoop``."""

    # ---------------------------------------------------------------- start
    async def start(self, **kwargs: Any) -> Trajectory:
        """A fresh trajectory for one dataset row (the kwargs verl passes to ``run``)."""
        messages = list(kwargs["raw_prompt"])
        if await self.process_multi_modal_info(messages):
            raise ValueError("partial rollout of the tool agent loop is text-only; this prompt carries media")
        traj = Trajectory(prompt_ids=[], messages=messages)
        selection = (kwargs.get("extra_info") or {}).get("tool_selection")
        traj.extra[_TOOL_SELECTION] = list(selection) if selection else None
        agent_data = self._agent_data(traj, kwargs, request_id="")
        await self._handle_pending_state(agent_data, {})
        traj.prompt_ids = np.asarray(agent_data.prompt_ids, dtype=TOKEN_DTYPE)
        return traj

    # ---------------------------------------------------------------- segments
    async def segment(
        self,
        traj: Trajectory,
        sampling_params: dict[str, Any],
        *,
        request_id: str,
        max_new_tokens: int,
        eos_ids: Collection[int],
        version: int | None = None,
        generate: GenerateFn | None = None,
        **kwargs: Any,
    ) -> SegmentReport:
        """Advance ``traj`` by one segment: run its pending tool calls, or generate up to ``max_new_tokens``
        tokens of its current model turn with the policy of ``version`` (``None``: the version the answering
        server reports, its ``global_steps``).

        ``eos_ids``: the tokenizer's and generation config's EOS ids
        (:func:`~verl_partial.core.partial.finish.eos_id_set`),
        which tell a turn that ended from one that used its grant. ``generate(prompt_ids, sampling_params)``
        defaults to verl's server manager with ``request_id``; ``kwargs`` are the row's (``tools_kwargs``...).
        """
        if traj.phase is Phase.DONE:
            raise RuntimeError("segment() on a finished trajectory")
        agent_data = self._agent_data(traj, kwargs, request_id)
        if traj.phase is Phase.TOOL_CALLS:
            return await self._tool_segment(traj, agent_data)
        # The grant may count model tokens only (the pool's view); the whole response is bounded here, as in verl.
        max_new_tokens = min(max_new_tokens, self.response_length - len(traj.response_ids))
        if max_new_tokens < 1:
            raise ValueError(f"a model segment needs max_new_tokens >= 1, got {max_new_tokens}")
        return await self._model_segment(traj, agent_data, sampling_params, max_new_tokens, version, eos_ids, generate)

    async def _model_segment(
        self,
        traj: Trajectory,
        agent_data: AgentData,
        sampling_params: dict[str, Any],
        max_new_tokens: int,
        version: int | None,
        eos_ids: Collection[int],
        generate: GenerateFn | None,
    ) -> SegmentReport:
        params = {**sampling_params, "max_tokens": max_new_tokens, "logprobs": True}
        stop_ids = list(self.tool_parser.stop_token_ids)
        if stop_ids:  # as verl injects them: generation halts after each tool call
            params["stop_token_ids"] = sorted(set((sampling_params.get("stop_token_ids") or []) + stop_ids))
        if generate is None:
            output = await self.server_manager.generate(
                request_id=agent_data.request_id, prompt_ids=agent_data.prompt_ids, sampling_params=params
            )
        else:
            output = await generate(agent_data.prompt_ids, params)
        new_ids = [int(token) for token in output.token_ids[:max_new_tokens]]
        if output.log_probs is None or len(output.log_probs) < len(new_ids):
            raise RuntimeError("partial rollout needs per-token log-probs from the rollout server")
        log_probs = [float(value) for value in output.log_probs[: len(new_ids)]]
        stops = eos_id_set(eos_ids, params.get("stop_token_ids"))
        finish = finish_mapper(self.rollout_config.name)(output.stop_reason, new_ids, max_new_tokens, stops)
        # As verl: the first call's extra fields are kept, later calls only raise max_global_steps.
        extra_fields = traj.extra.setdefault(_EXTRA_FIELDS, {})
        if not extra_fields:
            extra_fields.update(output.extra_fields)
        elif output.extra_fields.get("max_global_steps"):
            extra_fields["max_global_steps"] = output.extra_fields["max_global_steps"]

        # verl's own merge of assistant tokens; partial rollout needs it to be a plain append.
        merge, _, _ = await self.ct_merge_assistant_token(agent_data.prompt_ids, new_ids, [], [], log_probs)
        if merge.inserted_token_ids or merge.removed_prefix_token_count:
            raise NotImplementedError(
                f"{type(self.continuous_token_builder).__name__} edits tokens when merging assistant output; "
                "partial rollout of the tool agent loop supports builders that append them unchanged"
            )
        if version is None:
            version = output.extra_fields.get("global_steps")
            if version is None:
                raise RuntimeError("the rollout server did not report its global_steps (the policy version)")
        traj.add_model_tokens(new_ids, log_probs, int(version), self.response_length)
        if finish in (Finish.EOS, Finish.STOP) or len(traj.response_ids) >= self.response_length:
            await self._end_turn(traj, agent_data)
        return SegmentReport(traj.phase, len(new_ids), len(new_ids), 0, finish, output.extra_fields.get("global_steps"))

    async def _end_turn(self, traj: Trajectory, agent_data: AgentData) -> None:
        """verl's end-of-generation logic, on the whole turn: termination checks, tool-call parsing, message."""
        calls: list[FunctionCall] = []
        if len(traj.response_ids) < self.response_length and not self._turn_limit_reached(
            traj.assistant_turns + 1, traj.user_turns
        ):
            tools = [tool.tool_schema for tool in agent_data._active_tools.values()]
            content, calls = await self.tool_parser.extract_tool_calls(traj.turn_ids().tolist(), tools)
            agent_data.tool_calls = calls
            traj.messages.append(self._build_assistant_message(content, agent_data))
        traj.end_model_turn(
            [call.model_dump() for call in calls],
            self.response_length,
            self.max_assistant_turns,
            self.max_user_turns,
        )

    def _turn_limit_reached(self, assistant_turns: int, user_turns: int) -> bool:
        return bool(
            (self.max_assistant_turns and assistant_turns >= self.max_assistant_turns)
            or (self.max_user_turns and user_turns >= self.max_user_turns)
        )

    async def _tool_segment(self, traj: Trajectory, agent_data: AgentData) -> SegmentReport:
        before = list(agent_data.prompt_ids)
        calls = len(traj.pending_calls[: self.max_parallel_calls])
        state = await self._handle_processing_tools_state(agent_data)
        traj.extra[_TOOL_REWARDS] = list(agent_data.tool_rewards)
        if state is AgentState.TERMINATED:
            # verl ends the trajectory when the tool output would fill the response, without appending it.
            traj.drop_tool_output()
            return SegmentReport(traj.phase, 0, 0, calls, None)
        after = agent_data.prompt_ids
        common = 0
        for old, new in zip(before, after, strict=False):
            if old != new:
                break
            common += 1
        removed = len(before) - common
        traj.messages = list(agent_data.messages)
        traj.add_tool_output(after[common:], self.response_length, removed_tokens=removed)
        if traj.response_mask.tolist() != agent_data.response_mask or traj.context_ids().tolist() != after:
            raise RuntimeError("the parked trajectory diverged from verl's tool-loop state after a tool turn")
        return SegmentReport(traj.phase, 0, len(after) - len(before), calls, None)

    # ---------------------------------------------------------------- output
    def output_fields(self, traj: Trajectory) -> dict[str, Any]:
        """The fields verl's ``ToolAgentLoop.run`` puts in its ``AgentLoopOutput`` for a finished trajectory."""
        response_length = self.response_length
        return {
            "prompt_ids": traj.prompt_ids.tolist(),
            "response_ids": traj.response_ids[:response_length].tolist(),
            "response_mask": traj.response_mask[:response_length].astype(int).tolist(),
            "response_logprobs": traj.log_probs[:response_length].tolist(),
            "num_turns": traj.num_turns,
            "extra_fields": {
                **traj.extra.get(_EXTRA_FIELDS, {}),
                "turn_scores": list(traj.extra.get(_TURN_SCORES) or []),
                "tool_rewards": list(traj.extra.get(_TOOL_REWARDS) or []),
            },
        }

    # ---------------------------------------------------------------- internals
    def _agent_data(self, traj: Trajectory, kwargs: dict[str, Any], request_id: str) -> AgentData:
        """verl's per-trajectory state, rebuilt from the parked trajectory (lists, as verl's handlers expect)."""
        agent_data = AgentData(
            messages=traj.messages,
            image_data=None,
            video_data=None,
            audio_data=None,
            mm_processor_kwargs=None,
            metrics={},
            request_id=request_id,
            tools_kwargs=kwargs.get("tools_kwargs", {}) or {},
        )
        agent_data.prompt_ids = traj.context_ids().tolist()
        agent_data.response_mask = traj.response_mask.astype(int).tolist()
        agent_data.response_logprobs = traj.log_probs.tolist()
        agent_data.user_turns = traj.user_turns
        agent_data.assistant_turns = traj.assistant_turns
        agent_data.tool_calls = [FunctionCall(**call) for call in traj.pending_calls]
        agent_data.tool_rewards = list(traj.extra.get(_TOOL_REWARDS) or [])
        agent_data.turn_scores = list(traj.extra.get(_TURN_SCORES) or [])
        agent_data.extra_fields = dict(traj.extra.get(_EXTRA_FIELDS, {}))
        # verl's per-sample tool selection (``extra_info.tool_selection``), fixed at start.
        selection = traj.extra.get(_TOOL_SELECTION)
        if selection and self.tools:
            agent_data._active_tools = {name: self.tools[name] for name in selection if name in self.tools}
        else:
            agent_data._active_tools = self.tools
        agent_data._active_tool_schemas = [
            tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
            for tool in agent_data._active_tools.values()
        ]
        return agent_data


# ---------------------------------------------------------------------------------------------- worker side
# Dataset-row fields the tool loop reads (``start`` the prompt and tool selection, tool segments ``tools_kwargs``).
ROW_KEYS = ("raw_prompt", "extra_info", "tools_kwargs")


def agent_loop_kwargs(worker: Any) -> dict[str, Any]:
    """The arguments verl's ``_run_agent_loop`` gives its loops, from an AgentLoopWorker's state."""
    return dict(
        trainer_config=DictConfigWrap(config=worker.config),
        server_manager=worker.llm_client,
        tokenizer=worker.tokenizer,
        processor=worker.processor,
        dataset_cls=worker.dataset_cls,
        data_config=DictConfigWrap(worker.config.data),
        hf_model_type=worker.hf_model_type,
    )


def make_partial_tool_loop(worker: Any) -> PartialToolAgentLoop:
    return PartialToolAgentLoop(**agent_loop_kwargs(worker), tools=ToolListWrap(worker.tools))


def runs_tools(payload: dict[str, Any] | None) -> bool:
    """Whether the next segment of this parked trajectory runs tool calls (such a segment must not be cancelled:
    a tool that already ran would run again on resume)."""
    return payload is not None and payload["phase"] == Phase.TOOL_CALLS.value


@dataclass(frozen=True)
class ToolSegmentOutcome:
    """One tool-loop segment as the rollout pool sees it: the model's new tokens, the pool's finish, and the
    trajectory to park (``payload``)."""

    new_ids: np.ndarray  # int32, model tokens only
    new_log_probs: np.ndarray  # float32
    finish: Finish
    server_version: int | None
    prompt_ids: np.ndarray | None  # on a trajectory's first segment
    payload: dict[str, Any]


async def run_tool_segment(
    loop: PartialToolAgentLoop,
    *,
    payload: dict[str, Any] | None,
    row: dict[str, Any],
    request_id: str,
    max_new_tokens: int,
    eos_ids: Collection[int],
    sampling_params: dict[str, Any],
    send: GenerateFn,
) -> ToolSegmentOutcome:
    """Resume (or start, when ``payload`` is None) a trajectory and run one segment of it through ``send``."""
    traj = await loop.start(**row) if payload is None else Trajectory.from_state_dict(payload)
    before = len(traj.response_ids)
    report = await loop.segment(
        traj,
        sampling_params,
        request_id=request_id,
        max_new_tokens=max_new_tokens,
        eos_ids=eos_ids,
        generate=send,
        **row,
    )
    produced = slice(before, before + report.model_tokens)
    return ToolSegmentOutcome(
        new_ids=traj.response_ids[produced].copy(),
        new_log_probs=traj.log_probs[produced].copy(),
        finish=report.pool_finish,
        server_version=report.server_version,
        prompt_ids=traj.prompt_ids if payload is None else None,
        payload=traj.state_dict(),
    )
