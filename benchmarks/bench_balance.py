"""Benchmark: group-preserving balancing from small to large m, side by side with the alternatives.

    python -m benchmarks.bench_balance                          # markdown tables on stdout
    python -m benchmarks.bench_balance --compare-rev a36cd3d    # add a column for the balancer at that git rev
    python -m benchmarks.bench_balance --out REPORT.md    # also replace the block between the
                                                                # <!-- bench:start/end --> markers

m = mini-batch samples / dp ranks (rows each rank trains per optimizer step). Efficiency of a layout =
sum over mini-batches of the slowest rank's cost / (total cost / dp): 1.0 means no rank ever waits.

Table 1, efficiency (all methods on the same batches):

* ``ours``: ``balance_groups`` (whole groups per mini-batch, heavy groups together, ranks per mini-batch).
* ``before``: ``balance_groups`` as of ``--compare-rev`` (loaded from git), for before/after.
* ``random groups``: whole groups put into mini-batches blind to cost (our packer run on random costs),
  then the same rank step as ours (``assign_ranks``) on the real costs: what membership alone is worth.
* ``verl default``: ``RayPPOTrainer._balance_batch``'s default permutation -- equal-count Karmarkar-Karp
  over single samples into dp ranks, each rank's list sorted small-large-small -- and the share of
  groups it puts into more than one optimizer step.
* ``lower bound``: ``efficiency_lower_bound``, a floor for every layout that keeps groups whole.
* ``rank floor``: ``BalanceStats.efficiency_bound`` of our layout, a floor for any rank assignment of
  our mini-batches (so ours - rank floor is what the rank step leaves, rank floor - lower bound what
  membership might still win).
* ``ours keep-on-rank``: ``balance_groups(keep_group_on_rank=True)`` (whole groups also on one rank).

Table 2, time at 16,384 samples x 64 ranks, each called the way the trainer calls it, interleaved:
verl's planning lines as ``_balance_batch`` runs them (torch tensors), verl's partitioner fed a Python list
(how earlier docs timed it), our planner alone (wall and CPU time), and the whole calls on the same
``DataProto`` (``attention_mask`` of 8,192 int8 columns): verl's real ``RayPPOTrainer._balance_batch`` and
our ``balance_batch_by_group`` (costs, plan, reorder; both reorder the same tensors).

Batches (rows of a group contiguous, as verl's ``repeat(interleave=True)``), cost = verl's workload
24576*L + L^2:

* ``lognormal n=G``: groups of G responses; each prompt draws a length scale lognormal(0, 0.7), each
  response lognormal(6.2, 1.0) x scale, plus a 200-token prompt, capped at 8192.
* ``multi-turn``: one row per transition (agent-lightning style, agent-lightning issue #287), 1-12
  transitions per trajectory (uniform), group = trajectory. Row t holds the prompt (300 tokens), all
  earlier turns and tool outputs, and response t: responses lognormal(5.5, 1.0) x a per-trajectory
  scale lognormal(0, 0.5), tool outputs lognormal(4.5, 0.8), capped at 8192.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

from benchmarks._machine import cpu_name
from verl_partial.config.balance import BalanceConfig
from verl_partial.core.balance.bound import efficiency_lower_bound
from verl_partial.core.balance.eval import evaluate_permutation
from verl_partial.core.balance.groups import balance_groups
from verl_partial.core.balance.ranks import assign_ranks
from verl_partial.glue.dataproto import balance_batch_by_group

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 8192


@dataclass(frozen=True)
class Scenario:
    kind: str  # "lognormal" or "multiturn"
    dp: int
    m: int  # rows per rank per mini-batch
    group: int = 0  # responses per prompt (lognormal)
    n_target: int = 16384  # N is the largest multiple of the mini-batch at most this

    @property
    def mini_batch(self) -> int:
        return self.dp * self.m

    @property
    def name(self) -> str:
        return f"lognormal n={self.group}" if self.kind == "lognormal" else "multi-turn 1-12"


SCENARIOS = (
    [Scenario("lognormal", 64, m, group=8) for m in (3, 4, 6, 8, 12, 16, 32, 64)]
    + [Scenario("lognormal", 64, m, group=16) for m in (4, 8, 16)]
    + [Scenario("lognormal", 8, m, group=8, n_target=4096) for m in (3, 4, 8, 16)]
    + [Scenario("multiturn", 64, m) for m in (3, 4, 6, 8, 12, 16)]
    + [Scenario("multiturn", 8, m, n_target=4096) for m in (3, 4, 6, 8)]
)


def group_sizes(sc: Scenario, rng: np.random.Generator) -> list[int]:
    n = sc.n_target // sc.mini_batch * sc.mini_batch
    if sc.kind == "lognormal":
        return [sc.group] * (n // sc.group)
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(int(rng.integers(1, 13)))
    sizes[-1] -= sum(sizes) - n  # trim the last trajectory so N is a multiple of the mini-batch
    return [s for s in sizes if s > 0]


def make_batch(sc: Scenario, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, workload, group id per row)."""
    rng = np.random.default_rng(seed)
    sizes = group_sizes(sc, rng)
    if sc.kind == "lognormal":
        scale = np.repeat(rng.lognormal(0.0, 0.7, len(sizes)), sizes)
        lengths = np.minimum(MAX_LEN, 200 + rng.lognormal(6.2, 1.0, sum(sizes)) * scale)
    else:
        rows = []
        for size in sizes:
            scale, context = rng.lognormal(0.0, 0.5), 300.0
            for _ in range(size):
                response = rng.lognormal(5.5, 1.0) * scale
                rows.append(min(MAX_LEN, context + response))
                context += response + rng.lognormal(4.5, 0.8)
        lengths = np.asarray(rows)
    lengths = np.maximum(1, lengths).astype(np.int64)
    workload = calculate_workload(torch.from_numpy(lengths)).numpy().astype(np.float64)
    uid = np.repeat(np.array([f"uid-{i}" for i in range(len(sizes))], dtype=object), sizes)
    return lengths, workload, uid


