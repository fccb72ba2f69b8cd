"""The parked state of a multi-turn (tool-calling) trajectory: everything needed to resume it exactly.

verl 0.9.1's ``ToolAgentLoop`` (``verl/experimental/agent_loop/tool_agent_loop.py``) is a state machine: it
generates a model turn, parses tool calls from the turn's tokens, runs the tools, appends their output as context
tokens (response mask 0) and generates again, until a turn has no call, a turn limit is hit or the response is
full. Partial rollout may stop such a trajectory at a step end in two places:

* **mid model turn**: the generate call was aborted or used its token grant; the turn's tokens so far are kept and
  the next segment continues the same turn from them (the tool parser later reads the whole turn);
* **between turns, tool calls pending**: the turn ended with tool calls that have not run yet; they run once, on
  resume. Once a tool's output is appended, the calls are cleared, so a resumed trajectory never runs a call twice.

This module is that state and its transitions, without verl or Ray. Every response token carries its id, its
mask (1 model, 0 tool output or template boundary), the behaviour log-prob (0 on mask 0) and the policy version
that generated it (-1 on mask 0: no policy generated it), in compact numpy arrays. The turn counters follow verl's
(``num_turns = user_turns + assistant_turns + 1``). Budgets: the rollout pool keeps the model's tokens of a
multi-turn sample next to this state (``SampleState.payload``), so ``step_token_budget`` counts model tokens only;
the whole response, tool output included, is bounded by ``response_length`` as verl bounds it: a model turn may
not run past it, and a tool output that would reach it ends the trajectory without being appended (verl's
``_handle_processing_tools_state``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

TOKEN_DTYPE = np.int32
MASK_DTYPE = np.int8
LOG_PROB_DTYPE = np.float32
VERSION_DTYPE = np.int32
# Version of tokens no policy generated (tool output, template boundary tokens).
NO_VERSION = -1


class Phase(str, Enum):
    """Where the loop stands; what the next segment does."""

    MODEL_TURN = "model_turn"  # generate: start a new turn, or continue the current one (``mid_turn``)
    TOOL_CALLS = "tool_calls"  # the last turn ended with ``pending_calls``; run them and append their output
    DONE = "done"


def _empty(dtype: type[np.generic]) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class Trajectory:
    """One tool-loop trajectory, resumable from any segment boundary.

    ``pending_calls`` are the parsed calls of the last turn (JSON-able dicts, e.g. verl's ``FunctionCall`` dumped),
    ``messages`` the chat history the loop's template needs for the next tool turn, ``extra`` whatever else the
    loop carries from turn to turn (verl's ``AgentData.extra_fields``, tool rewards); both must be picklable.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray = field(default_factory=lambda: _empty(TOKEN_DTYPE))
    response_mask: np.ndarray = field(default_factory=lambda: _empty(MASK_DTYPE))
    log_probs: np.ndarray = field(default_factory=lambda: _empty(LOG_PROB_DTYPE))
    versions: np.ndarray = field(default_factory=lambda: _empty(VERSION_DTYPE))
    phase: Phase = Phase.MODEL_TURN
    # Response index where the current (or last) model turn began.
    turn_start: int = 0
    assistant_turns: int = 0
    user_turns: int = 0
    pending_calls: list[dict[str, Any]] = field(default_factory=list)
    # Tool calls executed so far (their output is in the response); never decreases, never re-counted.
    tool_calls_made: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=TOKEN_DTYPE)
        self.response_ids = np.asarray(self.response_ids, dtype=TOKEN_DTYPE)
        self.response_mask = np.asarray(self.response_mask, dtype=MASK_DTYPE)
        self.log_probs = np.asarray(self.log_probs, dtype=LOG_PROB_DTYPE)
        self.versions = np.asarray(self.versions, dtype=VERSION_DTYPE)
        self.phase = Phase(self.phase)
        lengths = {len(a) for a in (self.response_ids, self.response_mask, self.log_probs, self.versions)}
        if len(lengths) != 1:
            raise ValueError(f"response arrays differ in length: {sorted(lengths)}")
        if not 0 <= self.turn_start <= len(self.response_ids):
            raise ValueError(f"turn_start {self.turn_start} outside the response (length {len(self.response_ids)})")

    # ------------------------------------------------------------------ views
    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def mid_turn(self) -> bool:
        """Parked inside a model turn: the next segment continues it rather than starting a new one."""
        return self.phase is Phase.MODEL_TURN and self.turn_start < len(self.response_ids)

    @property
    def model_tokens(self) -> int:
        return int(self.response_mask.sum(dtype=np.int64))

    @property
    def num_turns(self) -> int:
        """verl's ``AgentLoopOutput.num_turns`` for this trajectory."""
        return self.user_turns + self.assistant_turns + 1

    @property
    def nbytes(self) -> int:
        arrays = (self.prompt_ids, self.response_ids, self.response_mask, self.log_probs, self.versions)
        return sum(array.nbytes for array in arrays)

    def context_ids(self) -> np.ndarray:
        """What the next generate call continues from: prompt and every response token, as one id array."""
        return np.concatenate([self.prompt_ids, self.response_ids])

    def turn_ids(self) -> np.ndarray:
        """The current model turn's tokens from its first segment on: what the tool parser reads at its end."""
        return self.response_ids[self.turn_start :]

    # ------------------------------------------------------------------ transitions
    def add_model_tokens(self, ids: Any, log_probs: Any, version: int, response_length: int) -> None:
        """Append one segment of the current model turn (mask 1), each token tagged with ``version``."""
        self._require(Phase.MODEL_TURN, "add model tokens")
        ids = np.asarray(ids, dtype=TOKEN_DTYPE)
        log_probs = np.asarray(log_probs, dtype=LOG_PROB_DTYPE)
        if ids.ndim != 1 or ids.shape != log_probs.shape:
            raise ValueError(f"segment has {ids.shape} token ids but {log_probs.shape} log-probs")
        if version < 0:
            raise ValueError(f"a model token's policy version must be >= 0, got {version}")
        if len(self.response_ids) + len(ids) > response_length:
            raise ValueError(
                f"{len(ids)} new tokens overflow the response: {len(self.response_ids)} of {response_length} used"
            )
        self._append(ids, np.ones(len(ids), MASK_DTYPE), log_probs, np.full(len(ids), version, VERSION_DTYPE))

    def end_model_turn(
        self,
        calls: list[dict[str, Any]],
        response_length: int,
        max_assistant_turns: int | None = None,
        max_user_turns: int | None = None,
    ) -> Phase:
        """The current turn ended (the model stopped, or the response is full); ``calls`` are the tool calls parsed
        from :meth:`turn_ids`. Applies verl's termination order: full response, then turn limits, then calls."""
        self._require(Phase.MODEL_TURN, "end a model turn")
        self.assistant_turns += 1
        if (
            len(self.response_ids) >= response_length
            or (max_assistant_turns and self.assistant_turns >= max_assistant_turns)
            or (max_user_turns and self.user_turns >= max_user_turns)
            or not calls
        ):
            self.phase = Phase.DONE
        else:
            self.pending_calls = list(calls)
            self.phase = Phase.TOOL_CALLS
        return self.phase

    def add_tool_output(self, ids: Any, response_length: int, removed_tokens: int = 0) -> Phase:
        """Record that ``pending_calls`` ran: their output (and template boundary tokens) ``ids`` join the
        response with mask 0; a new model turn starts after them.

        ``removed_tokens`` trailing response tokens are dropped first (a continuous-token merge may trim a stale
        boundary; verl's ``align_response_metadata`` trims its mask and log-probs the same way). As in verl, an
        output that would fill the response ends the trajectory without being appended -- the calls still count
        as made. Either way the pending calls are cleared, so they can never run again.
        """
        self._require(Phase.TOOL_CALLS, "add tool output")
        ids = np.asarray(ids, dtype=TOKEN_DTYPE)
        if not 0 <= removed_tokens <= len(self.response_ids) - self.turn_start:
            raise ValueError(f"cannot remove {removed_tokens} tokens: only the last turn's may be trimmed")
        self.tool_calls_made += len(self.pending_calls)
        self.pending_calls = []
        kept = len(self.response_ids) - removed_tokens
        if kept + len(ids) >= response_length:
            self.phase = Phase.DONE
            return self.phase
        self._truncate(kept)
        count = len(ids)
        self._append(
            ids, np.zeros(count, MASK_DTYPE), np.zeros(count, LOG_PROB_DTYPE), np.full(count, NO_VERSION, VERSION_DTYPE)
        )
        self.user_turns += 1
        self.turn_start = len(self.response_ids)
        self.phase = Phase.MODEL_TURN
        return self.phase

    def drop_tool_output(self) -> None:
        """The pending calls ran but their output does not fit in the response: verl ends the trajectory without
        appending it. The calls count as made and are cleared."""
        self._require(Phase.TOOL_CALLS, "drop tool output")
        self.tool_calls_made += len(self.pending_calls)
        self.pending_calls = []
        self.phase = Phase.DONE

    def finish(self) -> None:
        """End the trajectory where it stands (e.g. the response is full in the middle of a turn)."""
        self.phase = Phase.DONE

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Plain containers and numpy arrays only (``torch.save``/pickle friendly); copies, not views."""
        return {
            "prompt_ids": self.prompt_ids.copy(),
            "response_ids": self.response_ids.copy(),
            "response_mask": self.response_mask.copy(),
            "log_probs": self.log_probs.copy(),
            "versions": self.versions.copy(),
            "phase": self.phase.value,
            "turn_start": self.turn_start,
            "assistant_turns": self.assistant_turns,
            "user_turns": self.user_turns,
            "pending_calls": [dict(call) for call in self.pending_calls],
            "tool_calls_made": self.tool_calls_made,
            "messages": [dict(message) for message in self.messages],
            "extra": dict(self.extra),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Trajectory:
        return cls(**state)

    # ------------------------------------------------------------------ internals
    def _require(self, phase: Phase, action: str) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"cannot {action} in phase {self.phase.value} (needs {phase.value})")

    def _append(self, ids: np.ndarray, mask: np.ndarray, log_probs: np.ndarray, versions: np.ndarray) -> None:
        self.response_ids = np.concatenate([self.response_ids, ids])
        self.response_mask = np.concatenate([self.response_mask, mask])
        self.log_probs = np.concatenate([self.log_probs, log_probs])
        self.versions = np.concatenate([self.versions, versions])

    def _truncate(self, length: int) -> None:
        self.response_ids = self.response_ids[:length]
        self.response_mask = self.response_mask[:length]
        self.log_probs = self.log_probs[:length]
        self.versions = self.versions[:length]
