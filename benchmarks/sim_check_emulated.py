"""The simulator against the emulated engine: predicted beside measured rollout phase per trained token, every mode.

    python -m benchmarks.sim_check_emulated --peer benchmarks/results/peer_emulated_prefix.json --prompt-len 31 \\
        --json benchmarks/results/sim_check_prefix.json

The emulated engine (``bench_peer.py`` on our CPU engine with ``VERL_PARTIAL_EMULATE_GPU``) and the simulator
(``verl_partial/sim``) share the hardware curve (``ServerSpec.step_seconds``), so this checks the scheduler model, the
simulated engine's batching and what the simulator leaves out (the trainer's real-clock costs inside ``timing_s/gen``:
Ray calls, the step end, re-prefill on a CPU), not the GPU curve. The simulator's parameters are frozen here, before
the comparison, and nothing is fitted: the workload is the peer benchmark's (its batch, samples, slots, lognormal
lengths with the same median, sigma and cap, independent per sample, correlated between epochs as the benchmark drew
them), the step-time model is the emulated GPU's, and each mode is the same ``PartialConfig`` the trainer ran. Seeds
vary the simulated length draws (the benchmark's draws are fixed by its hash); the prediction is given over seeds as
mean (min-max). v1 modes have no simulator model.

Each mode is predicted twice: with vLLM's prefix cache (a group's samples share their prompt's whole cached blocks) and
without it (every request prefills its whole context). The like-for-like check is the one the emulated engine ran:
its counters say whether its steps were charged behind the prefix cache (verl's ``rollout.enable_prefix_caching``, on
by default; runs from before the engine modelled it had none); the other shows what that difference costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks._machine import git_commit, machine
from benchmarks.bench_peer import (
    KNEE_CALLS,
    MODES,
    by_mode,
    emulated_gpu,
    kept_runs,
    merge_results,
    prefix_cached,
    window_busy_share,
    workload_of,
)
from verl_partial.config.partial import CALLS_PER_SERVER_CEILING, PRESETS, PartialConfig
from verl_partial.sim.engine import ServerSpec
from verl_partial.sim.run import ceiling, mode_configs, simulate
from verl_partial.sim.workload import Workload as SimWorkload

SEEDS = (0, 1, 2, 3, 4)
# A miss larger than this is explained in the report, not fitted away (the 10 %).
TOLERANCE = 0.10
# The normal quantile of p99: the simulator takes lognormal lengths as p50 and p99/p50.
Z99 = 2.3263478740408408


def sim_configs(batch: int) -> dict[str, PartialConfig]:
    """Each peer mode the trainer ran with our scheduler, as the simulator runs it (stall checks off: the simulated
    engine never hangs; each simulated server reports its KV cache, as the emulated engine does)."""
    modes = mode_configs(batch)
    default = modes["default"]
    return {
        "v0_sync": modes["sync"],
        # The same synchronous rollout; :func:`_simulate` gives it ``PeerMode.batch_scale`` times the prompts a step.
        "v0_sync_x2": modes["sync"],
        "default": default,
        "default_by_groups": dataclasses.replace(default, fill_engine=False),
        "default_extra": dataclasses.replace(default, refill=False, extra_groups=batch),
        "default_kv_off": dataclasses.replace(default, kv_tokens_per_server="off"),
        "default_knee": dataclasses.replace(default, max_calls_per_server=KNEE_CALLS),
        "default_uncapped": dataclasses.replace(default, max_calls_per_server=CALLS_PER_SERVER_CEILING),
        **{name: modes[name] for name in ("on_policy", "kimi", "restart", "tail", "tail_on_policy") if name in PRESETS},
    }


def as_run(config: PartialConfig, results: dict[str, Any], mode: str) -> PartialConfig:
    """``config`` as the mode's runs had it: runs made before ``partial.max_calls_per_server=auto`` (no step logs
    ``partial/server_load/calls_knee``) capped calls at the old default, 512, not at the GPU's knee."""
    if config.max_calls_per_server != "auto":
        return config
    logged = any(
        "partial/server_load/calls_knee" in step
        for run in results["runs"]
        if run["mode"] == mode
        for step in run.get("steps", {}).values()
    )
    return config if logged else dataclasses.replace(config, max_calls_per_server=CALLS_PER_SERVER_CEILING)


