"""The GPU simulator's engine model against hand-computed figures (docs/method/gpu-simulator.md); milliseconds each."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import re
import selectors
from pathlib import Path

import numpy as np
import pytest
import verl

from verl_partial.core.engines.prefix_cache import BLOCK_TOKENS
from verl_partial.core.partial.finish import Finish
from verl_partial.sim.backend import SimBackend
from verl_partial.sim.cli import main
from verl_partial.sim.clock import run_virtual
from verl_partial.sim.engine import ServerSpec, SimServer, lognormal_sigma
from verl_partial.sim.hardware import H20, H100_SXM, QWEN25_7B, QWEN25_32B, Efficiency, GpuSpec, ModelSpec
from verl_partial.sim.run import mode_configs, simulate
from verl_partial.sim.stats import ks_distance
from verl_partial.sim.workload import Workload


def test_kv_bytes_per_token_from_config_json():
    # 2 (K and V) x layers x kv_heads x head_dim x 2 bytes (bf16)
    assert QWEN25_7B.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344
    assert QWEN25_32B.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144


def test_decode_step_is_memory_bound_at_one_request_on_h100():
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    # (15.22e9 weight bytes + 57,344 x 1,000 KV bytes) / (3.35e12 B/s x 0.70) = 6.5148 ms;
    # compute is (1.522e10 + 4.014e8) FLOPs / (989e12 x 0.50) = 0.032 ms.
    assert spec.step_seconds(1, 1_000) == pytest.approx(15.277344e9 / 2.345e12, rel=1e-9)
    assert spec.step_seconds(1, 1_000) == pytest.approx(6.5148e-3, rel=1e-4)


def test_decode_step_is_the_sum_of_its_phases_rooflines_on_h20():
    spec = ServerSpec(H20, QWEN25_7B)
    # linear layers: weights 15.22e9 B / (4.0e12 x 0.7) = 5.44 ms; compute 2 x 7.61e9 x 256 / (148e12 x 0.5) = 52.65 ms
    # attention: KV 57,344 x 256,000 B / (4.0e12 x 0.7) = 5.24 ms; compute 4 x 28 x 28 x 128 x 256,000 / 74e12 = 1.39 ms
    linear, attention = 2 * 7.61e9 * 256 / (148e12 * 0.5), 57_344 * 256_000 / (4.0e12 * 0.7)
    assert spec.step_seconds(256, 256_000) == pytest.approx(linear + attention, rel=1e-9)
    assert linear + attention == pytest.approx(57.89e-3, rel=1e-3)
    # One max over summed bytes and FLOPs would hide the KV reads under the linear layers' compute (54.04 ms).
    assert spec.step_seconds(256, 256_000) > (2 * 7.61e9 * 256 + 4 * 28 * 28 * 128 * 256_000) / (148e12 * 0.5)


def test_step_overhead_adds_a_fixed_cost_to_every_step():
    base, slow = ServerSpec(H100_SXM, QWEN25_7B), ServerSpec(H100_SXM, QWEN25_7B, step_overhead_s=0.003)
    assert slow.step_seconds(4, 4_000) == pytest.approx(base.step_seconds(4, 4_000) + 0.003)
    assert slow.decode_seconds(4, 4_000, 10)[-1] == pytest.approx(base.decode_seconds(4, 4_000, 10)[-1] + 0.03)


def test_tensor_parallel_divides_a_step_across_gpus():
    one, two = ServerSpec(H100_SXM, QWEN25_32B, tp=2), ServerSpec(H100_SXM, QWEN25_32B, tp=4)
    assert two.step_seconds(8, 8_000) == pytest.approx(one.step_seconds(8, 8_000) / 2)


def test_kv_capacity_is_usable_hbm_minus_weights_over_bytes_per_token():
    # (80e9 x 0.80 - 3e9 reserve) - 15.22e9 weights = 45.78e9 bytes / 57,344 = 798,339.8 -> 798,339 tokens
    assert ServerSpec(H100_SXM, QWEN25_7B).kv_capacity_tokens == 798_339
    # 32B on two GPUs: 2 x (64e9 - 3e9) - 65.0e9 = 57.0e9 / 262,144 = 217,437 tokens
    assert ServerSpec(H100_SXM, QWEN25_32B, tp=2).kv_capacity_tokens == 217_437
    with pytest.raises(ValueError, match="does not fit"):
        ServerSpec(H100_SXM, QWEN25_32B, tp=1)


def test_throughput_limit_uses_full_concurrency():
    spec = ServerSpec(H100_SXM, QWEN25_7B, max_num_seqs=256)
    assert spec.throughput_limit(2_000) == pytest.approx(256 / spec.step_seconds(256, 512_000))
    # The KV cache, not max_num_seqs, caps a 32B server at long contexts: 217,437 // 20,000 = 10 requests.
    big = ServerSpec(H100_SXM, QWEN25_32B, tp=2)
    assert big.throughput_limit(20_000) == pytest.approx(10 / big.step_seconds(10, 200_000))


def _serve(spec: ServerSpec, requests: list[tuple[int, int]], max_new: int = 10_000, prompt_len: int = 10):
    """Submit (prefix, eos_after) requests of one prompt at t=0; return (outcomes, virtual seconds, server)."""

    async def main():
        server = SimServer(spec, "s")
        futures = [
            server.submit("p", f"p/{i}", prompt_len, prefix, eos, max_new) for i, (prefix, eos) in enumerate(requests)
        ]
        outcomes = await asyncio.gather(*futures)
        return outcomes, asyncio.get_running_loop().time(), server

    return run_virtual(main())


def test_one_request_costs_its_prefill_plus_the_sum_of_its_decode_steps():
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    outcomes, seconds, server = _serve(spec, [(100, 50)])
    assert outcomes[0].tokens == 50 and outcomes[0].finish is Finish.EOS
    prefill = spec.step_seconds(0, 0, 100, 100 * 50)  # one chunk of 100 tokens samples the first token
    decode = sum(spec.step_seconds(1, 101 + k) for k in range(49))
    assert seconds == pytest.approx(prefill + decode, rel=1e-9)
    assert server.stats.tokens == 50 and server.stats.decode_steps == 49


def test_continuous_batching_refills_a_finished_slot_at_once():
    spec = ServerSpec(H100_SXM, QWEN25_7B, max_num_seqs=2)
    outcomes, seconds, _ = _serve(spec, [(10, 5), (10, 100), (10, 5)])
    assert [o.tokens for o in outcomes] == [5, 100, 5]
    # The third request runs beside the long one once the first ends: the whole is ~ the long one alone.
    _, alone, _ = _serve(spec, [(10, 100)])
    assert seconds < alone * 1.2


def test_kv_capacity_caps_concurrency_and_preempts_the_newest():
    tiny = GpuSpec("tiny", hbm_bytes=20e9, hbm_bandwidth=1e12, bf16_flops=1e15)
    spec = ServerSpec(tiny, QWEN25_7B, gpu_memory_utilization=1.0, activation_reserve_bytes=0.0)
    capacity = spec.kv_capacity_tokens  # (20e9 - 15.22e9) / 57,344 = 83,356 tokens
    assert capacity == 83_356
    # Four requests that each grow to 30k tokens cannot all hold their KV: someone waits or is preempted.
    outcomes, seconds, server = _serve(spec, [(1_000, 29_000)] * 4, max_new=30_000)
    assert all(o.tokens == 29_000 and o.finish is Finish.EOS for o in outcomes)
    assert server.stats.preemptions >= 1
    roomy = ServerSpec(tiny, QWEN25_7B, gpu_memory_utilization=1.0, activation_reserve_bytes=0.0, max_num_seqs=256)
    assert roomy.kv_capacity_tokens == capacity
    # Same work on an engine whose cache holds everything (bigger HBM, same bandwidth): faster.
    big = ServerSpec(
        GpuSpec("big", 40e9, 1e12, 1e15), QWEN25_7B, gpu_memory_utilization=1.0, activation_reserve_bytes=0
    )
    _, unconstrained, big_server = _serve(big, [(1_000, 29_000)] * 4, max_new=30_000)
    assert big_server.stats.preemptions == 0 and unconstrained < seconds


@pytest.mark.parametrize("kept", [False, True])
def test_prefix_cache_survives_abort_but_not_a_weight_update_unless_the_what_if_keeps_it(kept: bool):
    spec = ServerSpec(H100_SXM, QWEN25_7B, keep_cache_on_update=kept)

    async def main():
        loop = asyncio.get_running_loop()
        server = SimServer(spec, "s")
        first = server.submit("g", "g/0", 100, 100, 1_000, 1_000)
        await asyncio.sleep(0.5)
        server.abort_all()
        parked = await first
        assert parked.finish is Finish.ABORTED and 0 < parked.tokens < 1_000
        server.resume()
        # Resumed on the same weights: only what follows its last whole block before the last token is recomputed.
        before = server.stats.prefill_tokens
        held = 100 + parked.tokens
        again = server.submit("g", "g/0", 100, held, 1_000 - parked.tokens, 1_000)
        await asyncio.sleep(0.01)
        assert server.stats.prefill_tokens - before == held - (held - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        server.abort_all()
        second = await again
        server.resume()
        server.update_weights()
        # After a weight update the cache is gone: the whole prefix is prefilled again. Kept (a what-if no verl
        # server runs), only what follows the last whole block, as on the same weights.
        held = 100 + parked.tokens + second.tokens
        before = server.stats.prefill_tokens
        third = server.submit("g", "g/0", 100, held, 5, 1_000)
        assert (await third).tokens == 5
        recomputed = held - (held - 1) // BLOCK_TOKENS * BLOCK_TOKENS if kept else held
        assert server.stats.prefill_tokens - before == recomputed
        return loop.time()

    run_virtual(main())


def test_siblings_share_their_prompt_prefill():
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    _, _, server = _serve(spec, [(500, 3)] * 8, prompt_len=500)
    # The first sibling prefills it all; the others hit 31 whole blocks (496 tokens) and recompute the last 4.
    assert server.stats.prefill_tokens == 500 + 7 * 4


def test_without_a_prefix_cache_every_sibling_prefills_its_whole_prompt():
    """Our CPU engine has no prefix cache; the simulator models it so for the check against its emulated runs."""
    cached, uncached = ServerSpec(H100_SXM, QWEN25_7B), ServerSpec(H100_SXM, QWEN25_7B, prefix_cache=False)
    _, shared_s, _ = _serve(cached, [(500, 3)] * 8, prompt_len=500)
    _, alone_s, server = _serve(uncached, [(500, 3)] * 8, prompt_len=500)
    assert server.stats.prefill_tokens == 8 * 500 and server.stats.cached_tokens == 0
    assert alone_s > shared_s


def test_virtual_clock_never_sleeps(monkeypatch):
    # An hour of waiting is a jump of the clock: the OS selector beneath the loop is only ever polled, never asked
    # to block (a positive timeout here is a real sleep, whatever the machine's speed).
    polls: list[float | None] = []
    poll = selectors.DefaultSelector.select

    def recording(self, timeout=None):
        polls.append(timeout)
        return poll(self, timeout)

    monkeypatch.setattr(selectors.DefaultSelector, "select", recording)

    async def main():
        await asyncio.sleep(3_600)
        return asyncio.get_running_loop().time()

    assert run_virtual(main()) == 3_600
    assert polls and set(polls) == {0}


def test_workload_lengths_have_the_requested_tail():
    workload = Workload(batch=8, n=16, p50=1_000, p99_over_p50=8, response_length=10**6, prompts=600)
    lengths = np.array([workload.length(p, f"p{p}", i, 0) for p in range(600) for i in range(16)])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p50 == pytest.approx(1_000, rel=0.05)
    assert p99 / p50 == pytest.approx(8, rel=0.15)
    assert lognormal_sigma(8) == pytest.approx(0.8939, rel=1e-3)
    # A restarted sample, or the prompt in a later epoch, is a new answer; the same attempt is the same answer.
    assert workload.length(3, "p3@e0", 1, 0) == workload.length(3, "p3@e0", 1, 0) != workload.length(3, "p3@e0", 1, 1)
    assert workload.length(3, "p3@e0", 1, 0) != workload.length(3, "p3@e1", 1, 0)


def test_efficiency_factors_are_the_documented_ones():
    assert Efficiency() == Efficiency(bandwidth=0.70, compute=0.50)


def test_real_scheduler_on_the_gpu_model_cuts_the_tail_and_keeps_lengths_unbiased():
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    load = Workload(batch=8, n=4, p50=200, p99_over_p50=20, response_length=8_192, prompts=64)
    configs = mode_configs(load.batch)
    sync = simulate(configs["sync"], load, spec, servers=2, steps=6)
    keep = simulate(configs["keep"], load, spec, servers=2, steps=6).steady(1)
    assert sum(sync.tokens_discarded) == 0 and max(sync.staleness_max) == 0
    assert np.mean(keep.seconds) < np.mean(sync.seconds)
    assert sum(keep.tokens_discarded) == 0 and max(keep.staleness_max) >= 1
    assert all(len(lengths) == 8 * 4 for lengths in keep.trained_lengths)


def test_on_policy_trains_syncs_answers_and_equals_it_when_nothing_queues():
    # The projection's on_policy row is an exact comparison only if, over the same steps, it trains exactly sync's
    # answers; where every request runs at once (max_num_seqs >= requests) the launch order cannot matter either.
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    load = Workload(batch=8, n=4, p50=200, p99_over_p50=20, response_length=8_192, prompts=16)
    configs = mode_configs(load.batch)
    sync = simulate(configs["sync"], load, spec, servers=1, steps=5).steady(2, 3)
    on_policy = simulate(configs["on_policy"], load, spec, servers=1, steps=5).steady(2)
    assert len(sync.seconds) == len(on_policy.seconds) == 3
    for ours, theirs in zip(on_policy.trained_lengths, sync.trained_lengths, strict=True):
        np.testing.assert_array_equal(np.sort(ours), np.sort(theirs))
    np.testing.assert_allclose(on_policy.seconds, sync.seconds, rtol=1e-9)


def test_simulate_command_prints_one_row_per_mode(capsys):
    main(
        [
            "--batch",
            "4",
            "--n",
            "2",
            "--p50",
            "64",
            "--gpus",
            "1",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--modes",
            "sync,restart,on_policy",
            "--response-length",
            "1024",
            "--prompts",
            "8",
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| mode", "| sync", "| restart", "| on_policy"]
    assert rows[0].split(" | ")[-1] == "bound for its own batches at its staleness |"
    # No schedule beats its own floor: sync's bound over itself is at least 1.
    assert float(rows[1].split(" | ")[-1].rstrip(" |x")) >= 1.0
    assert "bound (sync's batch composition) at staleness <= 1" in out
    for row in rows[1:]:  # the mean phase lies between the shortest and the longest
        mean, shortest, longest = (float(cell) for cell in row.split(" | ")[1:4])
        assert shortest <= mean <= longest


def test_ks_distance_is_the_largest_cdf_gap_with_ties_counted_once():
    # CDFs at 1, 2, 3, 4: a = 0.25, 0.75, 1, 1 and b = 0, 0.75, 0.75, 1 -> gaps 0.25, 0, 0.25, 0.
    a, b = np.array([2, 1, 3, 2]), np.array([2, 4, 2, 2])
    assert ks_distance(a, b) == ks_distance(b, a) == pytest.approx(0.25)
    assert ks_distance(a, a.copy()) == 0.0
    assert ks_distance(np.array([1, 1]), np.array([5, 6, 7])) == 1.0


@pytest.mark.parametrize("model", [QWEN25_7B, QWEN25_32B], ids=lambda m: m.name)
def test_the_partial_rollout_guides_compute_knees_are_the_simulators(model: ModelSpec) -> None:
    """The guide tells users to cap calls per server near the GPU's compute knee and names it per GPU: those figures
    must be where the simulator's linear layers turn compute-bound (any model: both terms scale with the weights)."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "partial-rollout.md").read_text()
    stated = re.search(r"(\d+) on an H20, (\d+) on an H100", " ".join(guide.split()))
    assert stated, "the guide no longer names the H20's and H100's compute knees"

    def knee(gpu: GpuSpec) -> int:
        spec = ServerSpec(gpu, model, tp=2)  # 32B needs two H100s; tensor parallelism divides both terms alike
        bound = spec.step_seconds(1, 0)  # no context: the weights' read, flat until compute overtakes it
        found = next(n for n in range(1, 4096) if spec.step_seconds(n + 1, 0) > bound)
        assert spec.compute_knee == found
        return found

    assert (knee(H20), knee(H100_SXM)) == (int(stated.group(1)), int(stated.group(2)))


