"""Stop-reason mapping per engine, fed with the TokenOutputs verl 0.9.1's servers build.

Shapes (``verl/workers/rollout/vllm_rollout/vllm_async_server.py`` and ``sglang_rollout/async_sglang_server.py``):
vLLM returns ``stop_reason="completed"`` for vLLM's finish "stop" and "length", ``"aborted"`` for "abort" and for a
request refused by a rejecting gate (``token_ids=[]``, ``log_probs=None``); SGLang returns
``meta_info["finish_reason"]["type"]`` unchanged: "stop", "length" or "abort" (with ``token_ids=[]`` when the
log-probs payload is empty after an abort).
"""

from __future__ import annotations

import pytest
from verl.workers.rollout.replica import TokenOutput

from verl_partial.core.engines.adapter import check_model_len, finish_mapper
from verl_partial.core.engines.sglang import from_sglang
from verl_partial.core.engines.vllm import from_vllm
from verl_partial.core.partial.finish import Finish, eos_id_set, finished

# Qwen2.5: tokenizer eos 151645 (<|im_end|>), generation_config adds 151643 (<|endoftext|>).
EOS_IDS = eos_id_set(151645, [151645, 151643], None)


def _map(mapper, output: TokenOutput, max_tokens: int, eos_ids=EOS_IDS) -> Finish:
    end = mapper(output.stop_reason, output.token_ids, max_tokens, eos_ids)
    assert end.keep == len(output.token_ids)  # none of these runs holds a token after its answer's end
    return end.finish


def test_eos_ids_are_the_union_of_all_sources():
    assert EOS_IDS == {151643, 151645}
    assert eos_id_set(2, None, [7, 8]) == {2, 7, 8}
    assert eos_id_set(None, None, None) == frozenset()


@pytest.mark.parametrize(
    ("output", "max_tokens", "expected"),
    [
        # vLLM finish "stop" on the tokenizer's EOS
        (TokenOutput(token_ids=[5, 6, 151645], log_probs=[-1.0] * 3, stop_reason="completed"), 8, Finish.EOS),
        # ... on generation_config's extra EOS (tokenizer.eos_token_id alone would miss it)
        (TokenOutput(token_ids=[5, 151643], log_probs=[-1.0] * 2, stop_reason="completed"), 8, Finish.EOS),
        # ... on EOS exactly at max_tokens: an EOS, not a budget stop
        (TokenOutput(token_ids=[5, 6, 151645], log_probs=[-1.0] * 3, stop_reason="completed"), 3, Finish.EOS),
        # vLLM finish "stop" on a stop string: vLLM drops the string, the output is short and ends on no EOS
        (TokenOutput(token_ids=[5, 6], log_probs=[-1.0] * 2, stop_reason="completed"), 8, Finish.STOP),
        # vLLM finish "length"
        (TokenOutput(token_ids=[5, 6, 7], log_probs=[-1.0] * 3, stop_reason="completed"), 3, Finish.LENGTH),
        # pause_generation(abort) of a running request: its tokens so far
        (TokenOutput(token_ids=[5, 6], log_probs=[-1.0] * 2, stop_reason="aborted"), 8, Finish.ABORTED),
        # aborted while queued, or refused by a rejecting gate (_park_until_admitted)
        (TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted"), 8, Finish.ABORTED),
    ],
)
def test_vllm_server_outputs(output, max_tokens, expected):
    assert _map(from_vllm, output, max_tokens) is expected
    assert _map(finish_mapper("cpu"), output, max_tokens) is expected  # our CPU server speaks vLLM's words


def test_a_stop_token_id_of_the_request_is_an_eos():
    output = TokenOutput(token_ids=[5, 42], log_probs=[-1.0] * 2, stop_reason="completed")
    assert _map(from_vllm, output, 2, eos_id_set(151645, None, [42])) is Finish.EOS
    assert _map(from_vllm, output, 2) is Finish.LENGTH


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (TokenOutput(token_ids=[5, 151645], log_probs=[-1.0] * 2, stop_reason="stop"), Finish.EOS),
        (TokenOutput(token_ids=[5, 151643], log_probs=[-1.0] * 2, stop_reason="stop"), Finish.EOS),
        (TokenOutput(token_ids=[5, 6], log_probs=[-1.0] * 2, stop_reason="stop"), Finish.STOP),
        (TokenOutput(token_ids=[5, 6, 7], log_probs=[-1.0] * 3, stop_reason="length"), Finish.LENGTH),
        (TokenOutput(token_ids=[5], log_probs=[-1.0], stop_reason="abort"), Finish.ABORTED),
        (TokenOutput(token_ids=[], log_probs=[], stop_reason="abort"), Finish.ABORTED),
    ],
)
def test_sglang_server_outputs(output, expected):
    # SGLang never says "completed": a "stop" without EOS must still end the sample (a stop string).
    assert _map(from_sglang, output, 3) is expected


