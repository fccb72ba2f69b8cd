"""benchmarks/harness.py: the one lock, the one runtime environment, the busy-machine rejection, the rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
# In a child process: try the lock without waiting; print whether it was free, then what heavy_lock() yields.
TRY_LOCK = """
import fcntl, sys
from benchmarks.harness import heavy_lock
with open(sys.argv[1], "a") as handle:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("free")
        fcntl.flock(handle, fcntl.LOCK_UN)
    except BlockingIOError:
        print("held")
with heavy_lock() as took:
    print("took" if took else "passed through")
"""


@pytest.fixture
def harness(bench_module: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("VERL_PARTIAL_HEAVY_LOCK", str(tmp_path / "heavy.lock"))
    monkeypatch.delenv("VERL_PARTIAL_HEAVY_LOCK_HELD", raising=False)
    return bench_module("harness")


def _child(harness: ModuleType, env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", TRY_LOCK, str(harness.lock_path())], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:2]


def test_the_lock_is_exclusive_and_reentrant_across_child_processes(harness: ModuleType) -> None:
    """While held, another process finds the lock taken; a child of the holder (a benchmark started under the lock,
    a test that starts one) passes through instead of waiting on its own parent forever."""
    assert harness.lock_path().name == "heavy.lock" and harness.DEFAULT_LOCK != "/tmp/heavy.lock"
    with harness.heavy_lock() as took:
        assert took
        with harness.heavy_lock() as nested:  # the same process again
            assert not nested
        child = _child(harness, dict(os.environ))  # inherits the holder's marker
        assert child == ["held", "passed through"]
        stranger = {k: v for k, v in os.environ.items() if k != harness.HELD_ENV}
        with pytest.raises(subprocess.TimeoutExpired):  # no marker: it waits for the lock
            subprocess.run([sys.executable, "-c", TRY_LOCK, str(harness.lock_path())], env=stranger, cwd=REPO,
                           capture_output=True, timeout=10)  # fmt: skip
    assert harness.HELD_ENV not in os.environ
    assert _child(harness, dict(os.environ)) == ["free", "took"]


def test_a_busy_machine_rejects_the_run(harness: ModuleType, tmp_path: Path) -> None:
    """Another process burning a core during the run (not one the run started) marks the run rejected."""
    burner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 6\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.5)
        record = harness.run_trainer(["sleep", "4"], tmp_path / "run", dict(os.environ), harness.RunSettings())
    finally:
        burner.kill()
        burner.wait()
    assert record["returncode"] == 0
    assert record["machine"]["other_cores_mean"] >= 0.7  # one core burning throughout, less scheduling noise
    assert record["rejected"] and "other processes used" in record["rejected"]
    assert any("sleep" in seen["name"] for seen in record["machine"]["process_threads"])
    quiet = {**record["machine"], "other_cores_mean": 0.1}
    assert harness.busy_reason(quiet) is None


def test_other_processes_cpu_after_the_last_periodic_sample_is_counted(harness: ModuleType) -> None:
    """A run shorter than the sampling period: before the closing sample its mean counted the other processes' CPU
    as nothing (CI once measured 0.499 cores for a burner that ran throughout: half the
    run uncounted)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.5)
        monitor = harness.RunMonitor(sleeper.pid, period_s=60.0)
        time.sleep(1.5)
        record = monitor.stop()
    finally:
        for process in (burner, sleeper):
            process.kill()
            process.wait()
    assert record["other_cores_mean"] >= 0.7
    assert harness.busy_reason(record) is not None


def test_processes_a_run_leaves_behind_are_ended(harness: ModuleType, tmp_path: Path) -> None:
    """A process the run started in its own session (as Ray's workers are) that outlives the run is killed, so it
    cannot take the next run's cores."""
    marker = tmp_path / "left.pid"
    command = ["sh", "-c", f"setsid sh -c 'echo $$ > {marker}; exec sleep 120' & sleep 5"]
    record = harness.run_trainer(command, tmp_path / "run", dict(os.environ), harness.RunSettings())
    assert record["returncode"] == 0 and record["machine"]["leftover_processes_killed"] >= 1
    import psutil

    time.sleep(0.5)
    try:  # gone, or a zombie its new parent has not reaped yet
        assert psutil.Process(int(marker.read_text())).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


def test_pending_skips_stored_usable_runs_and_redoes_rejected_ones(harness: ModuleType) -> None:
    stored = [
        {"round": 0, "engine": "cpu", "mode": "a", "returncode": 0, "rejected": None},
        {"round": 0, "engine": "cpu", "mode": "b", "returncode": 0, "rejected": "busy"},
        {"round": 1, "engine": "cpu", "mode": "a", "returncode": 1, "rejected": None},
    ]
    todo = harness.pending(stored, [0, 1], ["cpu"], ["a", "b"])
    assert todo == [(0, "cpu", "b"), (1, "cpu", "a"), (1, "cpu", "b")]


