"""vLLM's prefix cache as the emulated engine charges it: whole blocks, the last token computed, tail blocks evicted
first, no reset while a request holds blocks (the rules and their vLLM lines: ``core/engines/prefix_cache.py``)."""

from __future__ import annotations

import pytest

from verl_partial.core.engines.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes, cached_tokens

PROMPT = list(range(100, 140))  # 40 tokens: 2 whole blocks and 8 more


def test_a_groups_siblings_share_their_prompts_whole_blocks():
    cache = PrefixCache()
    assert cache.admit("s0", PROMPT) == 0
    # The partial third block is computed again by every sibling: 40 - 32 tokens prefilled each.
    assert [cache.admit(f"s{i}", PROMPT) for i in (1, 2, 3)] == [32, 32, 32]


def test_the_last_token_is_always_computed():
    cache = PrefixCache()
    cache.admit("a", PROMPT[:32])
    # 32 tokens all cached: the last must be computed for its logits, so only the first whole block counts.
    assert cache.admit("b", PROMPT[:32]) == 16
    assert cached_tokens(32, 32) == 16 and cached_tokens(33, 32) == 32 and cached_tokens(1, 0) == 0


def test_a_prompt_shares_blocks_only_up_to_where_the_tokens_differ():
    cache = PrefixCache()
    cache.admit("a", PROMPT)
    diverges_in_block_two = PROMPT[:20] + [7] * 20
    assert cache.admit("b", diverges_in_block_two) == 16
    assert cache.admit("c", [7] + PROMPT[1:]) == 0  # a block's hash covers every token before it
    assert len(block_hashes(PROMPT)) == 40 // BLOCK_TOKENS


def test_a_preempted_request_readmitted_keeps_what_it_computed():
    cache = PrefixCache()
    generated = list(range(500, 530))
    cache.admit("a", PROMPT)
    cache.release("a", PROMPT + generated[:-1])  # preempted: the last sampled token has no KV yet
    # 70 tokens held; 69 computed = 4 whole blocks.
    assert cache.admit("a", PROMPT + generated) == 64


def test_reset_is_refused_while_a_request_holds_blocks_then_forgets_everything():
    cache = PrefixCache()
    cache.admit("a", PROMPT)
    assert not cache.reset()
    assert cache.admit("b", PROMPT) == 32  # the refused reset left the cache as it was
    cache.release("a", PROMPT)
    cache.release("b", PROMPT)
    assert cache.free_blocks == 2
    assert cache.reset()
    assert cache.free_blocks == 0
    assert cache.admit("c", PROMPT) == 0


def test_free_blocks_are_evicted_tail_first_to_leave_the_running_requests_room():
    cache = PrefixCache(capacity_tokens=4 * BLOCK_TOKENS)
    sequence = list(range(4 * BLOCK_TOKENS + 1))
    cache.admit("a", sequence)
    cache.release("a", sequence[:-1], in_use_tokens=0)
    assert cache.free_blocks == 4
    # Another request runs with 2 blocks' worth of context: 2 free blocks fit beside it, the head two.
    cache.admit("other", [9] * 33, in_use_tokens=0)
    cache.release("other", [9] * 32, in_use_tokens=2 * BLOCK_TOKENS)
    assert cache.free_blocks == 2
    assert cache.admit("b", sequence) == 0  # the most recently freed ("other"'s) stayed; "a"'s were evicted
    cache.release("b", sequence[:-1], in_use_tokens=2 * BLOCK_TOKENS)
    assert cache.free_blocks == 2
    assert cache.admit("c", sequence) == 32  # "other"'s went first, then "b"'s tail blocks; its head two stayed


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="capacity_tokens"):
        PrefixCache(capacity_tokens=0)
    cache = PrefixCache()
    cache.admit("a", PROMPT)
    with pytest.raises(ValueError, match="already holds blocks"):
        cache.admit("a", PROMPT)
