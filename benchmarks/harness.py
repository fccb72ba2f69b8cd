"""The one harness every trainer benchmark runs through: one lock, one runtime environment, one record of the machine.

Why each part exists (each was a measured fault of the earlier benchmarks):

* **One lock** (:func:`heavy_lock`), the path from :func:`lock_path` (``$VERL_PARTIAL_HEAVY_LOCK``, else
  :data:`DEFAULT_LOCK`), taken by every heavy run: the benchmarks and the e2e / vLLM tests (tests/conftest.py). It is
  re-entrant across child processes: the holder exports :data:`HELD_ENV`, so a benchmark started under
  ``python -m benchmarks.harness lock -- ...`` (or a test that starts one) does not wait on itself.
* **One runtime environment** (:func:`run_env`, :func:`ray_overrides`): every mode gets the same environment
  variables, the same thread count and the same Ray ``worker_process_setup_hook``. The earlier harness added the
  hook in the partial modes only; the hook imports torch before Ray caps ``OMP_NUM_THREADS`` at 1, so those modes
  trained on 2 threads and the others on 1.
* **A record of the machine** (:class:`RunMonitor`, :func:`calibration_probe`): load average before and after, the
  CPU other processes used during the run, the threads of every process the run started (and, from inside each Ray
  worker, ``OMP_NUM_THREADS`` and torch's thread count), and a fixed short generate on the engine timed before the
  run. A run whose machine was busy is kept but marked ``rejected`` (:func:`busy_reason`), and no figure uses it.
* **Rounds** (:func:`pending`, :func:`merge_results`): modes interleaved in rounds so machine drift falls on all of
  them alike; a run stored (successful, not rejected) is skipped when the command is started again, and stored files
  merge only if no (round, engine, mode) is held twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCK_ENV = "VERL_PARTIAL_HEAVY_LOCK"
# Not /tmp/heavy.lock: that file is taken by hand around whole sessions, which would then wait on themselves.
DEFAULT_LOCK = "/tmp/verl-partial-heavy.lock"
HELD_ENV = "VERL_PARTIAL_HEAVY_LOCK_HELD"  # the lock path, exported by its holder to every child process
THREADS_ENV = "VERL_PARTIAL_BENCH_THREADS_DIR"  # where each Ray worker writes what threads it sees
SETUP_HOOK = "benchmarks.harness.worker_setup"
MIN_ROUNDS = 3
MIN_MEASURED_STEPS = 10


# ---------------------------------------------------------------------------------------------- the lock
def lock_path() -> Path:
    return Path(os.environ.get(LOCK_ENV) or DEFAULT_LOCK)


@contextlib.contextmanager
def heavy_lock(path: Path | None = None) -> Iterator[bool]:
    """Hold the heavy-run lock; yields whether this call took it (False: an ancestor already holds it).

    The holder exports :data:`HELD_ENV` for its children, so nested holders (a test that starts a benchmark, a
    benchmark started under ``benchmarks.harness lock``) pass through instead of waiting on themselves forever.
    """
    path = Path(path or lock_path())
    if os.environ.get(HELD_ENV) == str(path):
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        os.environ[HELD_ENV] = str(path)
        try:
            yield True
        finally:
            os.environ.pop(HELD_ENV, None)
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------- one runtime env
@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What every mode of a benchmark shares; nothing here may depend on the mode."""

    threads: int = os.cpu_count() or 1  # OMP / MKL threads of every process, set, never left to Ray's default of 1
    timeout_s: int = 1500  # one trainer run, once it holds the lock

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"RunSettings.threads must be >= 1, got {self.threads}")


