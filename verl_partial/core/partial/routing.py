"""Which server runs a segment: least loaded, capped, sticky only within a step.

Facts this rests on (verl 0.9.1): the prefix cache of vLLM and SGLang servers is cleared by the abort at a step
end (``clear_cache=True``), by ``clear_kv_cache`` after the weight update and by ``wake_up``, so nothing of a
sample's prefix survives into the next step and stickiness across steps buys no cache hit -- it only pins the
longest samples to one server. Within a step, the next chunk of a sample (``partial.chunk_tokens``) can hit the
prefix its previous chunk left on its server, so the router keeps it there while that server has room.

The cap (``partial.max_calls_per_server``) stays below the server actor's Ray ``max_concurrency`` (1000 by
default), so control calls (abort, resume, sleep) always find a free slot on an actor busy with generate calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class ServerLoad:
    """What a server has outstanding from this client: calls and their token work (prefix + new tokens)."""

    calls: int = 0
    tokens: int = 0


class Router:
    """Least-loaded routing over ``servers`` with a per-server cap and within-step stickiness.

    A server judged stalled (no result for ``partial.request_timeout_s``) is avoided until it answers again or
    the step ends; when every server is avoided, all are candidates again (there is nowhere else to go).
    """

    def __init__(self, servers: Sequence[str], max_calls_per_server: int) -> None:
        if not servers:
            raise ValueError("the rollout backend reports no servers to route to")
        if len(set(servers)) != len(servers):
            raise ValueError(f"server addresses must be unique, got {list(servers)}")
        self.servers = list(servers)
        self.max_calls_per_server = max_calls_per_server
        self.load = {server: ServerLoad() for server in self.servers}
        self.avoided: set[str] = set()
        # The most calls one server had outstanding at once: above the engine's max_num_seqs, requests queued there.
        self.peak_calls = 0

    def pick(self, tokens: int, sticky: str | None) -> str | None:
        """The server for a call of ``tokens`` work, or None when every candidate is at its cap.

        ``sticky`` (the server of the sample's previous chunk this step) wins while it is a candidate with room;
        otherwise the fewest outstanding calls, then the fewest outstanding tokens, then list order.
        """
        healthy = [server for server in self.servers if server not in self.avoided] or self.servers
        open_ = [server for server in healthy if self.load[server].calls < self.max_calls_per_server]
        if not open_:
            return None
        if sticky in open_:
            return sticky
        return min(open_, key=lambda server: (self.load[server].calls, self.load[server].tokens))

    def add(self, server: str, tokens: int) -> None:
        self.load[server].calls += 1
        self.load[server].tokens += tokens
        self.peak_calls = max(self.peak_calls, self.load[server].calls)

    def remove(self, server: str, tokens: int) -> None:
        load = self.load[server]
        if load.calls < 1 or load.tokens < tokens:
            raise RuntimeError(f"server {server} has no such outstanding call ({load})")
        load.calls -= 1
        load.tokens -= tokens

    def avoid(self, server: str) -> None:
        self.avoided.add(server)

    def answered(self, server: str) -> None:
        self.avoided.discard(server)