# The engine's composition, whole run (warm-up included: the counters are cumulative), per trained token: the same
# four figures from the emulated engine's counters and from the simulated servers'. Where the simulator misses the
# engine's own busy time, these say which part of the step stream differs.
ENGINE_FIGURES = {
    "busy_ms": "engine busy ms / trained token",
    "steps_per_k": "engine steps / 1k trained tokens",
    "rows_per_step": "decoded rows / engine step",
    "prefill_per_token": "prefilled tokens / trained token",
}


def _engine_figures(busy_s: float, steps: int, decoded: int, prefilled: int, trained: float) -> dict[str, float]:
    return {
        "busy_ms": 1e3 * busy_s / trained,
        "steps_per_k": 1e3 * steps / trained,
        "rows_per_step": decoded / steps,
        "prefill_per_token": prefilled / trained,
    }


def measured_engine(results: dict[str, Any], engine: str, mode: str) -> list[dict[str, float]]:
    """Per run that gives figures (:func:`~benchmarks.bench_peer.kept_runs`), :data:`ENGINE_FIGURES` from the
    emulated engine's counters (its modelled time, not the overruns: both sides then share one step-time model)."""
    out = []
    wl = workload_of(results)
    samples = MODES[mode].prompts_per_step(wl) * wl.n
    for run in (run for run in kept_runs(results, engine) if run["mode"] == mode):
        stats = run.get("engine_stats") or []
        trained = sum(float(step["response_length/mean"]) for step in run["steps"].values()) * samples
        if stats and trained > 0:
            total = {
                key: sum(s[key] for s in stats) for key in ("modelled_s", "steps", "decode_tokens", "prefill_tokens")
            }
            out.append(_engine_figures(total["modelled_s"], total["steps"], total["decode_tokens"],
                                       total["prefill_tokens"], trained))  # fmt: skip
    return out


def simulated_engine(run: Any) -> dict[str, float]:
    """:data:`ENGINE_FIGURES` of a whole simulated run (``ModeRun`` before ``steady``)."""
    stats = run.engine
    return _engine_figures(stats.busy_seconds, stats.decode_steps + stats.prefill_steps, stats.tokens,
                           stats.prefill_tokens, float(sum(run.tokens_trained)))  # fmt: skip


Prediction = tuple[dict[str, list[float]], list[float], dict[str, list[dict[str, float]]]]


def _server(results: dict[str, Any], engine: str, prefix_cache: bool) -> ServerSpec:
    """The emulated GPU's simulated server at the benchmark's slots."""
    gpu = emulated_gpu(results, engine)
    if gpu is None:
        raise SystemExit(f"{engine}: the results hold no emulated GPU override; nothing to simulate")
    return dataclasses.replace(gpu.server_spec(workload_of(results).slots), prefix_cache=prefix_cache)


def _simulate(
    results: dict[str, Any],
    config: PartialConfig,
    spec: ServerSpec,
    prompt_len: int,
    seed: int,
    batch_scale: int = 1,
    **options: Any,
) -> tuple[Any, Any, SimWorkload]:
    """One seed of the benchmark's workload under ``config``: the whole simulated run, its measured steps, and the
    simulated workload (the peer benchmark's batch, times ``batch_scale`` as the mode's ``PeerMode`` asks, samples,
    slots and lognormal lengths; ``options`` go to ``simulate``)."""
    wl = workload_of(results)
    batch = wl.prompts * batch_scale
    # Within one epoch every correlation gives the same lengths' law; runs that stay in one keep the draws they were
    # first checked with (``sample_epoch_corr=0``), runs that span epochs get the benchmark's correlation.
    spans_epochs = wl.steps * batch > wl.train_rows
    sim_wl = SimWorkload(
        batch=batch,
        n=wl.n,
        p50=wl.lengths.median,
        p99_over_p50=math.exp(Z99 * wl.lengths.sigma),
        response_length=wl.lengths.cap,
        prompt_len=prompt_len,
        prompts=wl.train_rows,
        prompt_share=0.0,
        seed=seed,
        sample_epoch_corr=wl.lengths.epoch_corr if spans_epochs else 0.0,
    )
    whole = simulate(config, sim_wl, spec, servers=1, steps=wl.steps, **options)
    return whole, whole.steady(wl.first_measured - 1), sim_wl