def ray_overrides() -> list[str]:
    """The Hydra overrides that shape Ray's runtime environment: the same for every mode of every benchmark."""
    return [f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={SETUP_HOOK}"]


def run_env(
    settings: RunSettings, run_dir: Path, workload_env: Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of one trainer run: the caller's, the workload's (identical for every mode), the threads,
    the metrics file and the thread record in ``run_dir``. Ray workers inherit it from the driver."""
    base = dict(os.environ if base is None else base)
    threads = str(settings.threads)
    return {
        **base,
        **workload_env,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl"),
        THREADS_ENV: str(run_dir / "threads"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")])),
    }


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook`` of every mode: the workload's hooks, then the thread record."""
    from benchmarks.bench_vllm_trainer import worker_setup as workload_setup

    workload_setup()
    folder = os.environ.get(THREADS_ENV)
    if folder:
        _record_threads(Path(folder))


def _record_threads(folder: Path, period_s: float = 5.0) -> None:
    """Rewrite ``folder/<pid>.json`` every ``period_s`` with the threads this worker sees, so the file ends with what
    the worker ran on (verl may set torch's thread count after this hook)."""
    folder.mkdir(parents=True, exist_ok=True)

    def loop() -> None:
        while True:
            time.sleep(period_s)
            write_thread_record(folder)

    write_thread_record(folder)
    threading.Thread(target=loop, daemon=True, name="bench-threads").start()


def write_thread_record(folder: Path) -> None:
    """This process's threads as ``folder/<pid>.json``, written aside and renamed: Ray kills workers at shutdown,
    and one killed inside a plain write left an empty record that lost a 45-minute run when the harness read it."""
    import torch

    record = {"pid": os.getpid(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "torch_threads": torch.get_num_threads(), "argv": " ".join(sys.argv)[:200]}  # fmt: skip
    aside = folder / f".{os.getpid()}.json.tmp"
    aside.write_text(json.dumps(record) + "\n")
    os.replace(aside, folder / f"{os.getpid()}.json")


def worker_threads(run_dir: Path) -> list[dict[str, Any]]:
    folder = run_dir / "threads"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


# ---------------------------------------------------------------------------------------------- machine record
@dataclasses.dataclass(frozen=True)
class BusyLimits:
    """When a run is rejected: other processes used more than ``max_other_cores`` on average during it."""

    max_other_cores: float = 0.25


def busy_reason(monitor: Mapping[str, Any], limits: BusyLimits = BusyLimits()) -> str | None:
    """Why the run's machine was busy, or None. Measured on other processes' CPU, not the load average: the 1-minute
    load average still holds the previous run of the same benchmark."""
    others = float(monitor["other_cores_mean"])
    if others > limits.max_other_cores:
        return f"other processes used {others:.2f} cores on average (limit {limits.max_other_cores})"
    return None


class RunMonitor:
    """Samples, every ``period_s`` while a run lasts: the summed RSS and the OS threads of the run's process tree, and
    the CPU time of every process outside it."""

    def __init__(self, pid: int, period_s: float = 2.0) -> None:
        import psutil

        self._psutil = psutil
        self.pid, self.period_s = pid, period_s
        self.load_before = os.getloadavg()
        self.started = time.monotonic()
        self.peak_rss_bytes = 0
        self.threads: dict[int, dict[str, Any]] = {}  # pid -> {"name", "threads" (max seen)}
        self.other_cpu_s = 0.0
        self._others: dict[int, float] = self._other_cpu_times(self._tree())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True)
        self._thread.start()

    def _tree(self) -> list[Any]:
        psutil = self._psutil
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _other_cpu_times(self, tree: list[Any]) -> dict[int, float]:
        psutil = self._psutil
        mine = {p.pid for p in tree} | set(self.threads) | {os.getpid()}
        out: dict[int, float] = {}
        for process in psutil.process_iter():
            if process.pid in mine:
                continue
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                out[process.pid] = times.user + times.system
        return out

    def sample(self) -> None:
        psutil = self._psutil
        tree = self._tree()
        total = 0
        for process in tree:
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
                seen = self.threads.setdefault(process.pid, {"name": " ".join(process.cmdline())[:120], "threads": 0,
                                                             "created": process.create_time()})  # fmt: skip
                seen["threads"] = max(seen["threads"], process.num_threads())
        self.peak_rss_bytes = max(self.peak_rss_bytes, total)
        others = self._other_cpu_times(tree)
        self.other_cpu_s += sum(max(0.0, t - self._others[pid]) for pid, t in others.items() if pid in self._others)
        self._others = others

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def _end_leftovers(self) -> int:
        """Kill every process the run started that outlived it: Ray workers move to their own process group and, when
        the driver exits, can live on (a ``ray::TaskRunner`` did), taking the next run's cores."""
        psutil = self._psutil
        killed = 0
        for pid, seen in self.threads.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.create_time() == seen["created"]:  # the same process, not a reused pid
                    process.kill()
                    killed += 1
        return killed

    def stop(self) -> dict[str, Any]:
        """Call once the run's root process has exited. The last sample covers the time since the previous one,
        which the mean's wall time includes: without it a run that ends just before a sample is due counts up to
        ``period_s`` of other processes' CPU as idle."""
        self._stop.set()
        self._thread.join()
        self.sample()
        leftovers = self._end_leftovers()
        wall = max(time.monotonic() - self.started, 1e-9)
        return {
            "loadavg_before": list(self.load_before),
            "loadavg_after": list(os.getloadavg()),
            "other_cores_mean": round(self.other_cpu_s / wall, 3),
            "wall_s": round(wall, 1),
            "peak_rss_bytes": self.peak_rss_bytes,
            "leftover_processes_killed": leftovers,
            "process_threads": sorted(
                ({"name": seen["name"], "threads": seen["threads"]} for seen in self.threads.values()),
                key=lambda seen: -seen["threads"],
            ),
        }


def calibration_probe(engine: str, model_dir: Path, requests: int = 8, tokens: int = 32) -> dict[str, Any]:
    """A fixed short generate (``requests`` x ``tokens``, submitted at once) on the engine, timed, in its own process
    under the lock: the engine's speed on this machine just before the run, comparable across runs and sessions."""
    command = [sys.executable, "-m", "benchmarks.bench_vllm_trainer", "--peak", engine, str(model_dir), str(tokens),
               "--batches", str(requests), "--repeats", "1"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with heavy_lock():
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEAK ")]
    if done.returncode != 0 or not lines:
        return {"engine": engine, "error": done.stderr[-1500:]}
    rate = json.loads(lines[-1][5:])[f"tokens_per_s_{requests}"]
    return {"engine": engine, "requests": requests, "tokens": tokens, "seconds": round(requests * tokens / rate, 3)}


def run_trainer(command: Sequence[str], run_dir: Path, env: Mapping[str, str], settings: RunSettings) -> dict[str, Any]:
    """One trainer run under the lock, monitored; verl's per-step metrics, the machine record, the verdict on it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(" ".join(command) + "\n")
    with heavy_lock(), open(run_dir / "verl.log", "w") as log:
        process = subprocess.Popen(["timeout", str(settings.timeout_s), *command], cwd=run_dir, env=dict(env),
                                   stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        monitor = RunMonitor(process.pid)
        code = process.wait()
        machine = monitor.stop()
    steps: dict[int, dict[str, Any]] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(int(record["step"]), {}).update(record["data"])
    machine["worker_threads"] = worker_threads(run_dir)
    return {"returncode": code, "peak_rss_bytes": machine["peak_rss_bytes"], "machine": machine,
            "rejected": busy_reason(machine), "steps": {str(k): v for k, v in sorted(steps.items())}}  # fmt: skip


# ---------------------------------------------------------------------------------------------- rounds
def run_key(run: Mapping[str, Any]) -> tuple[int, str, str]:
    """(round, engine, mode); files written before engines were a column ran vLLM's CPU build."""
    return int(run.get("round", 0)), str(run.get("engine", "cpu_vllm")), str(run["mode"])


def usable(run: Mapping[str, Any]) -> bool:
    return run.get("returncode") == 0 and not run.get("rejected")


def pending(stored: Sequence[Mapping[str, Any]], rounds: Sequence[int], engines: Sequence[str],
            modes: Sequence[str]) -> list[tuple[int, str, str]]:  # fmt: skip
    """The (round, engine, mode) runs still to do, in run order (round by round, engines and modes interleaved):
    every one not already stored as a usable run."""
    done = {run_key(run) for run in stored if usable(run)}
    return [(r, e, m) for r in rounds for e in engines for m in modes if (r, e, m) not in done]


def merge_results(paths: Sequence[Path]) -> dict[str, Any]:
    """Stored results of several invocations as one; metadata from the first. A (round, engine, mode) held by two
    files is refused: speed-ups pair runs by round, and a repeated round would pair runs of different invocations."""
    stored = [json.loads(Path(path).read_text()) for path in paths]
    seen: dict[tuple[int, str, str], Path] = {}
    for path, part in zip(paths, stored, strict=True):
        for run in part["runs"]:
            key = run_key(run)
            if key in seen:
                raise SystemExit(f"{path} and {seen[key]} both hold round {key[0]} of {key[2]} on {key[1]}: run the "
                                 "later one with --first-round past the earlier rounds")  # fmt: skip
            seen[key] = Path(path)
    results = {**stored[0], "runs": [run for part in stored for run in part["runs"]]}
    results["set_aside"] = [run for part in stored for run in part.get("set_aside", [])]  # failed or rejected
    results["rounds"] = len({round_ for round_, _, _ in seen})
    return results


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.harness lock -- CMD ...``: run CMD holding the heavy-run lock (re-entrant)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[:2] != ["lock", "--"]:
        raise SystemExit("usage: python -m benchmarks.harness lock -- COMMAND [ARGS...]")
    with heavy_lock():
        raise SystemExit(subprocess.run(args[2:]).returncode)


if __name__ == "__main__":
    main()
