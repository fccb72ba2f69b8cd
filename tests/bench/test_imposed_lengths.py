"""The benchmarks' imposed response lengths: epoch-correlated draws (issue 25, item 6) without changing any earlier
figure's lengths, and the route each trainer path's epoch takes to them."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def trainer(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("bench_vllm_trainer")


@pytest.fixture
def peer(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("bench_peer")


def test_the_oracle_lengths_of_every_earlier_figure_are_unchanged(trainer: ModuleType) -> None:
    """Values the lengths had before epochs existed (read from that commit): with correlation 1 the epoch plays no
    part, so the stored peer and trainer results keep their workload."""
    lengths = trainer.Lengths()
    assert [lengths.target([5, 9, 33], i) for i in range(4)] == [28, 38, 28, 67]
    assert [lengths.target([7], i, epoch) for i, epoch in zip(range(4), (1, 2, 3, 9), strict=True)] == [25, 69, 49, 92]
    assert trainer.Lengths(seed=3).target([1, 2], 1) == 10
    assert lengths.env() == "0,48.0,1.0,512"  # the environment string earlier runs exported


def _log_lengths(lengths: object, epoch: int, prompts: int = 4000) -> list[float]:
    return [math.log(lengths.target([p, 17], p % 4, epoch)) for p in range(prompts)]


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.8])
def test_log_lengths_correlate_between_epochs_as_stated_and_keep_their_distribution(
    trainer: ModuleType, rho: float
) -> None:
    # A median far above 1 and no cap: rounding and capping do not blur the normal the correlation is stated on.
    lengths = trainer.Lengths(median=5000.0, sigma=1.0, cap=10**9, epoch_corr=rho, epoch_steps=4)
    first, second, third = (_log_lengths(lengths, epoch) for epoch in (1, 2, 3))
    assert statistics.correlation(first, second) == pytest.approx(rho, abs=0.05)
    assert statistics.correlation(second, third) == pytest.approx(rho, abs=0.05)
    for draws in (first, second):  # every epoch the same lognormal
        assert statistics.median(draws) == pytest.approx(math.log(5000.0), abs=0.06)
        assert statistics.stdev(draws) == pytest.approx(1.0, abs=0.05)


def test_a_groups_mean_length_carries_over_with_the_same_correlation(trainer: ModuleType) -> None:
    """What length-aware batching orders by: a prompt's mean log-length over its n samples, epoch to epoch."""
    lengths = trainer.Lengths(median=5000.0, cap=10**9, epoch_corr=0.5, epoch_steps=4)

    def group_means(epoch: int) -> list[float]:
        return [statistics.fmean(math.log(lengths.target([p], i, epoch)) for i in range(4)) for p in range(3000)]

    assert statistics.correlation(group_means(1), group_means(2)) == pytest.approx(0.5, abs=0.05)


def test_the_mean_length_is_the_same_whatever_the_correlation(trainer: ModuleType) -> None:
    """The emulated occupancy's context uses the mean: epoch-correlated lengths keep every epoch's distribution."""
    oracle = trainer.Lengths().mean(4000)
    assert trainer.Lengths(epoch_corr=0.5, epoch_steps=4).mean(4000) == pytest.approx(oracle, rel=0.05)


def test_per_epoch_lengths_refuse_what_they_cannot_honour(trainer: ModuleType) -> None:
    with pytest.raises(ValueError, match="epoch_corr must be in"):
        trainer.Lengths(epoch_corr=1.5)
    with pytest.raises(ValueError, match="epoch_steps must be >= 1"):
        trainer.Lengths(epoch_corr=0.5)
    with pytest.raises(ValueError, match="needs the sample's epoch"):
        trainer.Lengths(epoch_corr=0.5, epoch_steps=4).target([1], 0)


