"""benchmarks/sim_check_emulated.py: the simulator runs each peer mode as the trainer ran it, parameters frozen."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import pytest

from verl_partial.config.partial import PRESETS


@pytest.fixture
def check(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("sim_check_emulated")


def test_each_mode_is_the_config_the_trainer_ran(check: ModuleType) -> None:
    modes = check.sim_configs(16)
    same = {"request_timeout_s": 1e9}  # the simulated engine never hangs: stall checks off, nothing else changed
    assert modes["default"] == dataclasses.replace(PRESETS["default"], **same)
    assert modes["default_by_groups"] == dataclasses.replace(PRESETS["default"], fill_engine=False, **same)
    assert modes["default_extra"] == dataclasses.replace(PRESETS["default"], refill=False, extra_groups=16, **same)
    assert modes["default_kv_off"] == dataclasses.replace(PRESETS["default"], kv_tokens_per_server="off", **same)
    for preset in ("tail", "tail_on_policy"):  # length-aware batches, simulated with the benchmark's epoch history
        assert modes[preset] == dataclasses.replace(PRESETS[preset], **same)
    # verl's sync: a step waits for its slowest sample, nothing admitted ahead or parked, every request sent at once
    sync = modes["v0_sync"]
    assert (sync.extra_groups, sync.refill, sync.fill_engine, sync.kv_tokens_per_server) == (0, False, False, "off")


def test_every_override_a_peer_mode_gives_our_preset_is_what_the_simulator_runs(
    check: ModuleType, bench_module: Callable[[str], ModuleType]
) -> None:
    """The simulator's configs are written by hand beside bench_peer's overrides: each ``partial.<key>=<value>`` a
    mode passes must be the value its simulated config holds, and its preset the one it starts from."""
    peer = bench_module("bench_peer")
    modes = check.sim_configs(peer.Workload().prompts)
    for name, mode in peer.MODES.items():
        if mode.partial is None or name not in modes:
            continue
        for override in mode.overrides:
            key, _, value = override.partition("=")
            assert key.startswith("partial."), override
            assert str(getattr(modes[name], key.removeprefix("partial."))).lower() == value, (name, override)
        untouched = {f.name for f in dataclasses.fields(PRESETS[mode.partial])} - {
            o.partition("=")[0].removeprefix("partial.") for o in mode.overrides} - {"request_timeout_s"}  # fmt: skip
        for field in untouched:
            assert getattr(modes[name], field) == getattr(PRESETS[mode.partial], field), (name, field)


H20 = {"cpu": {"overrides": ["+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PARTIAL_EMULATE_GPU=H20/Qwen2.5-32B"]}}


def test_the_busy_share_reads_every_step_of_usable_runs_that_fit(check: ModuleType) -> None:
    steps = {str(i): {"timing_s/gen": 2.0} for i in range(1, 4)}
    run = {"engine": "cpu", "mode": "default", "returncode": 0, "steps": steps,
           "engine_stats": [{"steps": 1000, "overruns": 0, "modelled_s": 4.5}]}  # fmt: skip
    overran = {**run, "engine_stats": [{"steps": 1000, "overruns": 50, "modelled_s": 6.0}]}
    shares, steady = check.busy_share(
        {"runs": [run, overran], "workload": {"lengths": {}}, "engines": H20}, "cpu", "default"
    )
    assert shares == pytest.approx([0.75]) and not steady  # no stamps: every step, start-up included


def test_the_busy_share_is_steady_where_every_run_carries_the_modelled_time(check: ModuleType) -> None:
    """Stamps with the modelled time (weight load, sleep, next load): the share is over the measured steps' rollout
    windows only, so step 1's start-up (a 9 s phase with 0.5 s modelled) no longer dilutes it; one run stamped the
    old way puts the whole file back on whole runs."""
    marks = [["weights", 0, 0.0, 0.0], ["sleep", None, 9.0, 0.5], ["weights", 1, 10.0, 0.5],
             ["sleep", None, 12.0, 2.1], ["weights", 2, 13.0, 2.1], ["sleep", None, 15.0, 3.7],
             ["weights", 3, 16.0, 3.7]]  # fmt: skip
    steps = {"1": {"timing_s/gen": 9.0}, "2": {"timing_s/gen": 2.0}, "3": {"timing_s/gen": 2.0}}
    run = {"engine": "cpu", "mode": "default", "returncode": 0, "steps": steps,
           "engine_stats": [{"steps": 1000, "overruns": 0, "modelled_s": 3.7, "marks": marks}]}  # fmt: skip
    results = {"runs": [run], "workload": {"steps": 3, "lengths": {}}, "engines": H20}
    shares, steady = check.busy_share(results, "cpu", "default")
    assert steady and shares == pytest.approx([3.2 / 4.0])
    old = {**run, "engine_stats": [{**run["engine_stats"][0], "marks": [m[:3] for m in marks]}]}
    shares, steady = check.busy_share({**results, "runs": [run, old]}, "cpu", "default")
    assert not steady and shares == pytest.approx([3.7 / 13.0] * 2)


def test_the_engine_figures_count_both_sides_alike(check: ModuleType) -> None:
    """The emulated engine's counters and the simulated servers' give the same four figures per trained token,
    whole runs: steps 1-3 each train 64 answers of mean length 10 (1,920 tokens)."""
    from benchmarks.bench_vllm_trainer import Workload
    from verl_partial.sim.engine import EngineStats
    from verl_partial.sim.run import ModeRun

    steps = {str(i): {"timing_s/gen": 2.0, "response_length/mean": 10.0} for i in range(1, 4)}
    stats = {"steps": 480, "overruns": 0, "modelled_s": 3.84, "decode_tokens": 1920, "prefill_tokens": 960}
    run = {"engine": "cpu", "mode": "default", "returncode": 0, "steps": steps, "engine_stats": [stats]}
    results = {"workload": dataclasses.asdict(Workload(steps=3)), "runs": [run]}
    measured = check.measured_engine(results, "cpu", "default")
    expected = {"busy_ms": 2.0, "steps_per_k": 250.0, "rows_per_step": 4.0, "prefill_per_token": 0.5}
    assert measured == [pytest.approx(expected)]
    engine = EngineStats(decode_steps=400, prefill_steps=80, tokens=1920, prefill_tokens=960, busy_seconds=3.84)
    simulated = ModeRun(tokens_trained=[640.0, 640.0, 640.0], engine=engine)
    assert check.simulated_engine(simulated) == pytest.approx(expected)


def test_the_simulated_run_keeps_its_servers_counters_through_steady() -> None:
    from verl_partial.sim.engine import EngineStats
    from verl_partial.sim.run import ModeRun

    run = ModeRun(seconds=[1.0, 2.0], tokens_trained=[5.0, 6.0], engine=EngineStats(decode_steps=7))
    steady = run.steady(1)
    assert steady.seconds == [2.0] and steady.engine.decode_steps == 7


def test_the_table_gives_the_like_for_like_miss_and_the_prefix_cache_miss_each_flagged(check: ModuleType) -> None:
    row = {"mode": "default", "measured": [2.0, 2.0], "predicted": [1.6], "predicted_as_engine": [1.9],
           "miss": -0.2, "miss_as_engine": -0.05, "engine_busy_share": [0.9], "engine": {}}  # fmt: skip
    line = next(line for line in check.table({"rows": [row]}).splitlines() if line.startswith("| `default`"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[2:5] == ["1.90 (1.90-1.90)", "-5%", "-20% (over 10 %)"]
    assert "busy share of the phase, whole run |" in check.table({"rows": [row]})  # a report from before the stamps
    steady = {**row, "engine_busy_share_steady": True}
    assert "busy share of the rollout windows, measured steps |" in check.table({"rows": [steady]})


def test_the_clairvoyant_gain_is_what_launch_order_alone_adds_to_default(
    check: ModuleType, bench_module: Callable[[str], ModuleType]
) -> None:
    """Per seed, ``default``'s simulated phase per trained token over the clairvoyant run's: above 1 on an H20, where
    ``auto`` caps calls at 26 and samples wait in the pool to be launched; exactly 1 on an H200, whose knee (147) is
    above the 64 samples the slots admit, so nothing waits; nothing unless asked for, or without a ``default`` run."""
    peer = bench_module("bench_peer")

    def results(gpu: str, mode: str = "default", prefix_caching: bool = False) -> dict:
        knee = {"partial/server_load/calls_knee": 1.0}  # the runs had ``auto``
        override = f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PARTIAL_EMULATE_GPU={gpu}/Qwen2.5-32B"
        return {
            "workload": dataclasses.asdict(peer.Workload(steps=4)),
            "runs": [
                {
                    "mode": mode,
                    "engine": "cpu",
                    "steps": {"1": knee},
                    "engine_stats": [{"prefix_caching": prefix_caching}],
                }
            ],
            "engines": {"cpu": {"label": "emulated", "overrides": [override]}},
        }

    def gain(gpu: str, what_if: str = "clairvoyant", prefix_caching: bool = False) -> list[float]:
        report = check.compare(results(gpu, prefix_caching=prefix_caching), "cpu", 31, (what_if,))
        fifo = check.predict(results(gpu), "cpu", 31, prefix_cache=prefix_caching)[0]["default"]
        # the fifo runs are predict's, as the runs had the prefix cache, not simulated again
        assert report["rows"][0][check.like_for_like(report)[0]] == fifo
        return report[check.WHAT_IFS[what_if][0]]

    h20 = gain("H20")
    assert len(h20) == len(check.SEEDS) and min(h20) >= 1.0 and max(h20) > 1.0
    assert gain("H200-SXM") == [1.0] * len(check.SEEDS)
    assert "clairvoyant_launch_gain" not in check.compare(results("H20", mode="v0_sync"), "cpu", 31, ("clairvoyant",))
    assert "clairvoyant_launch_gain" not in check.compare(results("H20"), "cpu", 31)
    # A prefix cache that outlived the weight sync would spare every resumed answer its re-prefill: on the
    # compute-bound H20 that is faster in every seed. Without a prefix cache (runs that had none) there is nothing
    # to keep.
    assert min(gain("H20", "keep_cache", prefix_caching=True)) > 1.0
    assert gain("H20", "keep_cache") == [1.0] * len(check.SEEDS)


def test_a_run_over_several_epochs_is_simulated_with_the_benchmarks_epoch_correlation(
    check: ModuleType, bench_module: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tail`` learns from a prompt's earlier epochs, so a run spanning epochs is simulated with the correlation its
    lengths were drawn with (1: the same answers every epoch, the oracle history); a run within one epoch keeps the
    draws it was first checked with."""
    peer = bench_module("bench_peer")
    seen: list[float] = []
    original = check.simulate

    def record(config, workload, *args, **kwargs):
        seen.append(workload.sample_epoch_corr)
        return original(config, workload, *args, **kwargs)

    monkeypatch.setattr(check, "simulate", record)
    override = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PARTIAL_EMULATE_GPU=H200-SXM/Qwen2.5-32B"
    for train_rows, epoch_corr, expected in ((64, 1.0, 1.0), (64, 0.5, 0.5), (512, 1.0, 0.0)):
        wl = peer.Workload(steps=6, train_rows=train_rows, lengths=peer.Lengths(epoch_corr=epoch_corr, epoch_steps=4))
        results = {"workload": dataclasses.asdict(wl), "runs": [], "engines": {"cpu": {"overrides": [override]}}}
        seen.clear()
        check._simulate(results, check.sim_configs(wl.prompts)["default"], check._server(results, "cpu", True), 31, 0)
        assert seen == [expected]


def test_the_doubled_sync_batch_is_simulated_at_twice_the_prompts_a_step(
    check: ModuleType, bench_module: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``v0_sync_x2`` is verl's synchronous rollout at ``PeerMode.batch_scale`` times the batch: the simulator runs
    sync's config on that many prompts a step, every seed."""
    peer = bench_module("bench_peer")
    seen: list[tuple[object, int]] = []
    original = check.simulate

    def record(config, workload, *args, **kwargs):
        seen.append((config, workload.batch))
        return original(config, workload, *args, **kwargs)

    monkeypatch.setattr(check, "simulate", record)
    wl = peer.Workload(steps=4)
    results = {"workload": dataclasses.asdict(wl), "runs": [{"mode": "v0_sync_x2"}], "engines": H20}
    predicted, _, _ = check.predict(results, "cpu", 31)
    assert set(predicted) == {"v0_sync_x2"} and len(seen) == len(check.SEEDS)
    sync = check.sim_configs(wl.prompts)["v0_sync"]
    assert all(config == sync and batch == 2 * wl.prompts for config, batch in seen)
