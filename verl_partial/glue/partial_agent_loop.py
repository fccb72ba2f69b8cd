"""The agent loop that runs one segment of a partial rollout inside verl's AgentLoopWorker.

A segment continues a sample from its exact token ids (never from decoded text): the prompt is
tokenised once, on the first segment, and every later segment sends ``prompt_ids + tokens so far``
with ``max_tokens`` = the remaining budget the pool granted. The worker's own post-processing then
pads the full response and, for a finished sample only, computes its reward -- so the row verl
trains on is produced by verl's code, unchanged.

Multi-turn: a tool loop resumes the same way -- its parked state (prompt ids, response ids with
their mask, log-probs, versions) is already per token; it would add its turn state to the segment
dict and run tool calls between generate calls, as verl's ToolAgentLoop does.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
    register,
)
from verl.utils.profiler import simple_timer

PARTIAL_AGENT_NAME = "verl_partial_segment"
SEGMENT_KEY = "partial_segment"
# Extra fields the segment returns; the manager strips them from the training batch.
RESULT_FIELDS = ("partial_new_ids", "partial_new_log_probs", "partial_eos", "partial_prompt_ids", "partial_route")
# Servers that say who they are (our CPU server does) let the pool check sticky routing.
ROUTE_FIELD = "server_address"

# The training batch never needs a reward for a half-finished response; a placeholder score makes
# verl's worker skip the reward call for it. The row is discarded by the manager.
_UNFINISHED_REWARD_PLACEHOLDER = 0.0


def ends_with_eos(new_ids: list[int], max_tokens: int, stop_reason: str | None, eos_ids: set[int]) -> bool:
    """Did this segment end the response (EOS or a stop token), as opposed to hitting its budget or an abort?

    vLLM and our CPU engine both report EOS and max_tokens as "completed"; a segment shorter than
    its budget that completed must have stopped on its own.
    """
    if not new_ids:
        return False
    if new_ids[-1] in eos_ids:
        return True
    return stop_reason == "completed" and len(new_ids) < max_tokens


@register(PARTIAL_AGENT_NAME)
class PartialSegmentAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_length = self.rollout_config.response_length
        eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        segment: dict[str, Any] = kwargs[SEGMENT_KEY]
        prompt_ids: list[int] | None = segment["prompt_ids"]
        if prompt_ids is None:
            prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        prefix_ids: list[int] = list(segment["prefix_ids"])
        prefix_log_probs: list[float] = list(segment["prefix_log_probs"])
        max_tokens = int(segment["max_new_tokens"])
        metrics: dict[str, Any] = {}
        with simple_timer("generate_sequences", metrics):
            output = await self.server_manager.generate(
                request_id=segment["request_id"],
                prompt_ids=prompt_ids + prefix_ids,
                sampling_params={**sampling_params, "max_tokens": max_tokens, "logprobs": True},
            )
        new_ids = list(output.token_ids)[:max_tokens]
        if output.log_probs is None or len(output.log_probs) < len(new_ids):
            raise RuntimeError("partial rollout needs per-token log-probs from the rollout server")
        new_log_probs = [float(value) for value in output.log_probs[: len(new_ids)]]
        eos = ends_with_eos(new_ids, max_tokens, output.stop_reason, self.eos_ids)
        response_ids = prefix_ids + new_ids
        finished = eos or len(response_ids) >= self.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=[1] * len(response_ids),
            response_logprobs=prefix_log_probs + new_log_probs,
            reward_score=None if finished else _UNFINISHED_REWARD_PLACEHOLDER,
            num_turns=2,
            metrics=AgentLoopMetrics(generate_sequences=metrics.get("generate_sequences", 0.0)),
            extra_fields={
                "partial_new_ids": new_ids,
                "partial_new_log_probs": new_log_probs,
                "partial_eos": eos,
                "partial_prompt_ids": prompt_ids,
                "partial_route": output.extra_fields.get(ROUTE_FIELD),
                "turn_scores": [],
                "tool_rewards": [],
            },
        )


class PartialAgentLoopWorker(AgentLoopWorker):
    """verl's AgentLoopWorker; defined here so that unpickling it in the worker registers our agent loop."""