def test_a_clairvoyant_launch_order_starts_the_longest_remaining_answer_first(monkeypatch):
    """``simulate(clairvoyant=True)``: the what-if that bounds what launch order could add. With one call at a time,
    every launch of a step is the longest true remaining answer among those left (fifo launches by group and
    index); the true remaining length is the drawn answer less what the sample holds."""
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    load = Workload(batch=2, n=4, p50=200, p99_over_p50=20, response_length=8_192, prompts=8)
    serial = dataclasses.replace(mode_configs(load.batch)["sync"], max_calls_per_server=1)
    runs: list[list[tuple[int, int]]] = []  # per run, (true remaining, tokens held) of each launch in order
    original = SimBackend.launch

    def record(self, wave):
        runs[-1] += [
            (self.remaining(group, r.ref.index), len(group.samples[r.ref.index].token_ids)) for group, r in wave
        ]
        return original(self, wave)

    monkeypatch.setattr(SimBackend, "launch", record)
    for clairvoyant in (False, True):
        runs.append([])
        simulate(serial, load, spec, servers=1, steps=1, clairvoyant=clairvoyant)
    fifo, launched = runs
    truth = [
        min(load.length(prompt, f"p{prompt}@e0", i, 0), load.response_length) for prompt in (0, 1) for i in range(4)
    ]
    assert truth != sorted(truth, reverse=True)
    assert all(held == 0 for _, held in launched) and len(launched) == 8
    assert [remaining for remaining, _ in launched] == sorted(truth, reverse=True)
    assert [remaining for remaining, _ in fifo] == truth