@pytest.mark.parametrize(
    ("case", "output", "max_tokens", "expected"),
    [
        # 3a: the token SGLang decodes after an abort is an EOS; check_finished tests abort first, so it says "abort".
        # Old mapping: ABORTED -> parked, resumed AFTER its EOS, and trained past it.
        ("extra EOS at abort", TokenOutput(token_ids=[5, 151645], log_probs=[-1.0] * 2, stop_reason="abort"), 8,
         Finish.EOS),
        # 3b: the extra token is the last one allowed; "abort" again. Old mapping: ABORTED with no budget left.
        ("extra last token at abort", TokenOutput(token_ids=[5, 6, 7], log_probs=[-1.0] * 3, stop_reason="abort"), 3,
         Finish.LENGTH),
        # 3c: an EOS that is a segment's last allowed token: length is tested before EOS, so "length".
        # Old mapping: LENGTH -> with chunk_tokens or a step budget the sample resumed after its EOS.
        ("EOS at the budget", TokenOutput(token_ids=[5, 151645], log_probs=[-1.0] * 2, stop_reason="length"), 2,
         Finish.EOS),
    ],
)  # fmt: skip
def test_sglang_reasons_that_hide_the_end_of_an_answer(case, output, max_tokens, expected):
    """Issue 19, failure 3: the last token decides before SGLang's reason does."""
    assert _map(from_sglang, output, max_tokens) is expected, case


def test_a_vllm_abort_that_raced_an_eos_ends_the_answer():
    """vLLM aborts without decoding more, but a request that sampled its EOS in the step the abort landed in comes
    back "aborted" with the EOS last: resuming it would train tokens after the EOS."""
    output = TokenOutput(token_ids=[5, 151645], log_probs=[-1.0] * 2, stop_reason="aborted")
    assert _map(from_vllm, output, 8) is Finish.EOS


def test_unknown_stop_reasons_are_refused_not_guessed():
    with pytest.raises(ValueError, match="unknown vLLM stop_reason 'stop'"):
        from_vllm("stop", [1], 4, EOS_IDS)
    with pytest.raises(ValueError, match="unknown SGLang stop_reason 'completed'"):
        from_sglang("completed", [1], 4, EOS_IDS)
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name must be one of"):
        finish_mapper("trtllm")


def test_finished():
    assert finished(Finish.EOS, 3, 100) and finished(Finish.STOP, 3, 100)
    assert not finished(Finish.LENGTH, 99, 100) and finished(Finish.LENGTH, 100, 100)
    assert not finished(Finish.ABORTED, 99, 100)
    # A sample holding its whole response_length has no budget left: it must be finished whatever the server said,
    # or it could never run again (issue 19, 3b: under staleness_policy=wait the driver then spun forever).
    assert finished(Finish.ABORTED, 100, 100)


def test_max_model_len_too_small_is_refused():
    check_model_len(None, 1024, 16384)
    check_model_len(17408, 1024, 16384)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.max_model_len \(16384\) must be >= "):
        check_model_len(16384, 1024, 16384)


