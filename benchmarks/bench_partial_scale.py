"""Driver cost of one rollout step at job scale: verl's own rollout vs partial rollout, side by side, no model.

    python -m benchmarks.bench_partial_scale --prompts 128                  # verl's own + this checkout's partial path
    python -m benchmarks.bench_partial_scale --prompts 64 128 --old-tree /tmp/old_checkout --out benchmarks/README.md
    python -m benchmarks.bench_partial_scale --quick                        # smoke configuration, ~1 min

Why: partial rollout must not cost the driver more than verl's own rollout does at the same batch -- Ray calls,
bytes, memory, driver-thread time -- or it cannot run a real job (512 prompts x n=16, 1k-token prompts, 16k
response length). What is measured is the glue and the scheduler, so the inference engine is simulated:

* ``SimServer`` is a Ray actor standing in for one verl vLLM server (same ``generate`` signature, same
  ``stop_reason`` values, ``global_steps`` in ``extra_fields``, abort gate with ``reject_request``). It returns
  random token ids at ``--rate`` tokens/s per request. Every response starts with a marker token and two random
  tokens that fix the response's target length (lognormal, capped at the response length), so a sample resumed
  from its tokens keeps its length, as a real model keeps its answer. Abort returns the tokens made so far.
* Real verl: the config is verl's composed ``ppo_trainer`` config, the AgentLoopWorkers are verl's (``--workers``
  of them, verl's default is 8), the client and load balancer are verl's. No reward function is called in any mode
  (``reward_loop_worker_handles=None``), so all modes do the same post-processing.

Modes, each in its own process (so peak RSS is that mode's own), one after another:

* ``verl``: ``AgentLoopManager.generate_sequences`` on ``prompts x n`` rows, per step.
* ``partial`` (and ``partial-old`` with ``--old-tree``, a checkout of an earlier version): what ``fit()`` does per
  step with ``+partial=default`` -- ``next(PartialRolloutLoader)`` (scheduler: ``prompts + extra`` groups in flight)
  and the hand-over ``PartialAgentLoopManager.generate_sequences``.

Measured in the driver process, per step: Ray calls it issued (actor method invocations, counted at
``ActorMethod._remote``), bytes it serialised and deserialised (Ray's serialization context), peak RSS, and the
time its main thread spent (``time.thread_time``) in the rollout step and in the hand-over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from types import SimpleNamespace
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- scale:start -->", "<!-- scale:end -->"


@dataclass(frozen=True)
class Scale:
    """The job being simulated; the defaults are the issue's job (512 x 16, 1k prompts, 16k responses, mean 8k)."""

    prompts: int = 512
    n: int = 16
    extra_groups: int = 64
    prompt_tokens: int = 1000
    response_length: int = 16384
    mean_len: float = 8192.0
    sigma: float = 1.0
    workers: int = 8
    servers: int = 8
    rate: float = 32768.0  # tokens/s per request
    steps: int = 3

    def median_for_mean(self) -> float:
        """Median of the lognormal whose mean after capping at ``response_length`` is ``mean_len`` (bisection)."""
        low, high = 1.0, float(self.response_length)
        for _ in range(60):
            mid = (low + high) / 2
            if capped_mean(mid, self.sigma, self.response_length) < self.mean_len:
                low = mid
            else:
                high = mid
        return (low + high) / 2


def capped_mean(median: float, sigma: float, cap: int, draws: int = 4000) -> float:
    dist = NormalDist()
    total = 0.0
    for i in range(draws):
        total += min(cap, median * math.exp(sigma * dist.inv_cdf((i + 0.5) / draws)))
    return total / draws