def test_merging_refuses_a_round_held_twice_per_engine(harness: ModuleType, tmp_path: Path) -> None:
    run = {"round": 0, "engine": "cpu", "mode": "default", "returncode": 0, "steps": {}}
    first, other_engine, clash = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"workload": {}, "runs": [run]}))
    other_engine.write_text(json.dumps({"workload": {}, "runs": [{**run, "engine": "cpu_vllm"}]}))
    clash.write_text(json.dumps({"workload": {}, "runs": [run]}))
    assert len(harness.merge_results([first, other_engine])["runs"]) == 2
    with pytest.raises(SystemExit, match="round 0 of default on cpu"):
        harness.merge_results([first, clash])


def _ray_runtime(command: list[str]) -> list[str]:
    return sorted(part for part in command if "ray_kwargs" in part)


def test_every_mode_gets_the_same_runtime_environment(bench_module: Callable[[str], ModuleType],
                                                       tmp_path: Path) -> None:  # fmt: skip
    """The Ray runtime environment (the worker set-up hook that decides how many threads torch gets) and the process
    environment are the same in every mode of both trainer benchmarks; the earlier harness hooked only ours."""
    peer, trainer = bench_module("bench_peer"), bench_module("bench_vllm_trainer")
    paths = {"model": tmp_path / "model", "train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    runtimes = {}
    emulated = (f"+{peer.EMULATE_OVERRIDE}=H20/Qwen2.5-32B",)  # the KV-aware mode needs the emulated cache size
    for name, mode in peer.MODES.items():
        run_dir = tmp_path / name
        run_dir.mkdir()
        command = peer.command_for(mode, paths, peer.Workload(), run_dir, "cpu", emulated)
        runtimes[f"peer {name}"] = [part for part in _ray_runtime(command) if part not in emulated]
    for name in trainer.MODES:
        run_dir = tmp_path / f"trainer-{name}"
        run_dir.mkdir()
        runtimes[f"trainer {name}"] = _ray_runtime(trainer.trainer_overrides(paths, trainer.Workload(), run_dir, name))
    assert len({tuple(runtime) for runtime in runtimes.values()}) == 1, runtimes
    assert any("worker_process_setup_hook" in part for part in runtimes["peer v0_sync"])
    harness = bench_module("harness")
    env = harness.run_env(harness.RunSettings(threads=3), tmp_path, {"WORKLOAD": "x"}, base={})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3" and env["WORKLOAD"] == "x"


def test_heavy_tests_take_the_same_lock(harness: ModuleType, request: pytest.FixtureRequest) -> None:
    """tests/conftest.py holds the harness's lock through an ``e2e`` (or ``vllm``) test, and only such a test."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_conftest_under_test", REPO / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    light = conftest.pytest_runtest_protocol(request.node, None)
    next(light)
    assert harness.HELD_ENV not in os.environ
    light.close()
    request.node.add_marker("e2e")
    heavy = conftest.pytest_runtest_protocol(request.node, None)
    next(heavy)
    try:
        assert os.environ[harness.HELD_ENV] == str(harness.lock_path())
        stranger = {k: v for k, v in os.environ.items() if k != harness.HELD_ENV}
        assert _child_try(harness, stranger) == "held"
    finally:
        heavy.close()
    assert harness.HELD_ENV not in os.environ
    assert _child_try(harness, dict(os.environ)) == "free"


def _child_try(harness: ModuleType, env: dict[str, str]) -> str:
    """Whether another process finds the lock free, without waiting for it."""
    code = TRY_LOCK.split("with heavy_lock()")[0]
    done = subprocess.run([sys.executable, "-c", code, str(harness.lock_path())], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_worker_killed_while_recording_its_threads_leaves_no_unreadable_record(
    harness: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray kills workers at shutdown; one killed inside a plain write left an empty ``<pid>.json`` and the harness
    lost a finished 45-minute run reading it. Here the second write dies after truncating its file: the record read
    back is still the first, whole."""
    folder = tmp_path / "run" / "threads"
    folder.mkdir(parents=True)
    harness.write_thread_record(folder)

    def killed(path: Path, text: str) -> None:
        path.open("w").close()  # truncated, then the process is gone
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        harness.write_thread_record(folder)
    monkeypatch.undo()
    records = harness.worker_threads(tmp_path / "run")
    assert [record["pid"] for record in records] == [os.getpid()]
    assert records[0]["torch_threads"] >= 1
