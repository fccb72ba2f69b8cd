"""SGLang's own code, executed from its wheels, without installing SGLang (the conformance tier's loader).

SGLang's modules import torch, zmq, fastapi, triton kernels and more at module level, and its CUDA-only wheel
cannot be installed here. What the tier needs are a handful of functions and classes whose bodies use none of that:
the tokenizer's request-state table (``ReqState``, ``_init_req_state``), its abort handling (``abort_request``,
``_handle_abort_req``, ``_handle_batch_output``), the scheduler's ``abort_request``, ``Req.check_finished`` and the
finish types. :class:`Wheel` reads a module's text from the wheel (a zip), finds a class or method by name with
``ast``, and executes its source text as it stands (dedented only) in a namespace of small stand-ins for the
module's imports. The harness's own objects then play ``self``: the code that decides what happens is SGLang's.

Where the wheels come from: ``nox -s tests`` downloads them into :data:`WHEEL_DIR` (``noxfile.py``) and sets
:data:`REQUIRE_ENV`, so the tier fails, never skips, in the README's test command when a wheel is missing.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import enum
import logging
import os
import re
import textwrap
import time
import typing
import zipfile
from functools import cached_property
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

VERSIONS = ("0.5.12", "0.5.23")
PINNED = "0.5.12"  # verl 0.9.1's pin
REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = Path(os.environ.get("VERL_PARTIAL_SGLANG_WHEELS", REPO / ".cache" / "sglang-wheels"))
REQUIRE_ENV = "VERL_PARTIAL_REQUIRE_SGLANG_WHEELS"
MANAGERS = "sglang/srt/managers/"
# ``file@version:lines "fragment"``: a citation of SGLang's source (the double's and the glue's).
CITATION = re.compile(
    r"(?P<file>[\w/]+\.py)@(?P<version>\d+\.\d+\.\d+):(?P<first>\d+)(?:-(?P<last>\d+))?[\s#]+\"(?P<fragment>[^\"]+)\""
)


def wheel_path(version: str) -> Path:
    """The wheel of ``version`` in :data:`WHEEL_DIR`; fails when the tier is required, skips otherwise."""
    found = sorted(WHEEL_DIR.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    message = (
        f"SGLang {version}'s wheel is not in {WHEEL_DIR}: `nox -s tests` downloads it, or "
        f"`pip download --no-deps sglang=={version} -d {WHEEL_DIR}`"
    )
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(message)
    pytest.skip(message)


class Wheel:
    """One SGLang wheel, read in place."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.path = wheel_path(version)
        self._texts: dict[str, str] = {}

    def text(self, file: str) -> str:
        """A module's source; ``file`` relative to ``sglang/srt/managers/`` or to the wheel's root."""
        name = file if file.startswith("sglang/") else MANAGERS + file
        if name not in self._texts:
            with zipfile.ZipFile(self.path) as archive:
                self._texts[name] = archive.read(name).decode()
        return self._texts[name]

    def lines(self, file: str, first: int, last: int) -> str:
        return "\n".join(self.text(file).splitlines()[first - 1 : last])

    def _tree(self, file: str) -> ast.Module:
        return ast.parse(self.text(file))

    def source(self, file: str, qualname: str) -> str:
        """The source text of a top-level class or function, or of ``Class.method``, with its decorators, dedented."""
        node: ast.AST = self._tree(file)
        for part in qualname.split("."):
            node = next(
                child
                for child in ast.iter_child_nodes(node)
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and child.name == part
            )
        first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
        return textwrap.dedent(self.lines(file, first, node.end_lineno))

    def load(self, file: str, qualnames: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
        """Execute each definition's source in ``namespace`` (the stand-ins for its module's globals, which every
        definition shares as SGLang's module does); return ``{last name part: object}``."""
        loaded = {}
        for qualname in qualnames:
            name = qualname.rsplit(".", 1)[-1]
            code = compile(self.source(file, qualname), f"{self.path.name}/{MANAGERS}{file}:{qualname}", "exec")
            exec(code, namespace)
            loaded[name] = namespace[name]
        return loaded

    @cached_property
    def files(self) -> list[str]:
        with zipfile.ZipFile(self.path) as archive:
            return archive.namelist()


# ---------------------------------------------------------------------------------------------------------------
# SGLang's tokenizer manager and scheduler, their request-state and abort paths executed from a wheel.
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class AbortReq:
    """``io_struct.AbortReq``'s fields (a msgspec struct in 0.5.23, a dataclass in 0.5.12)."""

    rid: str | None = ""
    http_worker_ipc: str | None = None
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: Any = None


@dataclasses.dataclass(kw_only=True)
class BatchTokenIDOutput:
    """``io_struct.BatchTokenIDOutput``'s fields that ``_handle_batch_output`` reads (one finished request a batch)."""

    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    reasoning_tokens: list[int]
    cached_tokens: list[int]
    retraction_counts: list[int]
    time_stats: Any = None
    customized_info: Any = None
    weight_versions: Any = None


class GenerateReqInput(SimpleNamespace):
    """``io_struct.GenerateReqInput``: a non-streaming text request without log-probs."""


class _NeverInstance:
    """A type no object here is an instance of (``BatchStrOutput``, ``BatchEmbeddingOutput``: not our outputs)."""


class _TimeStats:
    """``APIServerReqTimeStats``: the calls the abort and output paths make, and the dispatch stamp the glue reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.api_server_dispatch_time = 0.0
        self.finished_time = 0.0
        self.first_token_time = 0.0
        self.response_sent_to_client_time = 0.0
        self.trace_ctx = SimpleNamespace(tracing_enable=False)

    def set_created_time(self, *args: Any) -> None:
        return None

    def set_api_server_dispatch_time(self) -> None:
        self.api_server_dispatch_time = 1.0

    def set_finished_time(self, *args: Any, **kwargs: Any) -> None:
        self.finished_time = 1.0

    def set_first_token_time(self, *args: Any, **kwargs: Any) -> None:
        self.first_token_time = 1.0

    def set_last_time(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_e2e_latency(self) -> float:
        return 0.0

    def convert_to_output_meta_info(self, *args: Any) -> dict[str, Any]:
        return {}


class _Serving:
    """``get_serving()``'s config bag (0.5.23): one tokenizer worker, no batching of notifications."""

    tokenizer_worker_num = 1
    batch_notify_size = 1
    skip_tokenizer_init = True


class WheelReq:
    """The scheduler's ``Req`` as the abort and finish paths see it; ``check_finished`` and its helpers are the
    wheel's (``schedule_batch.py``)."""

    def __init__(self, rid: str, max_new_tokens: int, eos_token_ids: set[int], ignore_eos: bool) -> None:
        self.rid = rid
        self.output_ids: list[int] = []
        self.finished_reason = None
        self.finished_len: int | None = None
        self.to_finish = None
        self.grammar = None
        self.tokenizer = None
        self.eos_token_ids = eos_token_ids
        self.vocab_size = 1 << 20
        self.mamba_pool_idx = None
        self.weight_version_events: list[Any] = []
        self.kv = SimpleNamespace(holds_kv=False, holds_mamba=False)
        self.sampling_params = SimpleNamespace(
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=None,
            stop_strs=[],
            stop_regex_strs=[],
        )


@dataclasses.dataclass
class Outcome:
    """What a caller and the tokenizer's table show for one request: the returned tokens and finish type (``None``
    while unanswered), whether ``rid_to_state`` still holds it, and whether the tokenizer manager crashed."""

    tokens: int | None
    finish: str | None
    state_left: bool
    crashed: bool


class WheelSglang:
    """One SGLang server in miniature: the wheel's tokenizer-manager and scheduler functions over stand-in ``self``
    objects, wired as SGLang wires them (``send_to_scheduler`` -> ``Scheduler.abort_request``; the scheduler's
    ``send_to_tokenizer`` -> the tokenizer's ``handle_loop``, delivered by :meth:`pump`). An exception in the
    tokenizer's handling is recorded in ``crash`` (``print_exception_wrapper`` kills the server's process tree)."""

    def __init__(self, wheel: Wheel, max_running: int = 1, eos_token_ids: frozenset[int] = frozenset({2})) -> None:
        self.wheel = wheel
        self.max_running = max_running
        self.eos_token_ids = set(eos_token_ids)
        self.crash: BaseException | None = None
        self._inbox: list[tuple[str, Any]] = []
        self.sent_aborts: list[str] = []  # the ids of the aborts that reached the scheduler
        self.tm = self._tokenizer_manager()
        self.scheduler = self._scheduler()

    # ------------------------------------------------------------------ building from the wheel
    def _tokenizer_manager(self) -> Any:
        namespace: dict[str, Any] = {
            "__name__": f"sglang_{self.wheel.version}_tokenizer_manager",
            "dataclasses": dataclasses,
            "asyncio": asyncio,
            "logger": logging.getLogger("sglang_wheel"),
            "AbortReq": AbortReq,
            "APIServerReqTimeStats": _TimeStats,
            "BatchTokenIDOutput": BatchTokenIDOutput,
            "BatchStrOutput": _NeverInstance,
            "BatchEmbeddingOutput": _NeverInstance,
            "HEALTH_CHECK_RID_PREFIX": "HEALTH_CHECK",
            "is_health_check_generate_req": lambda req: (getattr(req, "rid", None) or "").startswith("HEALTH_CHECK"),
            "get_serving": lambda: _Serving,
            "unwrap_from_pickle": lambda obj: obj,
            "GenerateReqInput": GenerateReqInput,
            "time": time,
            "try_build_beam_search_out_dict": lambda *args: None,  # no beam search
            "get_spec": lambda: SimpleNamespace(speculative_algorithm=None),
        }
        namespace.update(vars(typing))
        loaded = self.wheel.load(
            "tokenizer_manager.py",
            [
                "ReqState",
                "TokenizerManager._init_req_state",
                "TokenizerManager.abort_request",
                "TokenizerManager._handle_abort_req",
                "TokenizerManager._handle_batch_output",
            ],
            namespace,
        )
        self.ReqState = loaded.pop("ReqState")
        harness = self

        class TokenizerManager:
            rid_to_state: dict[str, Any]

            def __init__(self) -> None:
                self.rid_to_state = {}
                self.server_args = SimpleNamespace(
                    enable_trace=False,
                    weight_version="default",
                    skip_tokenizer_init=True,
                    batch_notify_size=1,
                    incremental_streaming_output=False,
                    speculative_algorithm=None,
                    enable_lora=False,
                    language_only=False,
                    dp_size=1,
                )
                self.disaggregation_mode = "null"
                self.enable_metrics = False
                self.enable_trace = False
                self.dump_requests_folder = None
                self.crash_dump_folder = None
                self.incremental_streaming_output = False
                self.send_to_scheduler = SimpleNamespace(send_pyobj=harness._to_scheduler)

            def config_value(self, name: str) -> Any:
                return getattr(self.server_args, name)

            def _dispatch_to_scheduler(self, req: Any) -> None:
                harness._to_scheduler(req)

            def _release_lora_once(self, state: Any) -> None:
                return None

            @staticmethod
            def _get_scheduler_first_token_time(*args: Any) -> None:
                return None

            def generate_request(self, obj: dict[str, Any], request: Any = None):
                return harness.generate_request(obj, request)

            async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
                """scheduler_update_weights_mixin.py@0.5.12:130-132 "self.is_fully_idle()" (hand-written)."""
                assert harness.idle(), "release_memory_occupation should be called only when server is idle."

        for name, method in loaded.items():
            setattr(TokenizerManager, name, method)
        return TokenizerManager()

    def _scheduler(self) -> Any:
        version = self.wheel.version
        finish = self.wheel.load(
            "schedule_batch.py",
            ["BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISHED_MATCHED_REGEX"]
            + ["FINISH_LENGTH", "FINISH_ABORT"],
            {"__name__": f"sglang_{version}_schedule_batch", "HTTPStatus": HTTPStatus, **vars(typing)},
        )
        self.finish_types = finish
        # 0.5.23 renamed Req.check_finished to update_finish_state (and checks EOS before the length cap).
        finish_check = "check_finished" if version == PINNED else "update_finish_state"
        extra = [] if version == PINNED else ["Req._cap_finished_len_at_max_new_tokens"]
        req_methods = self.wheel.load(
            "schedule_batch.py",
            [
                "Req.finished",
                f"Req.{finish_check}",
                "Req._check_token_based_finish",
                "Req._check_vocab_boundary_finish",
                "Req._check_str_based_finish",
                *extra,
            ],
            {"__name__": f"sglang_{version}_schedule_batch", "re": re, **finish, **vars(typing)},
        )
        req_methods["update_finish"] = req_methods[finish_check]
        self.Req = type("Req", (WheelReq,), req_methods)
        names = ["Scheduler.abort_request"]
        if version != PINNED:
            names += [
                "Scheduler.send_abort_output",
                "Scheduler.collect_inflight_reqs",
                "Scheduler._collect_inflight_batches",
                "_make_abort_req",
            ]
        methods = self.wheel.load(
            "scheduler.py",
            names,
            {
                "__name__": f"sglang_{version}_scheduler",
                "AbortReq": AbortReq,
                "FINISH_ABORT": finish["FINISH_ABORT"],
                "HTTPStatus": HTTPStatus,
                "DisaggregationMode": enum.Enum("DisaggregationMode", "NULL PREFILL DECODE"),
                "logger": logging.getLogger("sglang_wheel"),
                "get_parallel": lambda: SimpleNamespace(pp_size=1),
                "get_serving": lambda: SimpleNamespace(weight_version="default"),
                "compute_weight_version_spans": lambda *args, **kwargs: None,
                **vars(typing),
            },
        )
        make_abort_req = methods.pop("_make_abort_req", None)
        harness = self

        class Scheduler:
            def __init__(self) -> None:
                self.waiting_queue: list[Any] = []
                self.running_batch = SimpleNamespace(reqs=[])
                self.cur_batch = None
                self.last_batch = None
                self.chunked_req = None
                self._pending_chunked_abort_req = None
                self.enable_hicache_storage = False
                self.enable_continuous_input_polling = False
                self.result_queue: list[Any] = []
                self.mm_receiver = None
                self.dllm_config = None
                self.rust_server = None
                self.disaggregation_mode = methods["abort_request"].__globals__["DisaggregationMode"].NULL
                self.grammar_manager = SimpleNamespace(abort_requests=lambda recv_req: None)
                self.beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
                channel = SimpleNamespace(send_output=lambda obj, req: harness._inbox.append(("abort", obj)))
                self.send_to_tokenizer = channel
                self.ipc_channels = SimpleNamespace(send_to_tokenizer=channel)

            def _release_aborted_request(self, req: Any) -> None:
                return None

        for name, method in methods.items():
            setattr(Scheduler, name, method)
        if make_abort_req is not None:
            methods["abort_request"].__globals__["_make_abort_req"] = make_abort_req
        return Scheduler()

    # ------------------------------------------------------------------ the wiring
    def _to_scheduler(self, obj: Any) -> None:
        if isinstance(obj, AbortReq):
            self.sent_aborts.append(obj.rid)
            self.scheduler.abort_request(obj)

    async def pump(self) -> None:
        """The tokenizer's ``handle_loop``: deliver what the scheduler sent, in order; the first exception is the
        server's end (``print_exception_wrapper``), after which nothing is handled."""
        while self._inbox and self.crash is None:
            kind, obj = self._inbox.pop(0)
            try:
                if kind == "abort":
                    self.tm._handle_abort_req(obj)
                else:
                    await self.tm._handle_batch_output(obj)
            except Exception as error:  # noqa: BLE001 - what SGLang's wrapper catches
                self.crash = error
        await asyncio.sleep(0)  # let the woken callers run

    async def generate_request(self, obj: dict[str, Any], request: Any = None):
        """``generate_request`` + ``_wait_one_response`` for one non-streaming request, as verl's server calls it:
        the state is registered and the request sent (:meth:`submit`), then the caller waits for its output."""
        sampling = obj["sampling_params"]
        self.submit(obj["rid"], sampling.get("max_new_tokens", 8), sampling.get("ignore_eos", True))
        state = self.tm.rid_to_state[obj["rid"]]
        while not state.out_list:
            await state.event.wait()
            state.event.clear()
        yield state.out_list[-1]

    def idle(self) -> bool:
        """``Scheduler.is_fully_idle``: nothing queued, running or mid chunked prefill."""
        scheduler = self.scheduler
        return not (scheduler.waiting_queue or scheduler.running_batch.reqs or scheduler.chunked_req)

    # ------------------------------------------------------------------ what a server does with requests
    def submit(self, rid: str, max_new_tokens: int = 8, ignore_eos: bool = True) -> None:
        """``generate_request`` up to the send: ``_init_req_state``, then the dispatch stamp and the scheduler's
        waiting queue (0.5.23 also marks ``dispatched``)."""
        obj = GenerateReqInput(rid=rid, is_single=True, stream=False, return_logprob=False, received_time=0.0)
        obj.log_metrics = obj.return_sampling_mask = False
        self.tm._init_req_state(obj)
        state = self.tm.rid_to_state[rid]
        state.time_stats.set_api_server_dispatch_time()
        if hasattr(state, "dispatched"):
            state.dispatched = True
        self.scheduler.waiting_queue.append(self.Req(rid, max_new_tokens, self.eos_token_ids, ignore_eos))

    def step(self, token: int = 7) -> None:
        """One scheduler iteration: queued requests join the running batch up to ``max_running``, every running one
        decodes ``token`` and ``Req.check_finished`` (the wheel's; ``update_finish_state`` in 0.5.23) judges it; a
        finished one leaves the batch and its output goes to the tokenizer (non-streaming: one output, at the end)."""
        scheduler = self.scheduler
        while scheduler.waiting_queue and len(scheduler.running_batch.reqs) < self.max_running:
            scheduler.running_batch.reqs.append(scheduler.waiting_queue.pop(0))
        for req in list(scheduler.running_batch.reqs):
            req.output_ids.append(token)
            req.update_finish()
            if req.finished():
                scheduler.running_batch.reqs.remove(req)
                kept = req.output_ids[: req.finished_len] if req.finished_len is not None else req.output_ids
                self._inbox.append(("output", self._output(req, kept)))

    @staticmethod
    def _output(req: Any, kept: list[int]) -> BatchTokenIDOutput:
        return BatchTokenIDOutput(
            rids=[req.rid],
            finished_reasons=[req.finished_reason.to_json()],
            output_ids=[list(kept)],
            prompt_tokens=[1],
            completion_tokens=[len(kept)],
            reasoning_tokens=[0],
            cached_tokens=[0],
            retraction_counts=[0],
        )

    def outcome(self, rid: str, state: Any) -> Outcome:
        """What ``_wait_one_response`` would hand the caller from ``state`` (its last output), and the table."""
        out = state.out_list[-1] if state.out_list else None
        return Outcome(
            tokens=None if out is None else len(out["output_ids"]),
            finish=None if out is None else out["meta_info"]["finish_reason"]["type"],
            state_left=rid in self.tm.rid_to_state,
            crashed=self.crash is not None,
        )