# ---------------------------------------------------------------------------------------------- simulated engine
@dataclass
class SimOutput:
    """The attributes verl reads from a server's ``TokenOutput`` (a plain class: no verl import in the actor)."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str
    extra_fields: dict[str, Any] = field(default_factory=dict)
    num_preempted: int | None = None
    routed_experts: Any = None


class SimServer:
    """A vLLM server stand-in: random tokens at a fixed rate, abort gate as in verl's vllm_async_server.py."""

    HEADER = 3  # marker + two tokens that encode the target length

    def __init__(self, address: str, marker: int, eos: int, median: float, sigma: float, response_length: int,
                 rate: float, token_range: tuple[int, int]) -> None:  # fmt: skip
        self.address, self.marker, self.eos = address, marker, eos
        self.median, self.sigma, self.response_length, self.rate = median, sigma, response_length, rate
        self.low, self.high = token_range
        self.global_steps: int | None = None
        self.paused = False
        self.rejecting = False
        self.resume_event = asyncio.Event()
        self.resume_event.set()
        self.abort_event = asyncio.Event()
        self.rng = np.random.default_rng(abs(hash(address)) % 2**32)
        self.calls = 0

    def get_server_address(self) -> str:
        return self.address

    def _target(self, first: int, second: int) -> int:
        span = self.high - self.low
        unit = ((first - self.low) * span + (second - self.low) + 0.5) / span**2
        length = self.median * math.exp(self.sigma * NormalDist().inv_cdf(unit))
        return max(self.HEADER + 1, min(self.response_length, round(length)))

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       **_unused: Any) -> SimOutput:  # fmt: skip
        self.calls += 1
        while self.paused:
            if self.rejecting:
                return SimOutput([], None, "aborted", {"global_steps": self.global_steps})
            await self.resume_event.wait()
        ids = list(prompt_ids)
        try:
            start = ids.index(self.marker)
        except ValueError:
            start = len(ids)
        prefix = ids[start:]
        header = prefix[: self.HEADER]
        new: list[int] = []
        if len(header) < self.HEADER:
            new = [self.marker, *self.rng.integers(self.low, self.high, size=2).tolist()][len(header) :]
            header = (header + new)[: self.HEADER]
        target = self._target(header[1], header[2])
        max_tokens = int(sampling_params.get("max_tokens", self.response_length - len(prefix)))
        remaining = max(0, target - len(prefix) - len(new))
        count = min(remaining, max_tokens - len(new))
        aborted = False
        abort = self.abort_event
        started = time.monotonic()
        try:
            await asyncio.wait_for(abort.wait(), timeout=count / self.rate)
            aborted = True
            count = min(count, int((time.monotonic() - started) * self.rate))
        except asyncio.TimeoutError:
            pass
        body = self.rng.integers(self.low, self.high, size=count).tolist()
        if not aborted and count == remaining and remaining > 0:
            body[-1] = self.eos
        tokens = new + body
        log_probs = (-self.rng.random(len(tokens))).tolist()
        stop = "aborted" if aborted else "completed"
        return SimOutput(tokens, log_probs, stop, {"global_steps": self.global_steps})

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        self.paused, self.rejecting = True, reject_request
        self.resume_event.clear()
        self.abort_event.set()
        self.abort_event = asyncio.Event()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        self.paused = self.rejecting = False
        self.resume_event.set()

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    def num_calls(self) -> int:
        return self.calls


class SimReplica:
    """The replica methods the glue calls (verl's ``RolloutReplica`` fan-out over its servers)."""

    def __init__(self, server: Any, address: str) -> None:
        self.servers, self._server_handle, self._server_address = [server], server, address

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self._server_handle.abort_all_requests.remote(reject_request=reject_request)

    async def resume_generation(self) -> None:
        await self._server_handle.resume_generation.remote()


def counting_balancer() -> type:
    """verl's default load balancer, counting the acquire/release calls the AgentLoopWorkers make to it."""
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    class CountingBalancer(GlobalRequestLoadBalancer):
        calls = 0

        def acquire_server(self, request_id: str) -> tuple[str, Any]:
            CountingBalancer.calls += 1
            return super().acquire_server(request_id)

        def release_server(self, server_id: str, request_id: str | None = None) -> None:
            CountingBalancer.calls += 1
            super().release_server(server_id, request_id)

        def num_calls(self) -> int:
            return CountingBalancer.calls

    return CountingBalancer