def test_a_clairvoyant_launch_order_changes_nothing_where_no_sample_waits():
    """Where the engines hold every sample admitted (``fill_engine`` admits no more than their slots), nothing is
    ever queued to be ordered: the clairvoyant run is the fifo run."""
    spec = ServerSpec(H100_SXM, QWEN25_7B)
    load = Workload(batch=4, n=4, p50=200, p99_over_p50=20, response_length=8_192, prompts=32)
    default = mode_configs(load.batch)["default"]
    fifo = simulate(default, load, spec, servers=1, steps=4)
    clairvoyant = simulate(default, load, spec, servers=1, steps=4, clairvoyant=True)
    assert fifo.seconds == clairvoyant.seconds and fifo.tokens_trained == clairvoyant.tokens_trained


def test_a_samples_length_carries_over_epochs_with_the_stated_correlation():
    """``sample_epoch_corr``: one sample's log-length noise is correlated ``rho`` between any two epochs (the
    benchmarks' imposed lengths), the law of each epoch unchanged; 1 repeats every answer, 0 draws afresh."""
    rng = np.random.default_rng(0)
    prompts = [int(p) for p in rng.integers(0, 10**6, 3000)]

    def log_lengths(load: Workload, epoch: int) -> np.ndarray:
        return np.log([load.length(p, f"p{p}@e{epoch}", 0, 0) for p in prompts])

    for rho in (0.0, 0.5, 1.0):
        load = Workload(batch=1, n=1, p50=1000, p99_over_p50=8, response_length=10**9, prompt_share=0.0,
                        sample_epoch_corr=rho)  # fmt: skip
        first, second = log_lengths(load, 0), log_lengths(load, 1)
        assert np.corrcoef(first, second)[0, 1] == pytest.approx(rho, abs=0.05)
        assert np.std(second) == pytest.approx(load.sigma, rel=0.05)
        assert np.median(np.exp(second)) == pytest.approx(1000, rel=0.06)
    with pytest.raises(ValueError, match="sample_epoch_corr"):
        Workload(batch=1, n=1, p50=1, p99_over_p50=8, response_length=8, sample_epoch_corr=1.5)