def random_groups(workload: np.ndarray, uid: np.ndarray, sc: Scenario, seed: int) -> list[int]:
    """Whole groups to mini-batches blind to cost, then our rank step on the real costs.

    The membership is our own packer run on i.i.d. uniform random costs: random with respect to the real
    costs, yet it fills every mini-batch exactly whatever the group sizes (a random deal often cannot).
    """
    noise = np.random.default_rng(seed).random(workload.shape[0])
    order = np.asarray(balance_groups(noise, uid, dp_size=sc.dp, mini_batch_size=sc.mini_batch).perm)
    mb = np.empty(order.shape[0], dtype=np.int64)
    mb[order] = (np.arange(order.shape[0]) % (order.shape[0] // sc.dp)) // sc.m
    rank = assign_ranks(workload, mb, dp_size=sc.dp)
    return np.lexsort((np.arange(mb.shape[0]), mb, rank)).tolist()


def verl_default_perm(workload: np.ndarray, dp: int) -> list[int]:
    """The permutation of verl 0.9.1's default ``_balance_batch`` path (same partitioner, same re-sort)."""
    wl = workload.astype(np.int64).tolist()
    parts = get_seqlen_balanced_partitions(wl, k_partitions=dp, equal_size=True)
    perm: list[int] = []
    for part in parts:
        part = sorted(part, key=lambda i: (wl[i], i))
        perm.extend(part[::2] + part[1::2][::-1])
    return perm


def load_balancer_at(rev: str) -> Callable[..., object]:
    """``balance_groups`` at git revision ``rev``: ``verl_partial/core/balance/groups.py``, or for a revision before
    the package was laid out by feature, ``verl_partial/core/balance.py``."""
    for path in ("verl_partial/core/balance/groups.py", "verl_partial/core/balance.py"):
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    src = shown.stdout
    module = types.ModuleType(f"balance_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:{path}", "exec"), module.__dict__)
    return module.balance_groups


def efficiency_table(repeats: int, seed: int, before: Callable[..., object] | None) -> str:
    head = ["layout", "dp", "m", "K", "ours", "before", "random groups", "verl default", "verl: groups split"]
    head += ["lower bound", "ours / bound", "rank floor (ours)", "ours ms", "ours keep-on-rank"]
    if before is None:
        head.remove("before")
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for sc in SCENARIOS:
        _, workload, uid = make_batch(sc, seed)
        kw = dict(dp_size=sc.dp, mini_batch_size=sc.mini_batch)
        ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = balance_groups(workload, uid, **kw)
            ms.append((time.perf_counter() - t0) * 1e3)
        ours = res.stats
        cells = [sc.name, str(sc.dp), str(sc.m), str(ours.num_minibatches), f"{ours.efficiency:.3f}"]
        if before is not None:
            cells.append(f"{before(workload, uid, **kw).stats.efficiency:.3f}")
        rnd = evaluate_permutation(random_groups(workload, uid, sc, seed), workload, uid, **kw)
        verl = evaluate_permutation(verl_default_perm(workload, sc.dp), workload, uid, **kw)
        bound = efficiency_lower_bound(workload, uid, **kw)
        cells += [
            f"{rnd.efficiency:.3f}",
            f"{verl.efficiency:.3f}",
            f"{100 * verl.groups_split / verl.num_groups:.0f} %",
        ]
        cells += [f"{bound:.3f}", f"{ours.efficiency / bound:.3f}", f"{ours.efficiency_bound:.3f}"]
        cells.append(f"{statistics.median(ms):.0f}")
        keep = balance_groups(workload, uid, keep_group_on_rank=True, **kw).stats
        cells.append(f"{keep.efficiency:.3f}")
        assert ours.groups_split == 0 and rnd.groups_split == 0 and keep.groups_split == 0
        rows.append("| " + " | ".join(cells) + " |")
        print(f"done: {sc.name} dp={sc.dp} m={sc.m}", file=sys.stderr)
    return "\n".join(rows)


def as_dataproto(lengths: np.ndarray, uid: np.ndarray) -> DataProto:
    """A batch with what both balancers read: a (right-padded) attention mask and the uid column."""
    mask = (torch.arange(MAX_LEN)[None, :] < torch.from_numpy(lengths)[:, None]).to(torch.int8)
    return DataProto.from_dict(tensors={"attention_mask": mask}, non_tensors={"uid": uid})


def verl_default_plan_tensor(seqlen: torch.Tensor, dp: int) -> list[int]:
    """verl 0.9.1 ``_balance_batch``'s planning lines as they run in the trainer (ray_trainer.py:1189-1246,
    default path): workload and partitions on the torch tensor of sequence lengths, the re-sort keyed by
    tensor elements."""
    workload_lst = calculate_workload(seqlen)
    partitions = get_seqlen_balanced_partitions(workload_lst, k_partitions=dp, equal_size=True)
    for idx, partition in enumerate(partitions):
        partition.sort(key=lambda x: (workload_lst[x], x))
        partitions[idx] = partition[::2] + partition[1::2][::-1]
    return [j for partition in partitions for j in partition]


def timing_table(repeats: int, seed: int) -> str:
    head = ["m", "verl planner, torch tensor (as in the trainer)", "verl planner, Python list", "ours planner"]
    head += ["verl `_balance_batch` whole call", "ours `balance_batch_by_group` whole call", "ours planner, CPU time"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in (4, 16, 64):
        sc = Scenario("lognormal", 64, m, group=8)
        lengths, workload, uid = make_batch(sc, seed)
        trainer = SimpleNamespace(  # what verl's _balance_batch reads from self
            _get_dp_size=lambda _wg, _role: 64,
            actor_rollout_wg=None,
            use_prefix_grouper=False,
            config=OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": sc.mini_batch // 8}}}),
        )
        methods: dict[str, Callable[[DataProto], object]] = {
            head[1]: lambda batch: verl_default_plan_tensor(batch.batch["attention_mask"].sum(-1), 64),
            head[2]: lambda _batch, w=workload: verl_default_perm(w, 64),
            head[3]: lambda _batch, w=workload, u=uid, mb=sc.mini_batch: balance_groups(
                w, u, dp_size=64, mini_batch_size=mb
            ),
            head[4]: lambda batch, t=trainer: RayPPOTrainer._balance_batch(t, batch, metrics={}),
            head[5]: lambda batch, mb=sc.mini_batch: balance_batch_by_group(
                batch, config=BalanceConfig(enable=True), dp_size=64, mini_batch_size_samples=mb
            ),
        }
        times: dict[str, list[float]] = {h: [] for h in [*methods, head[6]]}
        for _ in range(repeats):  # interleaved so machine noise hits all alike; each on a fresh batch
            for name, fn in methods.items():
                batch = as_dataproto(lengths, uid)
                t0, cpu0 = time.perf_counter(), time.process_time()
                fn(batch)
                times[name].append((time.perf_counter() - t0) * 1e3)
                if name == head[3]:
                    times[head[6]].append((time.process_time() - cpu0) * 1e3)
        rows.append(f"| {m} | " + " | ".join(f"{statistics.median(times[h]):.0f} ms" for h in head[1:]) + " |")
        print(f"timed: m={m}", file=sys.stderr)
    return "\n".join(rows)


def header(repeats: int, rev: str | None) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"Run {_dt.date.today().isoformat()} on {cpu_name()}, {os.cpu_count()} cores (shared; load average "
        f"{load:.1f} at the start), Python {platform.python_version()}, numpy {np.__version__}, torch "
        f"{torch.__version__}; times are medians of {repeats} interleaved runs"
        + (f"; `before` = the balancer at git revision {rev}" if rev else "")
        + "."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-rev", help="git revision whose balance_groups fills the 'before' column")
    ap.add_argument("--out", type=Path, help="markdown file: replace the block between bench markers (or write)")
    args = ap.parse_args()
    before = load_balancer_at(args.compare_rev) if args.compare_rev else None
    text = (
        header(args.repeats, args.compare_rev)
        + "\n\n"
        + efficiency_table(args.repeats, args.seed, before)
        + "\n\nTime at 16,384 samples x 64 ranks (lognormal n=8):\n\n"
        + timing_table(args.repeats, args.seed)
    )
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
