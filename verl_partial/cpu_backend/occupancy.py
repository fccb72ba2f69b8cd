"""Slot occupancy of a rollout phase, from our CPU engine's counters (``CpuRolloutServer.engine_stats``).

Slot occupancy = tokens trained / the slot-steps the phase's wall time could hold at a full batch, i.e.
``max_num_seqs`` x (phase wall time / the time of one full-batch step), summed over the servers. Every trained token
was decoded exactly once (a resumed sample re-prefills its prefix, it does not decode it again), so summed over a run
the per-step figure is the run's "tokens decoded and later trained over what the engine could have decoded". Beside
it: the slot-steps that decoded anything (trained, still parked, or thrown away), those left idle, the tokens thrown
away, and the prefill tokens (fresh prompts and re-prefilled prefixes alike).

The full-batch step time: under ``backend.emulate_gpu``, the modelled time of ``max_num_seqs`` decodes at the phase's
mean context per decode row (exact for the emulated engine); on the plain CPU engine, the phase's mean measured step
time, which is below a full step's (a CPU step grows with the batch), so the CPU figure understates occupancy.

Reading the counters costs one Ray call per server at each end of the phase; the counters are always kept (a few
additions per engine step). On a GPU server the same needs vLLM's stats on (``disable_log_stats=False``) and a server
method reading its per-step counters: the same two calls per server per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_partial.config.backend import EmulatedGpu


@dataclass(frozen=True)
class PhaseSlots:
    """What the servers' engines did during one phase; ``capacity`` is in slot-steps at a full batch."""

    capacity: float
    decode_rows: int
    prefill_tokens: int
    steps: int
    overruns: int

    def metrics(self, trained_tokens: float, discarded_tokens: float, prefix: str = "partial/") -> dict[str, float]:
        """The figures beside each other. A phase whose engines ran no step (every group it trained had finished
        earlier) has no capacity and no ratios, but still reports its capacity, 0: a run's occupancy is the sum of
        ``tokens_trained`` over the sum of ``slot/capacity``, every step counted."""
        metrics = {
            f"{prefix}slot/capacity": self.capacity,
            f"{prefix}engine/prefill_tokens": float(self.prefill_tokens),
            f"{prefix}engine/steps": float(self.steps),
            f"{prefix}engine/overruns": float(self.overruns),
        }
        if self.capacity > 0:
            metrics[f"{prefix}slot_occupancy"] = trained_tokens / self.capacity
            metrics[f"{prefix}slot/decoded_fraction"] = self.decode_rows / self.capacity
            metrics[f"{prefix}slot/idle_fraction"] = max(0.0, 1.0 - self.decode_rows / self.capacity)
            metrics[f"{prefix}slot/discarded_fraction"] = discarded_tokens / self.capacity
        return metrics


def full_step_seconds(before: Mapping[str, Any], after: Mapping[str, Any]) -> float:
    """The time one full-batch step takes on this server during the window (module docstring); 0 without a step."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return 0.0
    slots = after["max_num_seqs"]
    emulated = EmulatedGpu.parse(after["emulate_gpu"])
    if emulated is None:
        return (after["step_s"] - before["step_s"]) / steps
    rows = after["decode_tokens"] - before["decode_tokens"]
    context = after["decode_context_tokens"] - before["decode_context_tokens"]
    mean_context = context / rows if rows else 0.0
    return emulated.server_spec(slots).step_seconds(slots, slots * mean_context)


def phase_slots(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]], wall_s: float) -> PhaseSlots:
    """Sum over the servers of one phase (``before``/``after``: each server's ``engine_stats()``, in one order)."""
    if len(before) != len(after):
        raise ValueError(f"engine_stats of {len(before)} servers before the phase, {len(after)} after")
    capacity, rows, prefill, steps, overruns = 0.0, 0, 0, 0, 0
    for start, end in zip(before, after, strict=True):
        step_s = full_step_seconds(start, end)
        if step_s > 0:
            capacity += end["max_num_seqs"] * wall_s / step_s
        rows += end["decode_tokens"] - start["decode_tokens"]
        prefill += end["prefill_tokens"] - start["prefill_tokens"]
        steps += end["steps"] - start["steps"]
        overruns += end["overruns"] - start["overruns"]
    return PhaseSlots(capacity, rows, prefill, steps, overruns)