def _ms_per_token(run: Any) -> float:
    return 1e3 * sum(run.seconds) / sum(run.tokens_trained)


def predict(results: dict[str, Any], engine: str, prompt_len: int, prefix_cache: bool = True) -> Prediction:
    """Rollout ms per trained token per mode and seed, over the benchmark's measured steps; and per seed, the highest
    rollout speed-up over sync that any colocated schedule at staleness <= 1 could reach on the batches ``default``
    trained (``verl_partial.sim.run.ceiling``: the bound covers those batch compositions, not regrouped ones); and per
    mode, :data:`ENGINE_FIGURES` of each seed's whole simulated run. ``prefix_cache``: the simulated servers'
    (``ServerSpec.prefix_cache``)."""
    spec = _server(results, engine, prefix_cache)
    out: dict[str, list[float]] = {}
    engines: dict[str, list[dict[str, float]]] = {}
    runs: dict[tuple[str, int], Any] = {}
    for name, config in sim_configs(workload_of(results).prompts).items():
        if name not in {run["mode"] for run in results["runs"]}:
            continue
        config = as_run(config, results, name)
        for seed in SEEDS:
            whole, run, sim_wl = _simulate(results, config, spec, prompt_len, seed, MODES[name].batch_scale)
            out.setdefault(name, []).append(_ms_per_token(run))
            runs[name, seed] = (run, sim_wl)
            engines.setdefault(name, []).append(simulated_engine(whole))
    bounds = [
        ceiling(runs["v0_sync", seed][0], runs["default", seed][0], runs["default", seed][1], spec, 1, max_staleness=1)
        for seed in SEEDS
        if ("v0_sync", seed) in runs and ("default", seed) in runs
    ]
    return out, bounds, engines


#: What-ifs of :func:`what_if_gain`: the report key of each, and what it changes (``simulate`` options, server spec).
WHAT_IFS: dict[str, tuple[str, dict[str, bool], dict[str, bool]]] = {
    "clairvoyant": ("clairvoyant_launch_gain", {"clairvoyant": True}, {}),
    "keep_cache": ("cache_kept_gain", {}, {"keep_cache_on_update": True}),
}


def what_if_gain(
    results: dict[str, Any], engine: str, prompt_len: int, prefix_cache: bool, fifo: list[float], what_if: str
) -> list[float]:
    """Per seed, ``default``'s simulated rollout ms per trained token (``fifo``: :func:`predict`'s, with the same
    ``prefix_cache``) over the same run's under a what-if no verl scheduler or server runs. ``clairvoyant``: launches
    ordered by the answers' true remaining lengths, longest first (``simulate(clairvoyant=True)``), what launch order
    alone could add (1.0 where no sample ever waits to be launched). ``keep_cache``: the prefix cache survives the
    weight sync (``ServerSpec.keep_cache_on_update``), what re-prefilling parked answers after it costs."""
    _, options, spec_changes = WHAT_IFS[what_if]
    spec = dataclasses.replace(_server(results, engine, prefix_cache), **spec_changes)
    config = as_run(sim_configs(workload_of(results).prompts)["default"], results, "default")
    return [
        ms / _ms_per_token(_simulate(results, config, spec, prompt_len, seed, **options)[1])
        for ms, seed in zip(fifo, SEEDS, strict=True)
    ]