def test_a_null_max_model_len_is_checked_against_the_models_positions():
    """Issue 19, failure 5: with verl's default ``max_model_len: null`` the servers use max_position_embeddings."""
    check_model_len(None, 1024, 16384, max_position_embeddings=32768)
    with pytest.raises(ValueError, match=r"the model's max_position_embeddings \(8192\)"):
        check_model_len(None, 1024, 16384, max_position_embeddings=8192)
    # SGLang caps new tokens at max_model_len - prompt - 1: one token more is needed than on vLLM.
    check_model_len(None, 1024, 16384, max_position_embeddings=17408, rollout_name="vllm")
    with pytest.raises(ValueError, match=r"\+ 1 \(SGLang keeps one token of context back\) = 17409"):
        check_model_len(None, 1024, 16384, max_position_embeddings=17408, rollout_name="sglang")
    # An explicit max_model_len wins over the model's positions, as on the servers.
    check_model_len(17408, 1024, 16384, max_position_embeddings=2048)


def test_mappers_take_numpy_token_arrays():
    """The segment path carries int32 arrays; an array's truth value is ambiguous, its length is not."""
    import numpy as np

    tokens = np.array([5, 6, 151645], dtype=np.int32)
    assert from_vllm("completed", tokens, 3, EOS_IDS).finish is Finish.EOS
    assert from_sglang("stop", tokens, 3, EOS_IDS).finish is Finish.EOS
    assert from_vllm("aborted", np.array([], dtype=np.int32), 3, EOS_IDS).finish is Finish.ABORTED


@pytest.mark.parametrize(
    ("mapper", "reason", "max_tokens"),
    [
        # SGLang 0.5.12 appends a whole accepted speculative run, then tests abort, length, EOS
        # (scheduler_output_processor_mixin.py 552-564): an abort or the length cap reports the run with its EOS inside.
        (from_sglang, "abort", 8),
        (from_sglang, "length", 4),
        (from_sglang, "stop", 8),
        # vLLM's speculative path stops at the first stop token itself; whatever its server returns, the cut holds.
        (from_vllm, "aborted", 8),
        (from_vllm, "completed", 4),
    ],
)
def test_an_eos_inside_a_speculative_run_ends_the_answer_there(mapper, reason, max_tokens):
    """Issue 26, finding 6: the run [5, EOS, 6, 7] is an answer of 2 tokens that ended; the old mappers read only the
    last token, so the sample was parked ABORTED/LENGTH with 4 tokens and resumed after its EOS."""
    end = mapper(reason, [5, 151643, 6, 7], max_tokens, EOS_IDS)
    assert end.finish is Finish.EOS
    assert end.keep == 2
    assert list(end.cut([5, 151643, 6, 7])) == [5, 151643]
    assert list(end.cut([-0.1, -0.2, -0.3, -0.4])) == [-0.1, -0.2]
    # The FIRST EOS ends it, not the last.
    assert mapper(reason, [151645, 5, 151643], max_tokens, EOS_IDS).keep == 1


def test_an_sglang_abort_run_past_max_tokens_is_cut_at_max_tokens():
    """At an abort SGLang 0.5.12 returns the whole accepted speculative run (``finished_len`` caps a length finish
    only), which can pass the call's max_new_tokens: the pool refused such a segment as over its budget."""
    end = from_sglang("abort", [5, 6, 7, 8, 9], 3, EOS_IDS)
    assert (end.finish, end.keep, list(end.cut([5, 6, 7, 8, 9]))) == (Finish.LENGTH, 3, [5, 6, 7])
    # An EOS past max_tokens is past the budget too: the answer did not end within it.
    assert from_sglang("abort", [5, 6, 7, 151643], 3, EOS_IDS) == end
    assert from_sglang("abort", [5, 151643, 7, 8], 3, EOS_IDS).keep == 2
