"""vLLM's automatic prefix cache as an engine model: which prompt tokens a GPU server would not prefill again.

On a GPU, verl's vLLM servers run with ``actor_rollout_ref.rollout.enable_prefix_caching=True`` (verl's default), so
the samples of a GRPO group share their prompt's KV blocks, and a request preempted and re-admitted before its blocks
are evicted keeps them. A step's prefill cost depends on it, so an engine whose step time is modelled on a GPU
(``backend.emulate_gpu``) must charge only what vLLM would compute. The rules, read from vLLM 0.24.0:

* **Whole blocks only.** KV is cached in blocks of 16 tokens (vllm/config/cache.py@0.24.0:46 "DEFAULT_BLOCK_SIZE:
  ClassVar[int] = 16", which FlashAttention keeps on CUDA), each named by a hash chained over every token before it;
  a hit is the longest run of leading blocks whose hashes are cached. A block is findable from the step that schedules
  it (vllm/v1/core/kv_cache_manager.py@0.24.0:456 "self.coordinator.cache_blocks(request, num_tokens_to_cache)"), so
  siblings admitted in one step after the first hit its prompt.
* **The last token is always computed** (vllm/v1/core/kv_cache_manager.py@0.24.0:227 "max_cache_hit_length =
  request.num_tokens - 1"): its logits sample the next token. A hit is therefore at most ``tokens - 1`` rounded down
  to whole blocks.
* **Blocks live while referenced, then in a free queue, evicted oldest first.** A request's blocks are freed when it
  ends or is preempted, tail blocks first (vllm/v1/core/single_type_kv_cache_manager.py@0.24.0:408 "Free blocks in
  reverse order so that the tail blocks are freed first."), and stay findable until a new allocation takes them: free
  cached blocks plus the running requests' context fit the KV cache.
* **Reset** drops every hash, and is refused while a request holds blocks
  (vllm/v1/core/block_pool.py@0.24.0:666 "if num_used_blocks != 1:"). verl resets at every step-end abort
  (``abort_all_requests(reset_prefix_cache=True)``) and after every weight update: nothing is reused across steps.

Token ids are the whole input: two requests share blocks exactly when their leading tokens agree.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16


def cached_tokens(tokens: int, hit_tokens: int) -> int:
    """vLLM's hit rule: of ``hit_tokens`` leading tokens found cached, the whole blocks before the last token."""
    return max(0, min(hit_tokens, tokens - 1)) // BLOCK_TOKENS * BLOCK_TOKENS


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """One hash per full block, each chained over the blocks before it (a partial last block has none)."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hash((parent, tuple(tokens[start : start + BLOCK_TOKENS])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """The cached blocks of one server. ``capacity_tokens``: its KV cache (``None``: free blocks are never
    evicted, as on a server whose cache outgrows every workload)."""

    def __init__(self, capacity_tokens: int | None = None) -> None:
        if capacity_tokens is not None and capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1 or None, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._refs: Counter[int] = Counter()  # blocks held by admitted requests
        self._held: dict[str, list[int]] = {}  # request id -> the blocks it holds
        self._free: OrderedDict[int, None] = OrderedDict()  # released blocks still findable, evicted from the front

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def admit(self, request_id: str, tokens: Sequence[int], in_use_tokens: int = 0) -> int:
        """A request joins the batch with ``tokens`` (prompt and any tokens it generated before): returns the tokens
        it need not prefill. Its full blocks are held until :meth:`release`. ``in_use_tokens``: the running
        requests' context, which the free blocks must leave room for."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds blocks; release it first")
        self._evict(in_use_tokens)
        hashes = block_hashes(tokens)
        hits = 0
        for block in hashes:
            if block not in self._refs and block not in self._free:
                break
            hits += 1
        for block in hashes:
            self._free.pop(block, None)
            self._refs[block] += 1
        self._held[request_id] = hashes
        return cached_tokens(len(tokens), hits * BLOCK_TOKENS)

    def release(self, request_id: str, computed: Sequence[int], in_use_tokens: int = 0) -> None:
        """A request leaves the batch (finished, aborted or preempted) having computed the KV of ``computed``: its
        full blocks join the free queue, tail first. A request that never joined holds nothing."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        for block in held:
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
        for block in reversed(block_hashes(computed)):
            if block not in self._refs:
                self._free[block] = None
                self._free.move_to_end(block)
        self._evict(in_use_tokens)

    def reset(self) -> bool:
        """Forget every block, as vLLM's ``reset_prefix_cache``; refused (False) while a request holds blocks."""
        if self._held:
            return False
        self._free.clear()
        return True

    def _evict(self, in_use_tokens: int) -> None:
        if self.capacity_tokens is None:
            return
        room = max(0, self.capacity_tokens - in_use_tokens) // BLOCK_TOKENS
        while len(self._free) > room:
            self._free.popitem(last=False)
