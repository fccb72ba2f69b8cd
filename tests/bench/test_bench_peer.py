"""benchmarks/bench_peer.py's own logic: per-trained-token figures, the table, and the command each mode runs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def peer(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("bench_peer")


def _run(mode: str, gen_s: float, step_s: float, mean_length: float, round_: int = 0, **extra: float) -> dict:
    """A run record as run_mode stores it: step 1 (warm-up) is slow and must not count."""
    warmup = {"timing_s/gen": 100.0, "timing_s/step": 200.0, "response_length/mean": 1.0}
    measured = {"timing_s/gen": gen_s, "timing_s/step": step_s, "response_length/mean": mean_length,
                "response_length/max": 4 * mean_length, "prompt_length/min": 31, "critic/score/mean": 0.5,
                **extra}  # fmt: skip
    return {"mode": mode, "returncode": 0, "peak_rss_bytes": 3 * 2**30, "round": round_,
            "steps": {"1": warmup, "2": measured, "3": measured}}  # fmt: skip


def test_figures_are_per_trained_token_of_measured_steps(peer: ModuleType) -> None:
    wl = peer.Workload(steps=3)  # 16 prompts x n=4: 64 trained answers per step
    got = peer.figures(_run("v0_sync", gen_s=2.0, step_s=4.0, mean_length=50.0), wl)
    assert got.tokens_trained == 64 * 50.0
    assert got.gen_ms_per_token == pytest.approx(1e3 * 2.0 / 3200)
    assert got.step_ms_per_token == pytest.approx(1e3 * 4.0 / 3200)
    assert got.tokens_per_s == pytest.approx(800.0)
    assert got.peak_rss_gib == pytest.approx(3.0)


def test_the_doubled_sync_batch_trains_twice_the_tokens_in_two_steps(peer: ModuleType, tmp_path: Path) -> None:
    """``v0_sync_x2`` asks verl for twice the batch and keeps the mini-batch (Hydra keeps the last value), so each
    rollout is trained in two optimizer steps; its figures count twice the trained answers a step, and it gets no
    staleness floor, which is defined for batches of the workload's size."""
    wl = peer.Workload(steps=3)
    paths = {"model": tmp_path / "model", "train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    (tmp_path / "run").mkdir()
    command = peer.command_for(peer.MODES["v0_sync_x2"], paths, wl, tmp_path / "run", "cpu")

    def last(key: str) -> str:
        return [part.split("=")[1] for part in command if part.startswith(f"{key}=")][-1]

    assert (last("data.train_batch_size"), last("actor_rollout_ref.actor.ppo_mini_batch_size")) == ("32", "16")
    assert not any(part.startswith("+partial") for part in command)
    run = _run("v0_sync_x2", gen_s=2.0, step_s=4.0, mean_length=50.0)
    gpu = peer.EmulatedGpu.parse("H20/Qwen2.5-32B")
    doubled, single = peer.figures(run, wl, gpu), peer.figures({**run, "mode": "v0_sync"}, wl, gpu)
    assert doubled.tokens_trained == 2 * single.tokens_trained == 2 * 64 * 50.0
    assert doubled.floor_s is None and single.floor_s is not None


def test_default_is_set_beside_the_doubled_batch_round_by_round(peer: ModuleType) -> None:
    """The comparison with no goal pairs runs of the same round, per trained token: the doubled batch takes 3 s for
    twice the tokens ``default`` trains in 1 s, so ``default`` is 1.5x; its round-1 run has no twin: nothing paired."""
    wl = peer.Workload(steps=3)
    runs = [_run("v0_sync_x2", 3.0, 6.0, 50.0, 0), _run("default", 1.0, 2.0, 50.0, 0), _run("default", 9, 9, 50.0, 1)]
    results = {"workload": peer.dataclasses.asdict(wl), "runs": runs}
    assert peer.comparisons(peer.by_mode(results)) == [("default", "v0_sync_x2", "1.50x", "1.50x")]
    assert "(no goal): rollout phase 1.50x, whole step 1.50x." in peer.goals(results, "cpu_vllm")


def test_a_scaled_batch_is_refused_with_our_presets(peer: ModuleType) -> None:
    with pytest.raises(ValueError, match="batch_scale"):
        peer.PeerMode("bad", "bad", "v0", partial="default", batch_scale=2)


def test_shorter_answers_do_not_pass_for_speed(peer: ModuleType) -> None:
    """A mode that trains shorter answers in a shorter step is no faster per trained token."""
    wl = peer.Workload(steps=3)
    long_ = peer.figures(_run("v0_sync", 2.0, 4.0, 60.0), wl)
    short = peer.figures(_run("default", 1.0, 2.0, 30.0), wl)
    assert short.step_s < long_.step_s
    assert short.step_ms_per_token == pytest.approx(long_.step_ms_per_token)


def test_staleness_read_per_side(peer: ModuleType) -> None:
    wl = peer.Workload(steps=3)
    ours = peer.figures(_run("default", 1, 2, 40, **{"partial/staleness/max": 1, "partial/staleness/mean": 0.2,
                                                      "partial/tokens_discarded": 0}), wl)  # fmt: skip
    off = "training/off_policy"
    v1 = peer.figures(_run("v1_async_defaults", 1, 2, 40, **{
        f"{off}/trajectory_staleness_worst/max": 3, f"{off}/trajectory_staleness_worst/mean": 1.5,
        f"{off}/trajectory_spans/max": 2, f"{off}/evicted_samples": 2}), wl)  # fmt: skip
    assert (ours.staleness_max, ours.spans_max, ours.discarded) == (1, 2, "0 tokens")
    assert (v1.staleness_max, v1.staleness_mean, v1.spans_max, v1.discarded) == (3, 1.5, 2, "2.00 groups")


def test_table_pairs_rounds_and_keeps_failures(peer: ModuleType) -> None:
    wl = peer.Workload(steps=3)
    failed = {**_run("v1_sync", 1, 1, 1), "returncode": 1}
    results = {"workload": peer.dataclasses.asdict(wl), "runs": [
        _run("v0_sync", 2.0, 4.0, 50.0, 0), _run("default", 1.0, 2.0, 50.0, 0),
        _run("v0_sync", 2.0, 6.0, 50.0, 1), _run("default", 1.0, 2.0, 50.0, 1), failed]}  # fmt: skip
    rows = {line.split(" | ")[0].lstrip("| "): line for line in peer.table(results).splitlines()[2:]}
    assert "2.50 (2.00-3.00)x" in rows["ours `+partial=default`"]  # round 0: 4/2, round 1: 6/2
    assert "failed" in rows["v1 sync"]


def test_v1_modes_run_the_v1_trainer_with_session_indexed_lengths(peer: ModuleType, tmp_path: Path) -> None:
    paths = {"model": tmp_path / "model", "train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    bound = "trainer.v1.sampler.max_off_policy_threshold=2"
    for name, backend, loop, bounded in (
        ("v1_async_bound_fastpoll", "+backend=cpu_vllm_v1", "bench_peer.SessionImposedLengthAgentLoop", True),
        ("v0_sync", "+backend=cpu_vllm", "bench_vllm_trainer.ImposedLengthAgentLoop", False),
    ):
        run_dir = tmp_path / name
        run_dir.mkdir()
        command = peer.command_for(peer.MODES[name], paths, peer.Workload(), run_dir)
        assert backend in command and not any(part.startswith("+partial") for part in command)
        assert loop in (run_dir / "agent_loops.yaml").read_text()
        assert (bound in command) is bounded


def test_the_default_reads_the_cache_and_only_the_kv_off_mode_turns_that_off(peer: ModuleType, tmp_path: Path) -> None:
    """``default`` runs as it ships (the cache size read from the servers); ``default_kv_off`` is the one mode that
    names the knob, and it turns the cap off."""
    paths = {"model": tmp_path / "model", "train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    commands = {}
    for name in ("default", "default_kv_off"):
        (tmp_path / name).mkdir()
        commands[name] = peer.command_for(peer.MODES[name], paths, peer.Workload(), tmp_path / name, "cpu")
    assert not any("kv_tokens_per_server" in part for part in commands["default"])
    assert "+partial=default" in commands["default_kv_off"]
    assert "partial.kv_tokens_per_server=off" in commands["default_kv_off"]


def test_the_engine_knee_modes_limit_the_engine_to_default_knees_cap(peer: ModuleType, tmp_path: Path) -> None:
    """``v1_async_bound_knee`` and ``v0_sync_knee`` give verl's trainers the knee as an engine setting: their
    ``max_num_seqs`` comes after the workload's (Hydra keeps the last) and equals the calls per server
    ``default_knee`` caps at; the other modes keep the workload's slots."""
    paths = {"model": tmp_path / "model", "train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    slots = {}
    for name in ("v1_async_bound_knee", "v0_sync_knee", "v1_async_bound", "default_knee"):
        (tmp_path / name).mkdir()
        command = peer.command_for(peer.MODES[name], paths, peer.Workload(), tmp_path / name, "cpu")
        slots[name] = [p.split("=")[1] for p in command if p.startswith("actor_rollout_ref.rollout.max_num_seqs=")][-1]
        assert (f"partial.max_calls_per_server={peer.KNEE_CALLS}" in command) is (name == "default_knee")
    assert slots == {
        "v1_async_bound_knee": str(peer.KNEE_CALLS),
        "v0_sync_knee": str(peer.KNEE_CALLS),
        "v1_async_bound": str(peer.Workload().slots),
        "default_knee": str(peer.Workload().slots),
    }
    assert peer.KNEE_CALLS < peer.Workload().slots


def test_partial_presets_are_refused_on_v1(peer: ModuleType) -> None:
    with pytest.raises(ValueError, match="legacy trainer"):
        peer.PeerMode("bad", "bad", "v1", partial="default")


def test_goal_verdicts_use_every_round(peer: ModuleType) -> None:
    """A goal is met only where the low end of the range reaches it, over at least 3 rounds."""
    assert peer.verdict([1.6, 1.7, 1.8], 1.5) == "goal met in every round"
    assert peer.verdict([1.4, 1.7, 1.8], 1.5) == "goal 1.5x met in some rounds only: not met"
    assert peer.verdict([1.1, 1.2, 1.3], 1.5) == "goal 1.5x not met"
    assert "undecided: 2 round(s)" in peer.verdict([1.6, 1.7], 1.5)
    # A round below the goal decides it before 3 rounds: more rounds cannot raise the range's low end.
    assert peer.verdict([1.2], 1.3) == "goal 1.3x not met (1 round(s))"
    assert peer.verdict([1.6, 1.4], 1.5, restate=False) == "met in some rounds only: not met (2 round(s))"
    assert peer.verdict([1.1, 1.2, 1.3], 1.5, restate=False) == "not met"


def test_goal_outcomes_pair_rounds_and_render_for_report_and_evidence(peer: ModuleType) -> None:
    """One outcome per goal, rendered in full for the report (labels, figures) and short for the evidence page
    (names, verdict only); an occupancy goal is a level, so it carries no "x"."""
    wl = peer.Workload(steps=3)
    results = {"workload": dataclasses.asdict(wl), "engines": {"cpu": {"label": "emulated"}}, "runs": [
        {**_run("v0_sync", 3.0, 4.0, 50.0, r), "engine": "cpu"} for r in range(3)] + [
        {**_run("default", 2.0, 4.0, 50.0, r), "engine": "cpu"} for r in range(3)]}  # fmt: skip
    by_goal = {(o.ours, o.against, o.figure): o for o in peer.goal_outcomes(results, "cpu")}
    vs_sync = by_goal[("default", "v0_sync", "rollout")]
    assert vs_sync.values == pytest.approx((1.5, 1.5, 1.5)) and vs_sync.verdict() == "goal 1.8x not met"
    assert "1.50 (1.50-1.50)x over 3 round(s) -- goal 1.8x not met." in vs_sync.report_line()
    assert vs_sync.report_line().startswith(f"- {peer.MODES['default'].label} vs {peer.MODES['v0_sync'].label}")
    assert vs_sync.short() == "`default` vs `v0_sync`, rollout phase (goal 1.8x): not met"
    assert by_goal[("default", "v1_async_bound", "rollout")].verdict().startswith("goal not shown: not measured")
    occupancy = by_goal[("default", None, "occupancy")]
    assert occupancy.short() == "`default` slot occupancy (goal 0.9): goal not shown: the engine exposes no counters"


def test_hooks_name_the_importable_module(peer: ModuleType) -> None:
    """Ray workers and verl's custom-sampler hook import the module by name; under ``python -m`` its ``__name__`` is
    ``__main__``, which they cannot import."""
    assert peer.MODULE == peer.__name__
    assert f"custom_sampler.path=pkg://{peer.MODULE}" in " ".join(peer.MODES["v1_async_bound_fastpoll"].overrides)


def test_speed_ups_pair_only_runs_of_the_same_round(peer: ModuleType) -> None:
    """A mode run in round 1 only is compared with round 1's sync, not with round 0's (merged results)."""
    wl = peer.Workload(steps=3)
    results = {
        "workload": dataclasses.asdict(wl),
        "runs": [
            _run("v0_sync", 2.0, 4.0, 50.0, round_=0),
            _run("v0_sync", 2.0, 8.0, 50.0, round_=1),
            _run("default", 2.0, 4.0, 50.0, round_=1),
        ],
    }
    measured = peer.by_mode(results)
    assert peer.speedup(measured["v0_sync"], measured["default"]) == "2.00x"


def test_merging_stored_runs_refuses_a_round_held_twice(peer: ModuleType, tmp_path: Path) -> None:
    """Rounds added later must continue the numbering (``--first-round``); a second round 0 of the same mode would
    pair one invocation's sync with another's runs, so the merge refuses it instead of averaging it in."""
    first, later, clash = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"workload": {}, "runs": [_run("v0_sync", 2.0, 4.0, 50.0, round_=0)]}))
    later.write_text(json.dumps({"workload": {}, "runs": [_run("v0_sync", 2.0, 4.0, 50.0, round_=1)]}))
    clash.write_text(json.dumps({"workload": {}, "runs": [_run("v0_sync", 2.0, 4.0, 50.0, round_=0)]}))
    merged = peer.merge_results([first, later])
    assert merged["rounds"] == 2 and len(merged["runs"]) == 2
    with pytest.raises(SystemExit, match="round 0 of v0_sync"):
        peer.merge_results([first, clash])


def test_occupancy_is_read_from_the_keys_the_engine_logs(peer: ModuleType) -> None:
    """The contract with the engine: the run's occupancy is the sum of trained tokens over the sum of slot capacity,
    read from the very keys ``PhaseSlots.metrics`` writes (the report once read a key no engine logged, and printed
    "n/a" for every mode). A step whose engines ran no step counts with capacity 0; a run without the keys is None."""
    from verl_partial.cpu_backend.occupancy import PhaseSlots

    busy = PhaseSlots(capacity=100.0, decode_rows=60, prefill_tokens=0, steps=10, overruns=0).metrics(50.0, 0.0)
    idle = PhaseSlots(capacity=0.0, decode_rows=0, prefill_tokens=0, steps=0, overruns=0).metrics(30.0, 0.0)
    steps = [{**busy, "partial/tokens_trained": 50.0}, {**idle, "partial/tokens_trained": 30.0}]
    assert peer.read_engine_counters(steps) == {"slot_occupancy": pytest.approx(80.0 / 100.0)}
    assert peer.read_engine_counters([{"partial/tokens_trained": 50.0}]) is None


EMULATED = {"cpu": {"label": "emulated", "overrides": [
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PARTIAL_EMULATE_GPU=H20/Qwen2.5-32B"]}}  # fmt: skip


def _emulated(run: dict, steps: int, overruns: int) -> dict:
    return {**run, "engine": "cpu", "engine_stats": [{"steps": steps, "overruns": overruns, "modelled_s": 1.0}]}


def test_an_emulated_run_that_overran_gives_no_figure(peer: ModuleType) -> None:
    """1 % or more of the engine's steps outlasting the modelled step: the run is left out and counted as overran."""
    results = {"workload": dataclasses.asdict(peer.Workload(steps=3)), "engines": EMULATED, "modes": ["v0_sync"],
               "runs": [_emulated(_run("v0_sync", 2.0, 4.0, 50.0, 0), 1000, 9),
                        _emulated(_run("v0_sync", 2.0, 4.0, 50.0, 1), 1000, 10)]}  # fmt: skip
    assert [r.round for r in peer.by_mode(results, "cpu")["v0_sync"]] == [0]
    assert "(1 overran)" in peer.table(results, "cpu")
    results["runs"][0]["engine_stats"] = []  # no counters: nothing shows the steps fitted
    assert "v0_sync" not in peer.by_mode(results, "cpu")


def test_overran_runs_come_back_only_when_asked_for_a_sensitivity_figure(peer: ModuleType) -> None:
    """Goals count kept rounds only; ``with_overran`` gives every round, for the figure beside a goal met on the kept
    ones (an overrun slows the engine past its model, so it can only flatter the mode beside it)."""
    results = {"workload": dataclasses.asdict(peer.Workload(steps=3)), "engines": EMULATED, "modes": ["v0_sync"],
               "runs": [_emulated(_run("v0_sync", 2.0, 4.0, 50.0, 0), 1000, 9),
                        _emulated(_run("v0_sync", 2.0, 4.0, 50.0, 1), 1000, 10)]}  # fmt: skip
    assert [r.round for r in peer.by_mode(results, "cpu", with_overran=True)["v0_sync"]] == [0, 1]
    assert [run["round"] for run in peer.kept_runs(results, "cpu")] == [0]


def test_a_goal_is_met_on_enough_rounds_that_all_reach_it(peer: ModuleType) -> None:
    def outcome(*values: float) -> object:
        return peer.GoalOutcome("default", "v1_async_bound", "rollout", 1.1, values)

    assert outcome(1.1, 1.2, 1.15).met
    assert not outcome(1.1, 1.2).met  # two rounds decide nothing met
    assert not outcome(1.09, 1.2, 1.3).met
    assert outcome(1.09).verdict() == "goal 1.1x not met (1 round(s))"


def test_occupancy_on_the_emulated_engine_is_one_formula_for_every_mode(peer: ModuleType) -> None:
    """Trained tokens over the slots x full-batch steps the phase could hold, whatever the trainer logged."""
    wl = peer.Workload(steps=3)
    gpu = peer.EmulatedGpu.parse("H20/Qwen2.5-32B")
    got = peer.figures(_run("v1_sync", 2.0, 4.0, 50.0), wl, gpu)
    full = gpu.server_spec(wl.slots).step_seconds(wl.slots, wl.slots * (wl.max_prompt_length + wl.lengths.mean() / 2))
    assert got.occupancy == pytest.approx(64 * 50.0 * full / (wl.slots * 2.0))


def test_ceilings_bound_every_schedule_and_call_a_goal_above_them_out_of_reach(peer: ModuleType) -> None:
    """On the emulated GPU each goal of ``default`` carries the most any schedule at staleness <= 1 could reach on
    its batches (the staleness floor, from what the trainer logged); a goal above it in every round is out of reach,
    one below it is merely missed. No ceiling on a measured engine, which has no step-cost model."""
    wl = peer.Workload(steps=3)
    gpu = peer.EmulatedGpu.parse("H20/Qwen2.5-32B")
    runs = [_emulated(_run("v0_sync", 30.0, 40.0, 50.0, r), 1000, 0) for r in range(3)]
    # One answer of 1,000 tokens a step, mean 50: the longest answer's steps bound the phase, not the work.
    runs += [_emulated(_run("default", 20.0, 25.0, 50.0, r, **{"response_length/max": 1000}), 1000, 0)
             for r in range(3)]  # fmt: skip
    results = {"workload": dataclasses.asdict(wl), "engines": EMULATED, "runs": runs}
    default = peer.figures(runs[3], wl, gpu)
    assert default.floor_s == pytest.approx(peer.staleness_floor(runs[3], wl, gpu))
    assert 0 < default.floor_s < default.gen_s
    by_goal = {(o.ours, o.against, o.figure): o for o in peer.goal_outcomes(results, "cpu")}
    vs_sync, occupancy = by_goal["default", "v0_sync", "rollout"], by_goal["default", None, "occupancy"]
    assert vs_sync.ceiling == pytest.approx((30.0 / default.floor_s,) * 3)
    assert occupancy.ceiling == pytest.approx((default.occupancy * 20.0 / default.floor_s,) * 3)
    assert min(vs_sync.ceiling) > vs_sync.goal and max(occupancy.ceiling) < occupancy.goal
    assert vs_sync.verdict().startswith("goal 1.8x not met; ceiling at staleness <= 1 ")
    assert "not met; out of reach, ceiling 0." in occupancy.short()
    # Our best: no v1 run, so nothing to pair (its ceiling needs v1's phase, as its ratio does).
    assert by_goal[peer.BEST, "v1_async_bound", "rollout"].ceiling == ()
    measured = {**results, "engines": {"cpu": {"label": "emulated"}}}
    assert all(not o.ceiling for o in peer.goal_outcomes(measured, "cpu"))


def test_the_floor_from_logged_summaries_stays_under_the_floor_of_the_true_lengths(peer: ModuleType) -> None:
    """The trainer logs a step's longest and mean answer, not every length: spreading the rest evenly attends to the
    fewest tokens those allow, so the floor read from the logs never exceeds the floor of the batches trained."""
    import numpy as np

    from verl_partial.sim.bound import StepCostFloor, phase_floor

    wl = peer.Workload(steps=6)
    gpu = peer.EmulatedGpu.parse("H20/Qwen2.5-32B")
    floors = StepCostFloor.of_server(gpu.server_spec(wl.slots))
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = [rng.integers(1, 4096, size=wl.prompts * wl.n) for _ in range(wl.steps)]
        steps = {str(i + 1): {"timing_s/gen": 1.0, "response_length/mean": float(x.mean()),
                              "response_length/max": float(x.max()), "prompt_length/min": 31}
                 for i, x in enumerate(lengths)}  # fmt: skip
        true = phase_floor(lengths[wl.first_measured - 1 :], 31, floors, servers=1, max_staleness=1)
        assert peer.staleness_floor({"steps": steps}, wl, gpu) <= true * (1 + 1e-9)


def test_the_best_of_our_bounded_modes_is_taken_round_by_round(peer: ModuleType) -> None:
    wl = peer.Workload(steps=3)
    runs = {
        "v1_async_bound": [peer.figures(_run("v1_async_bound", 2.0, 4.0, 50.0, r), wl) for r in (0, 1)],
        "default": [peer.figures(_run("default", 1.0, 4.0, 50.0, r), wl) for r in (0, 1)],
        "default_extra": [peer.figures(_run("default_extra", g, 4.0, 50.0, r), wl) for r, g in ((0, 0.5), (1, 4.0))],
        "kimi": [peer.figures(_run("kimi", 0.1, 4.0, 50.0, r), wl) for r in (0, 1)],  # staleness 8: not counted
    }
    assert peer.best_ratios(runs, "v1_async_bound", "rollout") == pytest.approx([4.0, 2.0])


def test_our_best_carries_the_highest_ceiling_of_our_bounded_modes(peer: ModuleType) -> None:
    """The best-preset goal is out of reach only where no schedule at staleness <= 1 reaches it on the batches of
    any of our bounded presets: its ceiling is, round by round, the highest of theirs (kimi, staleness 8, is not
    counted). A goal between two presets' ceilings is missed, not out of reach."""
    wl = peer.Workload(steps=3)

    def run(mode: str, gen: float, longest: int, round_: int) -> dict:
        return _emulated(_run(mode, gen, 25.0, 50.0, round_, **{"response_length/max": longest}), 1000, 0)

    runs = [run("v1_async_bound", 30.0, 1000, r) for r in range(3)]
    runs += [run("default", 20.0, 1000, r) for r in range(3)]  # the longer tail: the lower ceiling
    runs += [run("default_extra", 25.0, 400, r) for r in range(3)]
    runs += [run("kimi", 1.0, 50, r) for r in range(3)]
    results = {"workload": dataclasses.asdict(wl), "engines": EMULATED, "runs": runs}
    by_mode = peer.by_mode(results, "cpu")
    per_mode = {name: peer.ceiling_ratios(by_mode["v1_async_bound"], by_mode[name]) for name in by_mode}
    assert per_mode["default"][0] < per_mode["default_extra"][0] < per_mode["kimi"][0]
    best = next(o for o in peer.goal_outcomes(results, "cpu") if o.ours == peer.BEST)
    assert best.ceiling == pytest.approx(per_mode["default_extra"])
    goal = dataclasses.replace(best, goal=(per_mode["default"][0] + per_mode["default_extra"][0]) / 2)
    assert "out of reach" not in goal.short()
    above = dataclasses.replace(best, goal=1.01 * max(best.ceiling))
    assert "out of reach" in above.short()


def test_fixed_costs_are_shares_of_the_phase_they_sit_in(peer: ModuleType) -> None:
    wl = peer.Workload(steps=3)
    results = {"workload": dataclasses.asdict(wl), "runs": [
        _stamped(_run("default", 5.0, 10.0, 50.0, **{"partial/step_end_s": 0.5, "timing_s/update_weights": 0.2}),
                 [["weights", 1, 0.0], ["sleep", 1, 5.3], ["weights", 2, 10.0], ["sleep", 2, 15.3],
                  ["weights", 3, 20.0]]),
        _run("v1_sync", 10.0, 20.0, 50.0, **{"timing_s/update_weights": 0.4}),
        _run("v1_sync_fastpoll", 8.0, 18.0, 50.0, **{"timing_s/update_weights": 0.4}),
        _run("v1_async_bound", 10.0, 20.0, 50.0, round_=1),  # its fast-poll twin ran in no round of its own
    ]}  # fmt: skip
    rows = {line.split(" | ")[0].lstrip("| "): line for line in peer.fixed_costs(results, "cpu_vllm").splitlines()}
    assert "0.50 s (10.0 % of the phase)" in rows["ours `+partial=default`"]  # step end, inside the rollout phase
    assert "0.200 s (2.0 % of the step)" in rows["ours `+partial=default`"]  # weight sync, outside it
    assert rows["v1 sync"].endswith("| 20.0 % of the phase | - | - |")  # (10 - 8) / 10, paired in round 0
    assert rows["v1 colocate_async, threshold 2 + wait"].endswith("| - | - | - |")
    # The engine awake past verl's gen timer, from its stamps: 5.3 s windows around 5.0 s phases (stamps stored
    # without the modelled time: no busy share).
    assert rows["ours `+partial=default`"].endswith("| 300 ms | - |")


def test_runs_merged_from_several_checkouts_name_each_in_the_header() -> None:
    """Rounds are resumed across sessions: the file's own checkout is the last session's, so each run names its own."""
    from benchmarks.bench_peer import checkouts
    from benchmarks.evidence import provenance

    runs = [{"checkout": "aaa"}, {"checkout": "bbb"}, {"checkout": "aaa"}]
    merged = {"checkout": "bbb", "runs": runs, "command": "python -m benchmarks.bench_peer", "machine": {"date": "d"}}
    assert checkouts(merged) == "aaa, bbb"
    assert provenance(merged).commit == "aaa, bbb"  # the evidence page's commit line names both sessions
    assert checkouts({"checkout": "ccc", "runs": [{}]}) == "ccc"  # runs stored before per-run records
    assert checkouts({"runs": [[{"run_id": 1}]]}) is None  # a JSON-lines file's runs are lists of lines


def _stamped(run: dict, marks: list[list]) -> dict:
    return {**run, "engine_stats": [{"steps": 100, "overruns": 0, "modelled_s": 1.0, "marks": marks}]}


def test_the_engines_stamps_time_every_trainers_step_cycle_and_rollout_window(peer: ModuleType) -> None:
    """Step s generates on the weights loaded for s - 1 and ends with the load for s; its rollout window ends at the
    first sleep after that load. v1 generating outside its own timers shows here and nowhere else."""
    wl = peer.Workload(steps=3)
    marks = [["weights", 0, 0.0], ["sleep", 0, 90.0], ["weights", 1, 100.0], ["sleep", 1, 103.0],
             ["weights", 2, 110.0], ["sleep", 2, 115.0], ["weights", 3, 121.0]]  # fmt: skip
    ours = peer.figures(_stamped(_run("default", gen_s=2.0, step_s=5.0, mean_length=50.0), marks), wl)
    assert (ours.cycle_s, ours.window_s) == (pytest.approx((10.0 + 11.0) / 2), pytest.approx((3.0 + 5.0) / 2))
    assert ours.cycle_ms_per_token == pytest.approx(1e3 * 10.5 / 3200)
    # v1 with the same timers and a shorter cycle: the timers call the two level, the wall clock does not.
    faster = [[event, step, at * 0.5] for event, step, at in marks]
    v1 = peer.figures(_stamped(_run("v1_async_bound", gen_s=2.0, step_s=5.0, mean_length=50.0), faster), wl)
    assert peer.ratios([v1], [ours], "step") == [pytest.approx(1.0)]
    assert peer.ratios([v1], [ours], "cycle") == [pytest.approx(0.5)]
    assert peer.ratios([v1], [ours], "window") == [pytest.approx(0.5)]


@pytest.mark.parametrize(
    "marks",
    [
        [],  # verl's vLLM, or a run stored before the stamps
        [["weights", 1, 100.0], ["sleep", 1, 103.0], ["weights", 2, 110.0]],  # step 3 never ended
        [["weights", 1, 100.0], ["weights", 2, 110.0], ["sleep", 2, 111.0], ["weights", 3, 120.0]],  # no sleep in 2
    ],
)
def test_a_run_without_every_stamp_gives_no_wall_clock_figure(peer: ModuleType, marks: list[list]) -> None:
    wl = peer.Workload(steps=3)
    run = peer.figures(_stamped(_run("default", gen_s=2.0, step_s=5.0, mean_length=50.0), marks), wl)
    assert (run.cycle_s, run.window_s) == (None, None)
    assert peer.ratios([run], [run], "cycle") == [] and peer.ratios([run], [run], "rollout") == [1.0]


def test_checkout_names_changed_code_but_not_the_results_a_run_merges_into(
    peer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run merging its rounds into benchmarks/results/ must not record its own output as a code change, while a
    changed benchmark script is named."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "bench.py").write_text("a = 1\n")
    (tmp_path / "benchmarks" / "results" / "peer.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "base")
    monkeypatch.setattr(peer, "REPO", tmp_path)
    (tmp_path / "benchmarks" / "results" / "peer.json").write_text('{"runs": []}\n')
    assert "uncommitted" not in peer.checkout()
    (tmp_path / "benchmarks" / "bench.py").write_text("a = 2\n")
    assert peer.checkout().endswith("with uncommitted changes to benchmarks/bench.py")


def test_the_floor_factors_multiply_to_the_phase_over_the_floor(peer: ModuleType) -> None:
    """Engine steps over the tail floor's, modelled step over the floor's per tail step, and phase over the engine's
    modelled time: each from the run's own counters, and together exactly the phase over the staleness floor."""
    wl = peer.Workload(steps=3)
    gpu = peer.EmulatedGpu.parse("H200-SXM/Qwen2.5-32B")
    run = _run("default", gen_s=2.2, step_s=3.0, mean_length=50.0, **{"partial/engine/steps": 120.0})
    run["engine_stats"] = [{"modelled_s": 30.0, "steps": 1500}]  # 20 ms an engine step
    steps_over, step_cost_over, phase_over = peer.floor_factors(run, wl, gpu)
    assert steps_over == pytest.approx(120.0 / (4 * 50.0 / 2))  # the longest answer, 200 tokens, over 2 phases
    assert phase_over == pytest.approx(2.2 / (120.0 * 0.02))
    assert steps_over * step_cost_over * phase_over == pytest.approx(2.2 / peer.staleness_floor(run, wl, gpu))
    verl_trainer = _run("v1_async_bound", gen_s=2.2, step_s=3.0, mean_length=50.0)
    verl_trainer["engine_stats"] = run["engine_stats"]
    assert peer.floor_factors(verl_trainer, wl, gpu) is None  # no engine steps per phase logged


def test_the_busy_share_of_the_rollout_window_comes_from_the_stamps_modelled_time(peer: ModuleType) -> None:
    """Measured steps only (step 1's start-up is not in it): the modelled engine time between each window's weight
    load and sleep, over the windows. A stamp without the modelled time (stored before it) gives no figure."""
    marks = [["weights", 0, 0.0, 0.0], ["sleep", 0, 90.0, 3.0], ["weights", 1, 100.0, 3.0], ["sleep", 1, 103.0, 5.7],
             ["weights", 2, 110.0, 5.7], ["sleep", 2, 115.0, 10.2], ["weights", 3, 121.0, 10.2]]  # fmt: skip
    run = _stamped(_run("default", gen_s=2.0, step_s=5.0, mean_length=50.0), marks)
    assert peer.window_busy_share(run, 2) == pytest.approx((2.7 + 4.5) / (3.0 + 5.0))
    assert peer.fixed_costs({"workload": dataclasses.asdict(peer.Workload(steps=3)),
                             "runs": [{**run, "engine": "cpu"}]}, "cpu").endswith("| 0.90 |")  # fmt: skip
    stored_before = _stamped(run, [mark[:3] for mark in marks])
    assert peer.window_busy_share(stored_before, 2) is None
    assert peer.stamped_seconds(stored_before, 2) == peer.stamped_seconds(run, 2)  # the clock figures are unchanged


def test_the_engine_work_per_trained_token_comes_from_the_stamps_of_the_measured_windows(peer: ModuleType) -> None:
    """Engine steps, modelled seconds and the prefill's part, between each measured window's weight load and sleep:
    step 1's start-up and the work after a window's sleep (v1 generating on past its timers) are left out. Stamps
    stored before the prefill and step fields give no figure, and the report then has no such table."""
    marks = [["weights", 0, 0.0, 0.0, 0.0, 0], ["sleep", 0, 90.0, 3.0, 1.0, 50],
             ["weights", 1, 100.0, 3.5, 1.1, 70], ["sleep", 1, 103.0, 6.5, 1.4, 200],
             ["weights", 2, 110.0, 7.0, 1.4, 230], ["sleep", 2, 115.0, 12.0, 2.5, 500],
             ["weights", 3, 121.0, 12.0, 2.5, 500]]  # fmt: skip
    run = _stamped(_run("default", gen_s=2.0, step_s=5.0, mean_length=50.0), marks)
    steps, modelled, prefill = peer.window_engine_work(run, 2)
    assert (steps, modelled, prefill) == (pytest.approx((130 + 270) / 2), pytest.approx(4.0), pytest.approx(0.7))
    results = {"workload": dataclasses.asdict(peer.Workload(steps=3)), "runs": [{**run, "engine": "cpu"}]}
    # 3,200 trained tokens a step: 62.5 engine steps per 1k of them, 1.25 modelled ms each, 17.5 % of it prefill
    assert peer.engine_work(results, "cpu").endswith("| 1 | 62.5 | 1.250 | 0.175 |")
    stored_before = _stamped(run, [mark[:4] for mark in marks])
    assert peer.window_engine_work(stored_before, 2) is None
    assert peer.engine_work({**results, "runs": [{**stored_before, "engine": "cpu"}]}, "cpu") is None


def test_every_mode_gets_its_phase_over_the_floor_of_its_own_batches(peer: ModuleType) -> None:
    """verl's trainers log no engine steps per phase, so their row gives the floor and the phase over it without the
    split; ours give the split, whose product is the same figure. The floors differ where the batches do."""
    wl = peer.Workload(steps=3)
    gpu = peer.EmulatedGpu.parse("H200-SXM/Qwen2.5-32B")
    ours = _run("default", gen_s=2.2, step_s=3.0, mean_length=50.0, **{"partial/engine/steps": 120.0})
    ours["engine_stats"] = [{"modelled_s": 30.0, "steps": 1500, "overruns": 0}]
    theirs = _run("v1_async_bound", gen_s=2.6, step_s=3.5, mean_length=50.0)
    theirs["engine_stats"] = ours["engine_stats"]
    theirs["steps"]["2"] = {**theirs["steps"]["2"], "response_length/max": 250.0}  # one longer answer in a step
    override = "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_PARTIAL_EMULATE_GPU=H200-SXM/Qwen2.5-32B"
    results = {"workload": dataclasses.asdict(wl), "engines": {"cpu": {"overrides": [override]}},
               "runs": [{**run, "engine": "cpu"} for run in (ours, theirs)]}  # fmt: skip
    assert peer.emulated_gpu(results, "cpu") == gpu
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ")[1:] for line in peer.floor_gap(results, "cpu").splitlines()
            if line.startswith("| `")}  # fmt: skip
    floors = {run["mode"]: peer.staleness_floor(run, wl, gpu) for run in (ours, theirs)}
    assert floors["v1_async_bound"] > floors["default"]
    for mode, gen_s in (("default", 2.2), ("v1_async_bound", 2.6)):
        assert rows[mode][1] == f"{1e3 * floors[mode] / 3200:.3f}"
        assert rows[mode][-1].rstrip(" |") == f"{gen_s / floors[mode]:.3f}"
    assert rows["v1_async_bound"][2:5] == ["-", "-", "-"]
    steps_over, step_cost_over, phase_over = peer.floor_factors(ours, wl, gpu)
    assert rows["default"][2:5] == [f"{steps_over:.3f}", f"{step_cost_over:.3f}", f"{phase_over:.3f}"]
