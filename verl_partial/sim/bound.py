"""How short can a rollout phase be at a given staleness bound, whatever the scheduler? (docs/method/gpu-simulator.md)

A lower bound on the mean rollout phase of *any* schedule that keeps every trained token within ``max_staleness``
(``s``) policy versions, for a colocated trainer (the engines generate only during rollout phases), from the
trained lengths and a floor under the engine's step time (:class:`StepCostFloor`). Three facts:

1. **A sample's tokens come from at most ``s + 1`` consecutive rollout phases.** A token generated in phase ``p``
   and trained at step ``t`` is ``t - p`` versions old, so the samples trained at step ``t`` were generated
   entirely in phases ``t - s .. t`` (their *window*).
2. **A sample of ``L`` tokens needs ``L`` engine steps, one after the other** (one token per step, the first from
   the step that completes its prefill), on whichever server runs it, each costing at least the floor of a step
   that decodes it and reads its context.
3. **Every engine step costs at least** ``fixed + per_request x decoded tokens + per_context x attended tokens +
   per_prefill x prompt tokens prefilled``, decodes at most ``max_requests`` tokens and attends to at most
   ``kv_capacity`` tokens, on each server.
4. **Every trained sample's prompt is prefilled at least once** in its window: ``prompt_tokens`` per trained batch,
   all its samples' prompts on an engine that cannot share them (vLLM shares only whole cached blocks), its groups'
   prompts at best.

Two bounds follow (:func:`phase_floor` takes the larger):

* **Tail**: a window lasts at least as long as its longest sample's steps (:func:`tail_floor`); every phase lies in
  ``s + 1`` windows, so ``mean phase >= mean tail floor / (s + 1)``.
* **Work**: every token is generated in exactly one phase, so the phases together last at least all the trained
  tokens' work and their prompts' prefill spread evenly over the servers, in at least as many steps as the longest
  samples, the request limit and the KV cache force (:func:`work_floor`). Staleness barely helps here.

With ``s = 0`` this bounds a synchronous rollout too, so ``sync phase / phase_floor(s)`` is the highest speed-up
over sync any scheduler can reach at staleness ``s``. Preemption and re-prefill after a weight update only add
time; leaving them out keeps it a lower bound. A disaggregated trainer (verl fully_async, AReaL) also generates
while it trains, which this bound does not cover.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from verl_partial.sim.engine import ServerSpec

# Weights of the convex combinations of a roofline's memory and compute terms tried by :meth:`StepCostFloor.of_server`.
_ROOFLINE_WEIGHTS = np.linspace(0.0, 1.0, 5)


@dataclass(frozen=True)
class StepCostFloor:
    """A floor under the time of every engine step of one server.

    ``fixed_s + per_request_s x decoded tokens + per_context_s x tokens attended to`` (the running requests'
    cached lengths) ``+ per_prefill_s x prompt tokens prefilled``. ``max_requests``: most tokens one step decodes
    (vLLM's ``max_num_seqs``); ``kv_capacity``: most tokens one step attends to (the KV cache). None: not limited.
    """

    fixed_s: float
    per_request_s: float = 0.0
    per_context_s: float = 0.0
    per_prefill_s: float = 0.0
    max_requests: int | None = None
    kv_capacity: int | None = None

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_request_s, self.per_context_s, self.per_prefill_s) < 0:
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
    def under_measured_steps(
        cls, points: Iterable[tuple[float, float, float]], max_requests: int, prefill_slopes: int = 32
    ) -> list[StepCostFloor]:
        """Affine floors ``a + b x decoded + c x prefilled`` under every measured ``(tokens decoded, prompt tokens
        prefilled, seconds)`` point. A point may be one step (measured at short contexts, so longer ones only cost
        more) or the means of a stretch of consecutive steps, which a late output timestamp cannot make look fast.

        For each of ``prefill_slopes`` prefill costs ``c`` from 0 to the most every prefilling point allows, the
        decode floors are the edges (non-negative slope) of the lower convex hull of ``(decoded, seconds - c x
        prefilled)`` and the flat line under all of it; each stays under every point. Valid for batch sizes within
        the measured range."""
        measured = [(float(n), float(p), float(s)) for n, p, s in points]
        if not measured or any(n < 1 or p < 0 or s <= 0 for n, p, s in measured):
            raise ValueError(f"need measured step times at batch sizes >= 1, got {measured[:8]}")
        most = min((s / p for _, p, s in measured if p > 0), default=0.0)
        floors: set[StepCostFloor] = set()
        for slope in np.linspace(0.0, most, prefill_slopes) if most > 0 else [0.0]:
            residual = sorted((n, s - slope * p) for n, p, s in measured)
            for fixed, per_request in _lower_hull_lines(residual):
                floors.add(cls(fixed, per_request, per_prefill_s=float(slope), max_requests=max_requests))
        return sorted(floors, key=lambda f: (f.per_prefill_s, f.fixed_s))


def _lower_hull_lines(points: list[tuple[float, float]]) -> set[tuple[float, float]]:
    """``(intercept, slope)`` of the lines under every one of ``points`` (sorted) that are edges of their lower
    convex hull with a non-negative slope and intercept, and the flat line through the lowest point if it is >= 0."""
    hull: list[tuple[float, float]] = []
    for point in points:  # monotone chain, lower half: every point lies on or above each edge's line
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) <= 0:
            hull.pop()
        if hull and hull[-1][0] == point[0]:
            continue  # same batch size, higher time: the lower one is already on the hull
        hull.append(point)
    lines = {(min(s for _, s in points), 0.0)}
    for (n1, s1), (n2, s2) in itertools.pairwise(hull):
        slope = (s2 - s1) / (n2 - n1)
        lines.add((s1 - slope * n1, slope))
    return {(a, b) for a, b in lines if a >= 0 and b >= 0}


def _turn(a: tuple[float, float], b: tuple[float, float], c: tuple[float, float]) -> float:
    """Cross product of ``a -> b`` and ``a -> c``: positive when ``c`` lies left of (above) the line ``a b``."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


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
    steps: Sequence[np.ndarray],
    prompt_len: int,
    cost: StepCostFloor,
    servers: int,
    max_staleness: int,
    prompt_tokens: float = 0.0,
) -> float:
    """Least mean phase that generates every step's trained ``lengths`` on ``servers`` servers and prefills
    ``prompt_tokens`` per step."""
    tokens = float(np.mean([np.sum(lengths) for lengths in steps]))
    context = float(np.mean([attended_tokens(lengths, prompt_len).sum() for lengths in steps]))
    engine_steps = float(np.mean([np.max(lengths, initial=0) for lengths in steps])) / (max_staleness + 1)
    if cost.max_requests:
        engine_steps = max(engine_steps, tokens / cost.max_requests)
    if cost.kv_capacity:
        engine_steps = max(engine_steps, context / cost.kv_capacity)
    decode = cost.fixed_s * engine_steps + cost.per_request_s * tokens + cost.per_context_s * context
    return (decode + cost.per_prefill_s * prompt_tokens) / servers


def phase_floor(
    steps: Sequence[np.ndarray],
    prompt_len: int,
    costs: Sequence[StepCostFloor],
    servers: int,
    max_staleness: int,
    prompt_tokens: float = 0.0,
) -> float:
    """Least mean rollout phase of any schedule that trains ``steps`` (each step's trained lengths) at staleness
    <= ``max_staleness``, given step-cost floors that each hold for every step, with ``prompt_tokens`` (mean per
    step) prefilled at least once (fact 4)."""
    if max_staleness < 0 or not steps or not costs:
        raise ValueError(
            f"need max_staleness >= 0, steps and step-cost floors; got {max_staleness}, {len(steps)}, {len(costs)}"
        )
    tail = np.mean([max(tail_floor(lengths, prompt_len, cost) for cost in costs) for lengths in steps])
    work = max(work_floor(steps, prompt_len, cost, servers, max_staleness, prompt_tokens) for cost in costs)
    return max(float(tail) / (max_staleness + 1), work)