def test_the_environment_carries_the_epoch_fields(trainer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = trainer.Lengths(seed=2, epoch_corr=0.5, epoch_steps=4)
    monkeypatch.setenv(trainer.TARGET_ENV, lengths.env())
    assert trainer.Lengths.from_env() == lengths
    monkeypatch.setenv(trainer.TARGET_ENV, "1,48.0,1.0,512")  # what earlier runs exported
    assert trainer.Lengths.from_env() == trainer.Lengths(seed=1)


def test_both_paths_count_the_same_epochs(trainer: ModuleType) -> None:
    """v0 sync is told the trainer step (1-based); our partial path the key its prompt source drew the group under,
    ``e<epoch>-<draw>``, epochs 1-based: with 4 steps an epoch, the same prompt draw falls in the same epoch."""
    lengths = trainer.Lengths(epoch_corr=0.5, epoch_steps=4)
    assert [lengths.epoch_of_step(step) for step in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert trainer.epoch_of_key("e3-117") == 3
    assert trainer.epoch_of_key("e12-0b259444-9ea9-41e9-8775-da9d246cfe54") == 12  # a v1 uid, tagged
    for untagged in ("3-117", "0b259444-9ea9-41e9-8775-da9d246cfe54"):
        with pytest.raises(RuntimeError, match="is not e<epoch>-<draw or uuid>"):
            trainer.epoch_of_key(untagged)


def test_our_prompt_source_keys_groups_by_epoch() -> None:
    """The key format epoch_of_key parses is the one PromptStream hands out, epochs counted from 1."""
    from verl_partial.glue.partial.rollout import PromptStream

    class Loader:
        def __iter__(self):  # two batches of one prompt row each
            return iter([{"x": [1]}, {"x": [2]}])

        def state_dict(self) -> dict:
            return {}

    source = PromptStream(Loader(), total_epochs=2)
    keys = [source.next_prompt()[1] for _ in range(3)]
    assert keys == ["e1-0", "e1-1", "e2-2"]


@pytest.fixture
def verl_worker(trainer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> type:
    """verl's AgentLoopWorker, restored after the test, with no step hook installed."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    monkeypatch.setattr(AgentLoopWorker, "_run_agent_loop", AgentLoopWorker._run_agent_loop)
    monkeypatch.setattr(trainer, "_VERL_RUN_AGENT_LOOP", {})
    return AgentLoopWorker


def test_verl_s_worker_hands_its_step_to_the_loop(trainer: ModuleType, verl_worker: type) -> None:
    """The step hook installs on verl's real AgentLoopWorker (its signature checked) and gives each task its own
    step: two tasks of different steps run interleaved, each loop reads its own."""
    original = verl_worker._run_agent_loop
    trainer.install_step_hook()  # on verl's own method: the signature check must pass
    assert trainer._VERL_RUN_AGENT_LOOP["run"] is original
    trainer.install_step_hook()  # once per process: a second install must not wrap the hook in itself
    assert trainer._VERL_RUN_AGENT_LOOP["run"] is original

    async def loop_body(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):  # verl's parameters
        await asyncio.sleep(0)
        return trainer._TRAINER_STEP.get()

    trainer._VERL_RUN_AGENT_LOOP["run"] = loop_body  # what verl's method would run, reduced to reading the step

    async def both() -> list[int]:
        run = verl_worker._run_agent_loop
        return list(await asyncio.gather(run(None, {}, {"step": 5}, agent_name="a"),
                                         run(None, {}, {"step": 9}, agent_name="a")))  # fmt: skip

    assert asyncio.run(both()) == [5, 9]


def test_the_hooked_method_is_shipped_by_name(trainer: ModuleType, verl_worker: type) -> None:
    """Ray pickles verl's AgentLoopWorker class by value when it creates the actors. The hooked method must travel by
    reference: a closure travelled by value with verl's original method, whose copied globals held an empty copy of
    verl's agent-loop registry ("Agent loop imposed_length_agent not registered" in the first run), and before that
    with the ContextVar, which cannot be pickled at all."""
    from ray import cloudpickle

    trainer.install_step_hook()
    method = verl_worker._run_agent_loop
    assert cloudpickle.loads(cloudpickle.dumps(method)) is method


def test_the_step_hook_refuses_a_changed_verl(trainer: ModuleType, verl_worker: type) -> None:
    async def changed(self, sampling_params, trajectory_info, **kwargs):
        return None

    verl_worker._run_agent_loop = changed  # restored by the fixture
    with pytest.raises(RuntimeError, match="step hook needs updating"):
        trainer.install_step_hook()


@pytest.fixture
def v1_trainer(trainer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> type:
    """verl's v1 PPOTrainer (the vLLM tier's environment: it imports TransferQueue), restored after the test, with no
    epoch hook installed."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    monkeypatch.setattr(PPOTrainer, "_fetch_one_gen_batch", PPOTrainer._fetch_one_gen_batch)
    monkeypatch.setattr(trainer, "_VERL_FETCH", {})
    return PPOTrainer


class _OneRowBatches:
    """A dataloader of ``rows`` one-prompt batches, as v1's colocate_async draws them (``gen_batch_size`` 1)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __iter__(self):
        import numpy as np

        return iter([{"raw_prompt": np.array([[{"role": "user", "content": str(row)}]], dtype=object)}
                     for row in range(self.rows)])  # fmt: skip


@pytest.mark.vllm
def test_v1_s_trainer_tags_every_prompt_with_the_epoch_it_was_drawn_in(
    trainer: ModuleType, peer: ModuleType, v1_trainer: type
) -> None:
    """verl's own fetch runs under the hook: over a 3-row data set, draws 1-3 are epoch 1 and 4-7 epoch 2 and 3,
    and the imposed-length loop on v1 reads each sample's epoch back from the uid its row carries."""
    trainer.install_epoch_hook()
    trainer.install_epoch_hook()  # once per process: a second install must not wrap the hook in itself
    drawer = type("Drawer", (), {"train_dataloader": _OneRowBatches(3), "train_dataloader_it": None})()
    uids = [str(uid) for _ in range(7) for uid in v1_trainer._fetch_one_gen_batch(drawer)["uid"]]
    lengths = trainer.Lengths(epoch_corr=0.5, epoch_steps=4)
    epochs = [peer.SessionImposedLengthAgentLoop.epoch(None, lengths, {"uid": uid}) for uid in uids]
    assert epochs == [1, 1, 1, 2, 2, 2, 3]
    assert len(set(uids)) == 7 and not any("_" in uid for uid in uids)  # v1's keys split <uid>_<session>_<index>


@pytest.mark.vllm
def test_the_epoch_hook_refuses_a_changed_verl(trainer: ModuleType, v1_trainer: type) -> None:
    def changed(self):  # draws without restarting its iterator: a new epoch would go unseen
        return next(self.train_dataloader_it)

    v1_trainer._fetch_one_gen_batch = changed  # restored by the fixture
    with pytest.raises(RuntimeError, match="epoch hook needs updating"):
        trainer.install_epoch_hook()


def test_the_peer_workload_counts_epochs_in_its_data_set(peer: ModuleType) -> None:
    args = peer.argparse.Namespace(
        steps=16, slots=64, train_rows=64, epoch_corr=0.5, model="tiny", median=48, cap=512, micro_batch=8
    )
    wl = peer.workload(args)
    assert (wl.lengths.epoch_corr, wl.lengths.epoch_steps, wl.train_rows) == (0.5, 4, 64)
    assert peer.round_lengths(wl, 2, seeds_by_round=True).seed == 2
    assert peer.round_lengths(wl, 2, seeds_by_round=False) == wl.lengths
    with pytest.raises(SystemExit, match="multiple of the 16 prompts"):
        peer.workload(peer.argparse.Namespace(**{**vars(args), "train_rows": 60}))


def test_a_production_shaped_workload_reaches_the_trainer(peer: ModuleType, trainer: ModuleType, tmp_path) -> None:
    """--model tiny_long --median --cap --micro-batch: the imposed lengths, the model's shape, verl's response
    length and micro-batches follow."""
    args = {"steps": 12, "slots": 64, "train_rows": 512, "epoch_corr": 1.0}
    wl = peer.workload(peer.argparse.Namespace(**args, model="tiny_long", median=1024.0, cap=4096, micro_batch=1))
    assert (wl.lengths.median, wl.lengths.cap, wl.hidden_size, wl.num_layers) == (1024, 4096, 32, 1)
    assert wl.micro_batch == 1
    paths = {"train": tmp_path / "t", "val": tmp_path / "v", "model": tmp_path / "m"}
    overrides = trainer.trainer_overrides(paths, wl, tmp_path, "sync")
    assert {"data.max_response_length=4096", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"} <= set(overrides)
    lengths = [wl.lengths.target([p], i) for p in range(64) for i in range(4)]
    assert max(lengths) == 4096 and 700 < sorted(lengths)[len(lengths) // 2] < 1400  # capped, median about 1024


def test_an_epoch_correlation_outside_0_1_is_refused(peer: ModuleType) -> None:
    with pytest.raises(SystemExit, match=r"--epoch-corr 2.0: must be in \[0, 1\]"):
        peer.main(["--engines", "cpu", "--modes", "tail", "--epoch-corr", "2"])


def _steps(lengths: list[float]) -> dict[str, dict[str, float]]:
    return {str(i + 1): {"timing_s/gen": 1.0, "timing_s/step": 2.0, "response_length/mean": v}
            for i, v in enumerate(lengths)}  # fmt: skip


def test_the_window_compared_is_both_length_aware_presets(peer: ModuleType) -> None:
    assert peer.PRESETS_WINDOW == peer.PRESETS["tail_on_policy"].length_window_steps > 1


def test_trained_length_windows_pair_the_same_steps_of_the_same_round(peer: ModuleType) -> None:
    """A mode that trains the window's long answers early and its short ones late has the same length per window;
    a mode that defers long answers past the window shows it."""
    wl = peer.Workload(steps=8)
    sync = [10.0, 40.0, 10.0, 40.0, 20.0, 20.0, 20.0, 20.0]
    reordered = [40.0, 40.0, 10.0, 10.0, 20.0, 20.0, 20.0, 20.0]
    deferred = [10.0, 10.0, 10.0, 10.0, 40.0, 40.0, 20.0, 20.0]
    run = {"returncode": 0, "peak_rss_bytes": 1, "round": 0}
    results = {"workload": peer.dataclasses.asdict(wl), "runs": [
        {**run, "mode": "v0_sync", "steps": _steps(sync)},
        {**run, "mode": "tail", "steps": _steps(reordered)},
        {**run, "mode": "tail_on_policy", "steps": _steps(deferred)},
        {**run, "mode": "default", "round": 1, "steps": _steps(sync)},  # no sync run in its round: not paired
    ]}  # fmt: skip
    assert peer.window_length_ratios(results, "cpu_vllm", "tail", 4) == [1.0, 1.0]
    assert peer.window_length_ratios(results, "cpu_vllm", "tail_on_policy", 4) == [0.4, 1.5]
    assert peer.window_length_ratios(results, "cpu_vllm", "default", 4) == []
    text = peer.length_windows(results, "cpu_vllm")
    assert "| `tail` | 2 | 1.00 (1.00-1.00) |" in text
    assert "default`" not in text
