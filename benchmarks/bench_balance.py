"""Benchmark: group-preserving balancing vs verl 0.9.1's two built-in paths, side by side.

    python benchmarks/bench_balance.py                 # markdown table on stdout
    python benchmarks/bench_balance.py --out docs/balance.md   # also replace the table between the
                                                               # <!-- bench:start/end --> markers

Methods (all measured on the same batches, in the same process, interleaved):

* ``verl default``: ``RayPPOTrainer._balance_batch`` default path -- equal-count Karmarkar-Karp over single
  samples (``get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)``), then each rank's
  list sorted by workload and laid out small-large-small.
* ``verl prefix-grouper``: the ``use_prefix_grouper`` path -- ``get_group_balanced_partitions`` (whole uid
  groups per rank, equal group count per rank), no re-sort. verl raises when #groups % dp != 0.
* ``ours``: ``balance_groups`` (groups kept in one mini-batch, ranks balanced per mini-batch).
* ``ours keep-on-rank``: the same with ``keep_group_on_rank=True`` (comparable to prefix-grouper).

Every permutation is scored by ``evaluate_permutation``: verl chunks the reordered batch into dp equal
contiguous shards and the actor cuts each shard into mini-batches of M/dp rows in order.
Workload = verl's ``calculate_workload`` of heavy-tailed lengths: each prompt draws a scale
lognormal(0, 0.7), each response lognormal(6.2, 1.0) x scale, plus a 200-token prompt, capped at 8192.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from verl.utils.seqlen_balancing import (  # noqa: E402
    calculate_workload,
    get_group_balanced_partitions,
    get_seqlen_balanced_partitions,
)

from benchmarks._machine import cpu_name  # noqa: E402
from verl_partial.core.balance import balance_groups, evaluate_permutation  # noqa: E402

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class Scenario:
    name: str
    n_samples: int
    dp: int
    group: int  # rollout.n
    mini_batch: int  # samples (ppo_mini_batch_size * n)
    drop: float = 0.0  # probability that a sample is dropped (unequal groups)


SCENARIOS = [
    Scenario("1k x dp8, n=8", 1024, 8, 8, 256),
    Scenario("4k x dp16, n=16", 4096, 16, 16, 1024),
    Scenario("4k x dp64, n=8", 4096, 64, 8, 1024),
    Scenario("16k x dp64, n=16", 16384, 64, 16, 4096),
    Scenario("16k x dp64, n=8", 16384, 64, 8, 4096),
    Scenario("16k x dp32, n=16, 16 steps", 16384, 32, 16, 1024),
    Scenario("4k x dp16, n=16, 10% dropped", 4096, 16, 16, 1024, drop=0.1),
]


def make_batch(sc: Scenario, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, workload, uid) with each uid's rows contiguous, as verl's ``repeat(interleave=True)``."""
    rng = np.random.default_rng(seed)
    if sc.drop:
        sizes: list[int] = []
        while sum(sizes) < sc.n_samples:
            sizes.append(max(1, sc.group - int(rng.binomial(sc.group, sc.drop))))
        sizes[-1] -= sum(sizes) - sc.n_samples  # trim the last group so N stays a multiple of M
        sizes = [s for s in sizes if s > 0]
    else:
        sizes = [sc.group] * (sc.n_samples // sc.group)
    scale = np.repeat(rng.lognormal(0.0, 0.7, len(sizes)), sizes)
    lengths = np.minimum(8192, 200 + rng.lognormal(6.2, 1.0, sc.n_samples) * scale).astype(np.int64)
    workload = calculate_workload(torch.from_numpy(lengths)).numpy().astype(np.float64)
    uid = np.repeat(np.array([f"uid-{i}" for i in range(len(sizes))], dtype=object), sizes)
    return lengths, workload, uid


def verl_default(lengths: np.ndarray, workload: np.ndarray, uid: np.ndarray, sc: Scenario) -> list[int]:
    wl = workload.astype(np.int64).tolist()
    parts = get_seqlen_balanced_partitions(wl, k_partitions=sc.dp, equal_size=True)
    perm: list[int] = []
    for part in parts:
        part = sorted(part, key=lambda i: (wl[i], i))
        perm.extend(part[::2] + part[1::2][::-1])
    return perm


def verl_prefix(lengths: np.ndarray, workload: np.ndarray, uid: np.ndarray, sc: Scenario) -> list[int]:
    if len(set(uid.tolist())) % sc.dp:
        raise RuntimeError("verl requires #groups % dp == 0")
    parts = get_group_balanced_partitions(lengths.tolist(), list(uid), k_partitions=sc.dp)
    if len({len(p) for p in parts}) != 1:
        raise RuntimeError("unequal samples per rank: verl's dispatch would mis-chunk")
    return [i for p in parts for i in p]


def ours(lengths: np.ndarray, workload: np.ndarray, uid: np.ndarray, sc: Scenario) -> list[int]:
    return balance_groups(workload, uid, dp_size=sc.dp, mini_batch_size=sc.mini_batch).perm


def ours_keep(lengths: np.ndarray, workload: np.ndarray, uid: np.ndarray, sc: Scenario) -> list[int]:
    return balance_groups(workload, uid, dp_size=sc.dp, mini_batch_size=sc.mini_batch, keep_group_on_rank=True).perm


METHODS: list[tuple[str, Callable[..., list[int]]]] = [
    ("verl default", verl_default),
    ("verl prefix-grouper", verl_prefix),
    ("ours", ours),
    ("ours keep-on-rank", ours_keep),
]


def whole_group_bound(perm: list[int], workload: np.ndarray, uid: np.ndarray, sc: Scenario) -> float:
    """Lower bound for layouts that keep each group's share of a mini-batch on one rank, per mini-batch:
    max(mean rank cost, heaviest group share + the g-1 lightest shares) when all shares have n rows and a
    rank slot holds exactly g = m/n of them, else max(mean rank cost, heaviest share). Not a bound for
    layouts that spread groups over ranks (verl default, ours without keep-on-rank)."""
    n = len(perm)
    pos = np.empty(n, dtype=np.int64)
    pos[np.asarray(perm)] = np.arange(n)
    per_rank = sc.mini_batch // sc.dp
    mb = (pos % (n // sc.dp)) // per_rank
    _, codes = np.unique(uid.astype(str), return_inverse=True)
    total = 0.0
    for j in range(n // sc.mini_batch):
        sel = mb == j
        present = np.bincount(codes[sel]) > 0
        rows = np.bincount(codes[sel])[present]
        share = np.sort(np.bincount(codes[sel], weights=workload[sel])[present])
        floor = share[-1]
        if np.all(rows == rows[0]) and per_rank % rows[0] == 0:
            floor += share[: per_rank // rows[0] - 1].sum()
        total += max(workload[sel].sum() / sc.dp, floor)
    return total / (workload.sum() / sc.dp)


def run(repeats: int, seed: int) -> str:
    rows = [
        "| scenario | method | groups split (mini-batch) | groups split (rank) | efficiency | bound (samples) "
        "| bound (whole groups) | ms (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sc in SCENARIOS:
        lengths, workload, uid = make_batch(sc, seed)
        times: dict[str, list[float]] = {name: [] for name, _ in METHODS}
        perms: dict[str, list[int] | str] = {}
        for _ in range(repeats):  # interleave methods so machine noise hits all of them alike
            for name, fn in METHODS:
                if isinstance(perms.get(name), str):
                    continue
                t0 = time.perf_counter()
                try:
                    perm = fn(lengths, workload, uid, sc)
                except (RuntimeError, AssertionError, ValueError) as exc:
                    perms[name] = f"n/a ({exc})"
                    continue
                times[name].append((time.perf_counter() - t0) * 1e3)
                perms[name] = perm
        for name, _ in METHODS:
            perm = perms[name]
            if isinstance(perm, str):
                rows.append(f"| {sc.name} | {name} | {perm} | | | | | |")
                continue
            st = evaluate_permutation(perm, workload, uid, dp_size=sc.dp, mini_batch_size=sc.mini_batch)
            rows.append(
                f"| {sc.name} | {name} | {st.groups_split} / {st.num_groups} | {st.groups_split_across_ranks} | "
                f"{st.efficiency:.4f} | {st.efficiency_bound:.4f} | {whole_group_bound(perm, workload, uid, sc):.4f} | "
                f"{statistics.median(times[name]):.1f} |"
            )
        print(f"done: {sc.name}", file=sys.stderr)
    return "\n".join(rows)


def header(repeats: int) -> str:
    cpu = cpu_name()
    return (
        f"Run {_dt.date.today().isoformat()} on {cpu}, {os.cpu_count()} cores (shared), "
        f"Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}; "
        f"median of {repeats} interleaved runs."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="markdown file: replace the block between bench markers (or write)")
    args = ap.parse_args()
    text = header(args.repeats) + "\n\n" + run(args.repeats, args.seed)
    print(text)
    if args.out:
        block = f"{START}\n{text}\n{END}"
        if args.out.exists() and START in (old := args.out.read_text()):
            new = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, old, flags=re.S)
        else:
            new = block + "\n"
        args.out.write_text(new)


if __name__ == "__main__":
    main()
