"""The simulated RL workload: a prompt set, GRPO groups, and heavy-tailed response lengths.

Lengths are lognormal with a given median and p99/p50 ratio, capped at ``response_length``. Part of
the log-variance belongs to the prompt (hard prompts have long answers in every sample and every
epoch, which is what Seer's and RollPacker's length estimates rely on), the rest to the sample.
Every length is a pure function of (seed, prompt, admission, sample index, attempt), so two schedulers see the
same answers, and a sample restarted from scratch draws a fresh answer (it is a new sample).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from verl_partial.sim.engine import lognormal_sigma


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Workload:
    """Shape of one RL run: ``batch`` prompts x ``n`` samples per step, lengths lognormal(p50, p99/p50).

    ``prompt_share``: fraction of the log-length variance shared by a prompt's samples (0.5 unless
    measured otherwise: an assumption, stated in docs/method/gpu-simulator.md).

    ``sample_epoch_corr``: correlation of one sample's own log-length noise between any two epochs (the benchmarks'
    imposed lengths, ``Lengths.epoch_corr``, with ``prompt_share`` 0): its normal is ``sqrt(rho) u(prompt, index) +
    sqrt(1 - rho) e(admission, index, attempt)``. 0, the default, draws every epoch afresh (only the prompt's share
    carries over).
    """

    batch: int
    n: int
    p50: float
    p99_over_p50: float
    response_length: int
    prompt_len: int = 256
    prompts: int = 4096
    prompt_share: float = 0.5
    seed: int = 0
    sample_epoch_corr: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt_share", "sample_epoch_corr"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.batch < 1 or self.n < 1 or self.prompts < self.batch:
            raise ValueError(
                f"need batch >= 1, n >= 1 and prompts >= batch; got {self.batch}, {self.n}, {self.prompts}"
            )

    @property
    def sigma(self) -> float:
        return lognormal_sigma(self.p99_over_p50)

    def prompt_offset(self, prompt: int) -> float:
        """The prompt's log-length offset (its difficulty), the same in every epoch."""
        sd = self.sigma * math.sqrt(self.prompt_share)
        return float(np.random.default_rng(_seed(self.seed, "prompt", prompt)).normal(0.0, sd))

    def length(self, prompt: int, key: str, index: int, attempt: int) -> int:
        """Tokens until EOS of one answer (may exceed ``response_length``: then it is cut there).

        ``key`` is the group's admission key: the same prompt in a later epoch gets new answers around the same
        prompt difficulty.
        """
        sd = self.sigma * math.sqrt(1.0 - self.prompt_share)
        noise = float(np.random.default_rng(_seed(self.seed, "sample", key, index, attempt)).normal())
        rho = self.sample_epoch_corr
        if rho:
            kept = float(np.random.default_rng(_seed(self.seed, "sample", prompt, index)).normal())
            noise = math.sqrt(rho) * kept + math.sqrt(1.0 - rho) * noise
        return max(1, math.ceil(self.p50 * math.exp(self.prompt_offset(prompt) + sd * noise)))

    def reference_lengths(self, samples: int = 200_000) -> np.ndarray:
        """Trained lengths of an unbiased (synchronous) run: the capped distribution itself."""
        rng = np.random.default_rng(_seed(self.seed, "reference"))
        drawn = np.ceil(self.p50 * np.exp(rng.normal(0.0, self.sigma, samples)))
        return np.minimum(np.maximum(drawn, 1), self.response_length)

    def mean_running_context(self) -> float:
        """Time-average context of a running request: prompt + E[L^2] / (2 E[L]) for capped lengths L."""
        lengths = self.reference_lengths()
        return self.prompt_len + float((lengths**2).mean() / (2 * lengths.mean()))


class PromptCycle:
    """``PromptSource`` over the workload's prompts, epoch after epoch; remembers each key's admission step."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.issued = 0
        self.step = 0
        self.admitted_at: dict[str, int] = {}

    def next_prompt(self) -> tuple[int, str]:
        prompt = self.issued % self.workload.prompts
        key = f"p{prompt}@e{self.issued // self.workload.prompts}"
        self.issued += 1
        self.admitted_at[key] = self.step
        return prompt, key