# ---------------------------------------------------------------------------------------------- driver meters
class Meters:
    """Ray calls issued and bytes (de)serialised by this process; installed once, read per step."""

    def __init__(self) -> None:
        import ray.actor
        from ray._private.serialization import SerializationContext

        self.calls = 0
        self.bytes_out = 0
        self.bytes_in = 0
        original_remote = ray.actor.ActorMethod._remote
        original_serialize = SerializationContext.serialize
        original_deserialize = SerializationContext.deserialize_objects
        meters = self

        def _remote(method, *args, **kwargs):
            meters.calls += 1
            return original_remote(method, *args, **kwargs)

        def serialize(context, value):
            serialized = original_serialize(context, value)
            meters.bytes_out += int(getattr(serialized, "total_bytes", 0) or 0)
            return serialized

        def deserialize_objects(context, serialized_ray_objects, *args, **kwargs):
            for data, *_ in serialized_ray_objects:
                meters.bytes_in += len(data) if data is not None else 0
            return original_deserialize(context, serialized_ray_objects, *args, **kwargs)

        ray.actor.ActorMethod._remote = _remote
        SerializationContext.serialize = serialize
        SerializationContext.deserialize_objects = deserialize_objects

    def snapshot(self) -> tuple[int, int, int]:
        return self.calls, self.bytes_out, self.bytes_in


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------------------------------------- workload rows
class PromptLoader:
    """Stands in for verl's StatefulDataLoader: batches of chat prompts of about ``prompt_tokens`` tokens."""

    def __init__(self, tokenizer: Any, scale: Scale, batches: int) -> None:
        rng = np.random.default_rng(0)
        self.batch_size, self.batches = scale.prompts, batches
        words = [str(int(v)) for v in rng.integers(0, 100, size=scale.prompt_tokens * 2)]
        text = " ".join(words)
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        # Trim words until the chat-templated prompt is at most prompt_tokens tokens.
        while len(ids) > scale.prompt_tokens:
            words = words[: int(len(words) * scale.prompt_tokens / len(ids)) - 1]
            messages = [{"role": "user", "content": " ".join(words)}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        self.prompt_len = len(ids)
        self.words = words
        self.position = 0

    def _row(self, index: int) -> dict[str, Any]:
        # Distinct prompts: the first word is the prompt's index.
        content = " ".join([str(index), *self.words[1:]])
        return {
            "raw_prompt": [{"role": "user", "content": content}],
            "data_source": "sim",
            "reward_model": {"ground_truth": "0", "style": "rule"},
            "extra_info": {"index": index},
            "index": index,
        }

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        while self.position < self.batches:
            start = self.position * self.batch_size
            self.position += 1
            rows = [self._row(start + i) for i in range(self.batch_size)]
            yield {key: _object_array([row[key] for row in rows]) for key in rows[0]}

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        array[index] = value
    return array


# ---------------------------------------------------------------------------------------------- one mode
def compose_config(assets: Any, scale: Scale) -> Any:
    import verl
    from hydra import compose, initialize_config_dir

    import verl_partial
    from verl_partial.demo.assets import hydra_overrides

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    # The Hydra groups of the verl_partial actually imported (an older checkout has its own keys).
    groups = Path(verl_partial.__file__).resolve().parents[1] / "hydra_configs"
    overrides = [
        f"hydra.searchpath=[file://{groups}]",
        "+backend=cpu",
        "+partial=default",
        *hydra_overrides(assets),
        f"data.max_prompt_length={scale.prompt_tokens}",
        f"data.max_response_length={scale.response_length}",
        f"data.train_batch_size={scale.prompts}",
        f"actor_rollout_ref.rollout.n={scale.n}",
        f"actor_rollout_ref.rollout.agent.num_workers={scale.workers}",
        f"actor_rollout_ref.rollout.max_model_len={scale.prompt_tokens + scale.response_length}",
        f"partial.extra_groups={scale.extra_groups}",
        "trainer.total_epochs=1",
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def run_mode(mode: str, scale: Scale, cache: Path) -> dict[str, Any]:
    import ray
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from verl_partial.demo.assets import build_assets

    assets = build_assets(cache)
    config = compose_config(assets, scale)
    tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
    marker = tokenizer.pad_token_id
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ray.init(num_cpus=max(8, scale.workers + scale.servers + 2), include_dashboard=False, log_to_driver=False)
    meters = Meters()
    server_cls = ray.remote(SimServer).options(max_concurrency=100_000, num_cpus=0)
    addresses = [f"sim://server-{i}" for i in range(scale.servers)]
    handles = [
        server_cls.remote(
            address, marker, eos, scale.median_for_mean(), scale.sigma, scale.response_length, scale.rate, (10, 250)
        )  # fmt: skip
        for address in addresses
    ]
    ray.get([handle.set_global_steps.remote(0) for handle in handles])
    router = get_router_handle(
        servers=dict(zip(addresses, handles, strict=True)), load_balancer_cls=counting_balancer()
    )
    client = LLMServerClient(config, load_balancer_handle=router)
    loader = PromptLoader(tokenizer, scale, batches=scale.steps + 4)
    results: dict[str, Any] = {"mode": mode, "prompt_tokens": loader.prompt_len, "steps": [], "own_calls": 0}

    if mode == "verl":
        manager = AgentLoopManager.create(config, llm_client=client)
        iterator = iter(loader)

        def step(index: int) -> tuple[float, float, int]:
            batch = DataProto.from_single_dict(next(iterator)).repeat(scale.n, interleave=True)
            wall, cpu = time.perf_counter(), time.thread_time()
            output = manager.generate_sequences(batch)
            return time.perf_counter() - wall, time.thread_time() - cpu, len(output)

    else:
        from verl_partial.glue.partial.rollout import PartialAgentLoopManager, PartialRolloutLoader

        manager = PartialAgentLoopManager.create(config, llm_client=client)
        replicas = [SimReplica(handle, address) for handle, address in zip(handles, addresses, strict=True)]
        server_manager = SimpleNamespace(
            get_replicas=lambda: replicas, server_addresses=addresses, server_handles=handles
        )
        trainer = SimpleNamespace(
            config=config,
            train_dataloader=loader,
            async_rollout_manager=manager,
            llm_server_manager=server_manager,
            global_steps=1,
            total_training_steps=1000,
        )
        partial_loader = PartialRolloutLoader(trainer, _partial_config(config))
        iterator = iter(partial_loader)

        def step(index: int) -> tuple[float, float, int]:
            trainer.global_steps = index + 1
            wall, cpu = time.perf_counter(), time.thread_time()
            batch = DataProto.from_single_dict(next(iterator)).repeat(scale.n, interleave=True)
            results.setdefault("rollout", []).append((time.perf_counter() - wall, time.thread_time() - cpu))
            hand_wall, hand_cpu = time.perf_counter(), time.thread_time()
            output = manager.generate_sequences(batch)
            results.setdefault("handover", []).append((time.perf_counter() - hand_wall, time.thread_time() - hand_cpu))
            return time.perf_counter() - wall, time.thread_time() - cpu, len(output)

    def worker_calls() -> int:
        """Calls the workers made: generate calls the servers received plus load-balancer acquire/release calls."""
        counts = ray.get([handle.num_calls.remote() for handle in handles] + [router.num_calls.remote()])
        return sum(counts)

    for index in range(scale.steps):
        # The weight sync of the step before (servers report global_steps = step - 1); not part of the rollout.
        ray.get([handle.set_global_steps.remote(index) for handle in handles])
        worker_before = worker_calls()
        before = meters.snapshot()
        wall, cpu, rows = step(index)
        after = meters.snapshot()
        worker_after = worker_calls()
        record = {
            "step": index + 1,
            "rows": rows,
            "worker_calls": worker_after - worker_before,
            "ray_calls": after[0] - before[0],
            "bytes_out": after[1] - before[1],
            "bytes_in": after[2] - before[2],
            "wall_s": wall,
            "driver_thread_s": cpu,
            "rss_mib": rss_mib(),
            "peak_rss_mib": peak_rss_mib(),
        }
        if mode != "verl":
            record["rollout_wall_s"], record["rollout_thread_s"] = results["rollout"][-1]
            record["handover_wall_s"], record["handover_thread_s"] = results["handover"][-1]
        results["steps"].append(record)
        print(json.dumps(record), file=sys.stderr, flush=True)
    results.pop("rollout", None)
    results.pop("handover", None)
    results["peak_rss_mib"] = peak_rss_mib()
    ray.shutdown()
    return results


def _partial_config(config: Any) -> Any:
    """The imported verl_partial's typed block; keys an older checkout does not know keep its defaults."""
    import dataclasses

    from omegaconf import open_dict

    from verl_partial.config.partial import PartialConfig

    known = {f.name for f in dataclasses.fields(PartialConfig)}
    with open_dict(config):
        for key in [key for key in config.partial if key not in known]:
            del config.partial[key]
    return PartialConfig(**{key: config.partial[key] for key in config.partial})


# ---------------------------------------------------------------------------------------------- orchestration
def run_child(mode: str, scale: Scale, cache: Path, pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--child", mode, "--scale", json.dumps(asdict(scale)), "--cache", str(cache)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, cwd=pythonpath or REPO)
    if completed.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{completed.stderr[-6000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def summarise(scale: Scale, result: dict[str, Any]) -> dict[str, float]:
    # The first step pays one-off costs (worker start-up, first tokenisation) in every mode: warm-up.
    steps = result["steps"][1:] or result["steps"]
    mean = lambda key: sum(s[key] for s in steps) / len(steps)  # noqa: E731
    # Results of the first runs counted the benchmark's own calls (counting queries, weight-version pushes) in the
    # step: servers + 1 per step, plus servers for the partial modes. Later runs measure outside the step.
    servers = scale.servers
    own = result.get("own_calls", servers + 1 + (servers if result["mode"] != "verl" else 0))
    summary = {
        "ray_calls": mean("ray_calls") - own,
        "mib_out": mean("bytes_out") / 2**20,
        "mib_in": mean("bytes_in") / 2**20,
        "peak_rss_mib": result["peak_rss_mib"],
        "driver_thread_s": mean("driver_thread_s"),
        "wall_s": mean("wall_s"),
        "worker_calls": mean("worker_calls"),
    }
    if "handover_thread_s" in steps[0]:
        summary["rollout_thread_s"] = mean("rollout_thread_s")
        summary["handover_thread_s"] = mean("handover_thread_s")
        summary["handover_wall_s"] = mean("handover_wall_s")
    return summary


def table(rows: list[tuple[Scale, str, dict[str, float]]]) -> str:
    lines = [
        "| prompts x n | mode | Ray calls / step: driver, workers | driver MiB out / in per step | "
        "driver peak RSS MiB | driver thread s / step (scheduler, hand-over) | wall s / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for scale, mode, s in rows:
        split = ""
        if "handover_thread_s" in s:
            split = f" ({s['rollout_thread_s']:.2f}, {s['handover_thread_s']:.2f})"
        lines.append(
            f"| {scale.prompts} x {scale.n} | {mode} | {s['ray_calls']:.0f}, {s['worker_calls']:.0f} | "
            f"{s['mib_out']:.0f} / {s['mib_in']:.0f} | {s['peak_rss_mib']:.0f} | {s['driver_thread_s']:.2f}{split} | "
            f"{s['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[128])
    parser.add_argument("--workers", type=int, default=Scale.workers)
    parser.add_argument("--servers", type=int, default=Scale.servers)
    parser.add_argument("--steps", type=int, default=Scale.steps)
    parser.add_argument("--modes", nargs="+", default=["verl", "partial"])
    parser.add_argument("--old-tree", help="a checkout of an earlier verl-partial, measured as mode partial-old")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "verl-partial" / "demo"))
    parser.add_argument("--json", help="append raw per-mode results (JSON lines) here")
    parser.add_argument("--out", help="markdown file whose results block is replaced")
    parser.add_argument("--from-json", help="render the table from results stored with --json instead of measuring")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--scale", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = Path(args.cache)
    if args.child:
        result = run_mode(args.child.removesuffix("-old"), Scale(**json.loads(args.scale)), cache)
        print(json.dumps(result))
        return 0
    modes = list(args.modes) + (["partial-old"] if args.old_tree else [])
    rows = []
    if args.from_json:
        for line in Path(args.from_json).read_text().splitlines():
            record = json.loads(line)
            scale = Scale(**record.pop("scale"))
            rows.append((scale, record["label"], summarise(scale, record)))
        args.prompts = []
    for prompts in args.prompts:
        scale = Scale(
            prompts=prompts,
            extra_groups=max(1, prompts // 8),
            workers=args.workers,
            servers=args.servers,
            steps=args.steps,
        )
        if args.quick:
            scale = Scale(prompts=prompts, n=4, extra_groups=2, prompt_tokens=200, response_length=1024,
                          mean_len=512, workers=2, servers=2, steps=2)  # fmt: skip
        for mode in modes:
            result = run_child(mode, scale, cache, args.old_tree if mode.endswith("-old") else None)
            if args.json:
                with open(args.json, "a") as sink:
                    sink.write(json.dumps({"scale": asdict(scale), "label": mode, **result}) + "\n")
            rows.append((scale, mode, summarise(scale, result)))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    report = table(rows)
    print(report)
    if args.out:
        path = Path(args.out)
        text = path.read_text()
        head, _, rest = text.partition(START)
        _, _, tail = rest.partition(END)
        path.write_text(f"{head}{START}\n{report}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