def busy_share(results: dict[str, Any], engine: str, mode: str) -> tuple[list[float], bool]:
    """Per run, the engine's modelled step time over the trainer's rollout time: the share of the phase the simulator
    models at all. The rest is the engine idle inside the phase (Ray, the agent loops, the step end, weight sync
    hand-off), which the simulator leaves out. True beside the shares where they are steady: every run's engine
    stamps carry the modelled time (runs from ``f010c68`` on), so the share is over the measured steps' rollout
    windows (``bench_peer.window_busy_share``), the same measure for every trainer. Otherwise (False) it is over
    every step from the cumulative counters, so it also counts the first step's start-up (the first round trip to the
    servers, seconds: in v0 sync's phase and, since ``bd29dc7``, in ours; v1 warms up outside its timers), and the
    counters, written every 200 engine steps, may miss a run's last few seconds."""
    runs = [run for run in kept_runs(results, engine) if run["mode"] == mode]
    steady = [window_busy_share(run, workload_of(results).first_measured) for run in runs]
    if runs and all(share is not None for share in steady):
        return [share for share in steady if share is not None], True
    shares = []
    for run in runs:
        phase = sum(float(step["timing_s/gen"]) for step in run["steps"].values() if "timing_s/gen" in step)
        modelled = sum(stats["modelled_s"] for stats in run.get("engine_stats", []))
        if phase > 0 and modelled > 0:
            shares.append(modelled / phase)
    return shares, False


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def compare(results: dict[str, Any], engine: str, prompt_len: int, what_ifs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Predicted beside measured for every mode, the ceiling, and each of ``what_ifs`` (:func:`what_if_gain`) where
    a ``default`` run is there to change."""
    cached = prefix_cached(results, engine)
    predicted, bounds, with_cache = predict(results, engine, prompt_len)
    as_engine, _, without_cache = predict(results, engine, prompt_len, prefix_cache=False)
    simulated = with_cache if cached else without_cache
    simulated_ms = predicted if cached else as_engine
    measured = {name: [r.gen_ms_per_token for r in runs] for name, runs in by_mode(results, engine).items()}
    rows = []
    for name in [m for m in MODES if m in measured or m in predicted]:
        shares, steady = busy_share(results, engine, name)
        row: dict[str, Any] = {
            "mode": name,
            "measured": measured.get(name),
            "predicted": predicted.get(name),
            "predicted_as_engine": as_engine.get(name),
            "engine_busy_share": shares,
            "engine_busy_share_steady": steady,
            "engine": {"measured": measured_engine(results, engine, name), "simulated": simulated.get(name, [])},
        }
        for key, prediction in (("miss", "predicted"), ("miss_as_engine", "predicted_as_engine")):
            if row["measured"] and row[prediction]:
                row[key] = statistics.fmean(row[prediction]) / statistics.fmean(row["measured"]) - 1.0
        rows.append(row)
    return {
        "engine": engine,
        "prompt_len": prompt_len,
        "engine_prefix_cache": cached,
        "seeds": list(SEEDS),
        "rows": rows,
        "ceiling_vs_sync": bounds,
        **{
            WHAT_IFS[what_if][0]: what_if_gain(results, engine, prompt_len, cached, simulated_ms["default"], what_if)
            for what_if in what_ifs
            if "default" in simulated_ms
        },
    }


def like_for_like(report: dict[str, Any]) -> tuple[str, str, str]:
    """The row keys of the prediction made as the emulated engine ran, of its miss, and of the other setting's miss
    (``predicted``/``miss``: with the prefix cache; ``predicted_as_engine``/``miss_as_engine``: without)."""
    if report.get("engine_prefix_cache", False):
        return "predicted", "miss", "miss_as_engine"
    return "predicted_as_engine", "miss_as_engine", "miss"


def table(report: dict[str, Any]) -> str:
    """Predicted beside measured, per mode (the evidence page's table; :func:`engine_table` follows it on the
    command's output)."""
    prediction_key, miss_key, other_key = like_for_like(report)
    ran, other = ("with", "without") if report.get("engine_prefix_cache", False) else ("without", "with")
    lines = [
        f"| mode | measured rollout ms / trained token (rounds) | simulated {ran} vLLM's prefix cache, as the emulated "
        f"engine (seeds) | simulated / measured - 1 | {other} it, simulated / measured - 1 | measured: engine "
        f"busy share of the {_busy_scope(report)} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        prediction = row.get(prediction_key)
        if not prediction:  # v1 modes: no simulator model (their busy share is in the peer figures)
            continue
        lines.append(
            f"| `{row['mode']}` | {spread(row['measured']) if row['measured'] else 'not run'} | "
            f"{spread(prediction)} | {_miss(row.get(miss_key))} | "
            f"{_miss(row.get(other_key))} | "
            f"{spread(row['engine_busy_share']) if row['engine_busy_share'] else '-'} |"
        )
    return "\n".join(lines)


def _busy_scope(report: dict[str, Any]) -> str:
    """What the busy-share column covers: the measured steps' rollout windows where every row's runs were stamped
    with the modelled time, else the whole run (reports written before that record neither)."""
    rows = [row for row in report["rows"] if row.get("engine_busy_share")]
    if rows and all(row.get("engine_busy_share_steady", False) for row in rows):
        return "rollout windows, measured steps"
    return "phase, whole run"


def _miss(miss: float | None) -> str:
    """The miss in whole percent; one that rounds to 0 reads "+0%", never "-0%"."""
    if miss is None:
        return "-"
    text = f"{miss:+.0%}"
    return ("+0%" if text == "-0%" else text) + ("" if abs(miss) <= TOLERANCE else " (over 10 %)")


def engine_table(report: dict[str, Any]) -> list[str]:
    """Where a miss sits: the emulated engine's step stream beside the simulated servers', whole runs, per trained
    token (measured over rounds, simulated over seeds); rows without both sides are left out."""
    rows = [row for row in report["rows"] if row.get("engine", {}).get("measured") and row["engine"]["simulated"]]
    if not rows:
        return []
    lines = [
        "The engine itself, whole runs (warm-up included), measured (emulated engine's counters, modelled time) / "
        f"simulated {'with' if report.get('engine_prefix_cache', False) else 'without'} a prefix cache:",
        "",
        "| mode | " + " | ".join(ENGINE_FIGURES.values()) + " |",
        "|---|" + "---:|" * len(ENGINE_FIGURES),
    ]
    for row in rows:
        cells = []
        for key in ENGINE_FIGURES:
            measured = statistics.fmean(r[key] for r in row["engine"]["measured"])
            simulated = statistics.fmean(r[key] for r in row["engine"]["simulated"])
            cells.append(f"{measured:.3g} / {simulated:.3g}")
        lines.append(f"| `{row['mode']}` | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", type=Path, nargs="+", required=True, help="bench_peer results (merged)")
    parser.add_argument("--engine", default="cpu")
    parser.add_argument("--prompt-len", type=int, required=True, help="the benchmark's mean prompt tokens")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--clairvoyant", action="store_true", help="also what launch order alone could add to default")
    parser.add_argument("--keep-cache", action="store_true",
                        help="also what default would gain if the prefix cache survived the weight sync")  # fmt: skip
    args = parser.parse_args(argv)
    results = merge_results(args.peer)
    what_ifs = tuple(name for name, on in (("clairvoyant", args.clairvoyant), ("keep_cache", args.keep_cache)) if on)
    report = compare(results, args.engine, args.prompt_len, what_ifs)
    report.update(
        command="python -m benchmarks.sim_check_emulated " + " ".join(sys.argv[1:] if argv is None else argv),
        machine=machine(),
        commit=git_commit(),
        peer=[str(path) for path in args.peer],
    )
    print(table(report), "", *engine_table(report), sep="\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
