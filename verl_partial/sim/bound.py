"""How short can a rollout phase be at a given staleness bound, whatever the scheduler? (docs/gpu-projection.md)

A lower bound on the mean rollout phase of *any* schedule that keeps every trained token within ``max_staleness``
(``s``) policy versions, for a colocated trainer (the engines generate only during rollout phases), from the
trained lengths and a floor under the engine's step time (:class:`StepCostFloor`). Three facts:

1. **A sample's tokens come from at most ``s + 1`` consecutive rollout phases.** A token generated in phase ``p``
   and trained at step ``t`` is ``t - p`` versions old, so the samples trained at step ``t`` were generated
   entirely in phases ``t - s .. t`` (their *window*).
2. **A sample of ``L`` tokens needs ``L`` engine steps, one after the other** (one token per step, the first from
   the step that completes its prefill), on whichever server runs it, each costing at least the floor of a step
   that decodes it and reads its context.
3. **Every engine step costs at least** ``fixed + per_request x decoded tokens + per_context x attended tokens``,
   decodes at most ``max_requests`` tokens and attends to at most ``kv_capacity`` tokens, on each server.

Two bounds follow (:func:`phase_floor` takes the larger):

* **Tail**: a window lasts at least as long as its longest sample's steps (:func:`tail_floor`); every phase lies in
  ``s + 1`` windows, so ``mean phase >= mean tail floor / (s + 1)``.
* **Work**: every token is generated in exactly one phase, so the phases together last at least all the trained
  tokens' work spread evenly over the servers, in at least as many steps as the longest samples, the request
  limit and the KV cache force (:func:`work_floor`). Staleness barely helps here.

With ``s = 0`` this bounds a synchronous rollout too, so ``sync phase / phase_floor(s)`` is the highest speed-up
over sync any scheduler can reach at staleness ``s``. Prefill, preemption and re-prefill after a weight update only
add time; leaving them out keeps it a lower bound. A disaggregated trainer (verl fully_async, AReaL) also generates
while it trains, which this bound does not cover.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from verl_partial.sim.engine import ServerSpec

# Weights of the convex combinations of a roofline's memory and compute terms tried by :meth:`StepCostFloor.of_server`.
_ROOFLINE_WEIGHTS = np.linspace(0.0, 1.0, 5)


@dataclass(frozen=True)
class StepCostFloor:
    """A floor under the time of every engine step of one server.

    ``fixed_s + per_request_s x decoded tokens + per_context_s x tokens attended to`` (the running requests'
    cached lengths). ``max_requests``: most tokens one step decodes (vLLM's ``max_num_seqs``); ``kv_capacity``:
    most tokens one step attends to (the KV cache). None: not limited.
    """

    fixed_s: float
    per_request_s: float = 0.0
    per_context_s: float = 0.0
    max_requests: int | None = None
    kv_capacity: int | None = None

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_request_s, self.per_context_s) < 0:
            raise ValueError(f"step-cost floor terms must be >= 0, got {self}")

    @classmethod
    def of_server(cls, spec: ServerSpec) -> list[StepCostFloor]:
        """Floors under the simulated server's step: each roofline term ``max(bytes / bandwidth, FLOPs / peak)``
        is at least any weighted mean of the two, so every pair of weights gives a valid affine floor."""
        model, gpu, eff = spec.model, spec.gpu, spec.efficiency
        bandwidth, flops = spec.tp * gpu.hbm_bandwidth * eff.bandwidth, spec.tp * gpu.bf16_flops * eff.compute
        return [
            cls(
                fixed_s=spec.step_overhead_s + linear * model.weight_bytes / bandwidth,
                per_request_s=(1 - linear) * model.linear_flops_per_token / flops,
                per_context_s=attention * model.kv_bytes_per_token / bandwidth
                + (1 - attention) * model.attention_flops_per_context_token / flops,
                max_requests=spec.max_num_seqs,
                kv_capacity=spec.kv_capacity_tokens,
            )
            for linear, attention in itertools.product(_ROOFLINE_WEIGHTS, _ROOFLINE_WEIGHTS)
        ]

    @classmethod
    def under_measured_steps(cls, step_seconds: Mapping[int, float], max_requests: int) -> list[StepCostFloor]:
        """Every affine floor ``a + b x requests`` that stays under the measured step times (requests -> seconds,
        measured at short contexts, so longer ones only cost more) through two of the points or flat under all.
        Valid for batch sizes within the measured range."""
        points = sorted(step_seconds.items())
        if not points or any(n < 1 or s <= 0 for n, s in points):
            raise ValueError(f"need measured step times at batch sizes >= 1, got {dict(step_seconds)}")
        candidates = {(min(s for _, s in points), 0.0)}
        for (n1, s1), (n2, s2) in itertools.combinations(points, 2):
            slope = (s2 - s1) / (n2 - n1)
            if slope >= 0 and s1 - slope * n1 >= 0:
                candidates.add((s1 - slope * n1, slope))
        return [
            cls(fixed_s=a, per_request_s=b, max_requests=max_requests)
            for a, b in sorted(candidates)
            if all(a + b * n <= s * (1 + 1e-12) for n, s in points)
        ]


def attended_tokens(lengths: np.ndarray, prompt_len: int) -> np.ndarray:
    """Tokens each answer's decode steps attend to at least: its j-th decode step (j = 1 .. L-1) reads the prompt
    and the j tokens before it."""
    decodes = np.maximum(np.asarray(lengths, dtype=np.float64) - 1, 0)
    return decodes * prompt_len + decodes * (decodes + 1) / 2


def tail_floor(lengths: np.ndarray, prompt_len: int, cost: StepCostFloor) -> float:
    """Least time of the steps the longest of ``lengths`` needs: each decodes at least that answer and reads its
    context."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if lengths.size == 0:
        return 0.0
    longest = lengths.max()
    return float(
        (cost.fixed_s + cost.per_request_s) * longest + cost.per_context_s * attended_tokens(longest, prompt_len)
    )


def work_floor(
    steps: Sequence[np.ndarray], prompt_len: int, cost: StepCostFloor, servers: int, max_staleness: int
) -> float:
    """Least mean phase that generates every step's trained ``lengths`` on ``servers`` servers."""
    tokens = float(np.mean([np.sum(lengths) for lengths in steps]))
    context = float(np.mean([attended_tokens(lengths, prompt_len).sum() for lengths in steps]))
    engine_steps = float(np.mean([np.max(lengths, initial=0) for lengths in steps])) / (max_staleness + 1)
    if cost.max_requests:
        engine_steps = max(engine_steps, tokens / cost.max_requests)
    if cost.kv_capacity:
        engine_steps = max(engine_steps, context / cost.kv_capacity)
    return (cost.fixed_s * engine_steps + cost.per_request_s * tokens + cost.per_context_s * context) / servers


def phase_floor(
    steps: Sequence[np.ndarray],
    prompt_len: int,
    costs: Sequence[StepCostFloor],
    servers: int,
    max_staleness: int,
) -> float:
    """Least mean rollout phase of any schedule that trains ``steps`` (each step's trained lengths) at staleness
    <= ``max_staleness``, given step-cost floors that each hold for every step."""
    if max_staleness < 0 or not steps or not costs:
        raise ValueError(
            f"need max_staleness >= 0, steps and step-cost floors; got {max_staleness}, {len(steps)}, {len(costs)}"
        )
    tail = np.mean([max(tail_floor(lengths, prompt_len, cost) for cost in costs) for lengths in steps])
    work = max(work_floor(steps, prompt_len, cost, servers, max_staleness) for cost in costs)
    return max(float(tail) / (max_staleness + 1), work)
