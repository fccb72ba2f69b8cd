"""The scheduler's backend protocol, served by simulated vLLM servers in virtual time.

``run_step`` drives this exactly as it drives the glue's Ray workers: waves of calls routed to named servers,
``abort`` of each server at the step end (gates close, vLLM's barrier waits for queued requests' first output, then
running calls return ABORTED with their tokens), ``take_back`` (per-request abort: tokens come back), ``cancel``
(Ray cancel: the call gets nothing back), ``resume`` of each server, chained on its abort as the glue chains it.
The answer lengths come from the workload; the token ids and log-probs are zeros (timing does not depend on them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from verl_partial.core.partial.finish import Finish
from verl_partial.core.partial.pool import GroupState, SegmentRequest, SegmentResult
from verl_partial.sim.engine import EngineOutcome, ServerSpec, SimServer
from verl_partial.sim.workload import Workload


class SimBackend:
    """``servers`` simulated vLLM servers; ``update_weights`` between steps wipes their prefix caches."""

    def __init__(self, spec: ServerSpec, servers: int, workload: Workload) -> None:
        self.spec = spec
        self.workload = workload
        self.engines = {f"sim{i}": SimServer(spec, f"sim{i}") for i in range(servers)}
        self.version = 0
        # Per sample: (attempt, tokens it held last time we saw it). A prefix shorter than what it held means
        # the pool restarted it from its prompt: a new answer is drawn.
        self._attempts: dict[tuple[str, int], tuple[int, int]] = {}
        self._calls: dict[str, tuple[SimServer, asyncio.Future[EngineOutcome], asyncio.Future[SegmentResult]]] = {}
        self._aborts: dict[str, asyncio.Task[None]] = {}  # per server: its last abort
        self._resumes: dict[str, asyncio.Task[None]] = {}  # per server: its last resume (chained on the abort)

    @property
    def servers(self) -> Sequence[str]:
        return list(self.engines)

    def answer_length(self, key: str, prompt: int, index: int, prefix_len: int) -> int:
        attempt, held = self._attempts.get((key, index), (0, 0))
        if prefix_len < held:
            attempt += 1
        self._attempts[(key, index)] = (attempt, prefix_len)
        return self.workload.length(prompt, key, index, attempt)

    def remaining(self, group: GroupState[int], index: int) -> int:
        """Tokens the sample has still to generate (its answer's length, drawn already, less what it holds): what a
        clairvoyant scheduler would know (``simulate(clairvoyant=True)``); a restarted sample's next attempt counts
        from its first segment."""
        attempt, _ = self._attempts.get((group.key, index), (0, 0))
        length = min(self.workload.length(group.prompt, group.key, index, attempt), self.workload.response_length)
        return max(0, length - len(group.samples[index].token_ids))

    def launch(self, wave: list[tuple[GroupState[int], SegmentRequest]]) -> list[asyncio.Future[SegmentResult]]:
        loop = asyncio.get_running_loop()
        futures = []
        for group, request in wave:
            engine = self.engines[request.server]
            index = request.ref.index
            length = self.answer_length(group.key, group.prompt, index, request.prefix_len)
            outcome = engine.submit(
                prompt_key=group.key,
                sample_key=f"{group.key}/{index}",
                prompt_len=self.workload.prompt_len,
                prefix=self.workload.prompt_len + request.prefix_len,
                eos_after=length - request.prefix_len,
                max_new=request.max_new_tokens,
            )
            result: asyncio.Future[SegmentResult] = loop.create_future()
            self._calls[request.request_id] = (engine, outcome, result)
            outcome.add_done_callback(lambda done, r=request, f=result, k=group.key: self._answer(k, r, done, f))
            futures.append(result)
        return futures

    def _answer(
        self,
        key: str,
        request: SegmentRequest,
        done: asyncio.Future[EngineOutcome],
        result: asyncio.Future[SegmentResult],
    ) -> None:
        self._calls.pop(request.request_id, None)
        if result.done():
            return  # cancelled: its tokens never reached the client, so the sample does not hold them
        outcome = done.result()
        attempt, _ = self._attempts[(key, request.ref.index)]
        self._attempts[(key, request.ref.index)] = (attempt, request.prefix_len + outcome.tokens)
        result.set_result(self._segment(request, outcome.tokens, outcome.finish))

    def _segment(self, request: SegmentRequest, tokens: int, finish: Finish) -> SegmentResult:
        return SegmentResult(
            new_ids=np.zeros(tokens, dtype=np.int32),
            new_log_probs=np.zeros(tokens, dtype=np.float32),
            finish=finish,
            server=request.server,
            server_version=self.version,
        )

    async def take_back(self, requests: list[SegmentRequest]) -> None:
        """Abort each call at its server by request id; it answers ABORTED with its tokens so far."""
        for request in requests:
            call = self._calls.get(request.request_id)
            if call is not None:
                call[0].abort_request(call[1])

    async def progress(self, server: str) -> dict[str, int]:
        """Tokens so far of each call the server holds (the scheduler's stall check)."""
        so_far = self.engines[server].tokens_so_far()
        return {rid: so_far[call[1]] for rid, call in self._calls.items() if call[1] in so_far}

    async def cancel(self, requests: list[SegmentRequest]) -> None:
        """Ray cancel: the engine aborts the request (vLLM does on ``CancelledError``) and the call gets nothing."""
        for request in requests:
            call = self._calls.pop(request.request_id, None)
            if call is not None:
                engine, outcome, result = call
                engine.abort_request(outcome)
                if not result.done():
                    result.set_result(self._segment(request, 0, Finish.ABORTED))

    async def abort(self, server: str) -> None:
        task = self._aborts[server] = asyncio.ensure_future(self.engines[server].abort_all_requests())
        await asyncio.shield(task)

    async def resume(self, server: str) -> None:
        """Reopen ``server`` once its abort returned (the pause ends the abort: a resume landing before is undone)."""
        task = self._resumes[server] = asyncio.ensure_future(self._resume_after_abort(server))
        await asyncio.shield(task)

    async def _resume_after_abort(self, server: str) -> None:
        abort = self._aborts.pop(server, None)
        if abort is not None:
            await asyncio.wait([abort])
        self.engines[server].resume()

    def reopening(self) -> dict[str, asyncio.Task[None]]:
        return {server: task for server, task in self._resumes.items() if not task.done()}

    def update_weights(self, version: int) -> None:
        self.version = version
        for engine in self.engines.values():
            engine.update_weights()