def _functions(path: Path) -> dict[str, list[ast.AsyncFunctionDef | ast.FunctionDef]]:
    """Every function and method in a source file, by name (several classes may define one)."""
    found: dict[str, list[ast.AsyncFunctionDef | ast.FunctionDef]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(node.name, []).append(node)
    return found


def _calls(function: ast.AST) -> set[str]:
    """Every attribute named in what ``function`` calls (``self.handle.clear_kv_cache.remote()``: both names)."""
    called = (node.func for node in ast.walk(function) if isinstance(node, ast.Call))
    return {node.attr for func in called for node in ast.walk(func) if isinstance(node, ast.Attribute)}


def test_verls_vllm_server_clears_the_prefix_cache_where_keep_cache_on_update_says():
    """What ``ServerSpec.keep_cache_on_update`` (a what-if) and the docs say verl does, read from verl 0.9.1's own
    source (imported files would need vLLM): the cache is cleared after a weight update (``clear_kv_cache``, which
    resets vLLM's prefix cache), at the abort (``abort_all_requests``' ``reset_prefix_cache`` defaults to true) and on
    wake-up, so no verl server keeps what a parked answer had computed."""
    package = Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout"
    rollout, server = _functions(package / "vllm_rollout.py"), _functions(package / "vllm_async_server.py")
    assert all("clear_kv_cache" in _calls(update) for update in rollout["update_weights"])
    assert all("reset_prefix_cache" in _calls(clear) for clear in server["clear_kv_cache"])
    assert all("reset_prefix_cache" in _calls(wake) for wake in server["wake_up"])
    # vLLM's abort (the server of the two ``abort_all_requests`` that takes the flag): on by default, and handed to
    # vLLM's ``pause_generation`` as ``clear_cache``.
    (abort,) = [f for f in server["abort_all_requests"] if "reset_prefix_cache" in _defaults(f)]
    assert _defaults(abort)["reset_prefix_cache"] is True
    handed = [k for node in ast.walk(abort) if isinstance(node, ast.Call) for k in node.keywords]
    assert any(k.arg == "clear_cache" and getattr(k.value, "id", None) == "reset_prefix_cache" for k in handed)


def _defaults(function: ast.AsyncFunctionDef | ast.FunctionDef) -> dict[str, object]:
    """A function's positional parameters with defaults, by name, as literals."""
    named = function.args.args[len(function.args.args) - len(function.args.defaults) :]
    return {arg.arg: ast.literal_eval(default) for arg, default in zip(named, function.args.defaults, strict=True)}
