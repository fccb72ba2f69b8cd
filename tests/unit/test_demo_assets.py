"""The demo assets must load through verl 0.9.1's own code paths and be reproducible, cheap and long-tailed."""

import hashlib
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from verl_partial.demo.assets import DemoAssets, build_assets, hydra_overrides
from verl_partial.demo.task import answer_text, compute_score, prompt_text

# Enough pretraining for EOS-terminated samples, little enough to build in about a second.
TEST_TRAIN_STEPS = 60


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    return build_assets(tmp_path_factory.mktemp("demo_assets"), train_steps=TEST_TRAIN_STEPS)


@pytest.fixture(scope="session")
def tokenizer(assets: DemoAssets) -> PreTrainedTokenizerBase:
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(assets.model_dir))


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_same_seed_builds_identical_files(assets: DemoAssets, tmp_path: Path) -> None:
    reference = _file_hashes(assets.root)
    assert _file_hashes(build_assets(tmp_path / "seed0", train_steps=TEST_TRAIN_STEPS).root) == reference
    other_seed = _file_hashes(build_assets(tmp_path / "seed1", seed=1, train_steps=TEST_TRAIN_STEPS).root)
    assert other_seed["model/model.safetensors"] != reference["model/model.safetensors"]
    assert other_seed["data/train.parquet"] != reference["data/train.parquet"]


def test_build_is_skipped_when_manifest_matches_and_redone_when_not(tmp_path: Path) -> None:
    first = build_assets(tmp_path, train_steps=1, train_size=8, val_size=4)
    weights = first.model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_assets(tmp_path, train_steps=1, train_size=8, val_size=4) == first
    assert weights.stat().st_mtime_ns == stamp

    rebuilt = build_assets(tmp_path, train_steps=1, train_size=12, val_size=4)
    assert len(pd.read_parquet(rebuilt.train_parquet)) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "manifest.json", "model"]


def test_tokenizer_round_trip_and_chat_template(assets: DemoAssets, tokenizer: PreTrainedTokenizerBase) -> None:
    text = f"{prompt_text(37)}\n{answer_text(37)}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) <= 512
    assert len(tokenizer.encode("\n", add_special_tokens=False)) == 1  # required by verl's Qwen CT builder
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.bos_token_id is not None

    messages = [{"role": "user", "content": prompt_text(5)}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|im_start|>user\n{prompt_text(5)}<|im_end|>\n<|im_start|>assistant\n"
    # transformers 5 returns a BatchEncoding by default; verl normalises either form.
    from verl.utils.tokenizer import normalize_token_ids

    prompt_ids = normalize_token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert tokenizer.decode(prompt_ids) == rendered
    response_ids = tokenizer.encode(answer_text(5), add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(response_ids, skip_special_tokens=True) == answer_text(5)


def test_verl_agent_loop_tokenization(tokenizer: PreTrainedTokenizerBase) -> None:
    """The single-turn agent loop tokenises prompts with the continuous-token builder chosen by model_type."""
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2")
    assert isinstance(builder, QwenContinuousTokenBuilder)
    messages = [{"role": "user", "content": prompt_text(12)}]
    prompt_ids = builder.build_initial_tokens(messages)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_ids == list(expected)


def test_parquet_loads_through_verl_rlhf_dataset(
    assets: DemoAssets, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    config = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": assets.max_prompt_length,
            "filter_overlong_prompts": True,
            "filter_overlong_prompts_workers": 1,
            "cache_dir": str(tmp_path),
        }
    )
    dataset = RLHFDataset(str(assets.train_parquet), tokenizer, config)
    assert len(dataset) == len(pd.read_parquet(assets.train_parquet))  # nothing filtered as overlong

    row = dataset[3]
    # verl 0.9.1 leaves tokenisation to the agent loop, so rows carry the chat, not input_ids.
    assert row["raw_prompt"][0]["role"] == "user"
    assert row["index"] == 3
    input_ids = tokenizer.apply_chat_template(
        row["raw_prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert 0 < len(input_ids) <= assets.max_prompt_length
    assert compute_score(
        data_source=row["data_source"],
        solution_str=row["reward_model"]["ground_truth"],
        ground_truth=row["reward_model"]["ground_truth"],
        extra_info=row["extra_info"],
    ) == pytest.approx(1.0)
    batch = collate_fn([dataset[i] for i in range(4)])
    assert batch["dummy_tensor"].shape == (4, 1)


def _compose_verl_config(overrides: list[str]) -> DictConfig:
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_hydra_overrides_compose_with_verl_config_and_load_reward(assets: DemoAssets) -> None:
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = _compose_verl_config(hydra_overrides(assets))
    assert config.data.train_files == str(assets.train_parquet)
    assert config.data.val_files == str(assets.val_parquet)
    assert config.actor_rollout_ref.model.path == str(assets.model_dir)
    assert config.actor_rollout_ref.rollout.prompt_length == assets.max_prompt_length
    assert config.actor_rollout_ref.rollout.response_length == assets.max_response_length

    reward_fn = get_custom_reward_fn(config)
    assert reward_fn(data_source="x", solution_str="3 2 1", ground_truth="3 2 1", extra_info={}) == 1.0


def test_hydra_overrides_quote_unusual_paths(assets: DemoAssets) -> None:
    odd = Path("/tmp/demo assets, v=2 [x]/train.parquet")
    config = _compose_verl_config(hydra_overrides(replace(assets, train_parquet=odd)))
    assert config.data.train_files == str(odd)


def test_reward_gives_partial_credit_and_penalises_overrun() -> None:
    truth = answer_text(4)  # "4 3 2 1"
    assert compute_score("d", truth, truth) == 1.0
    assert compute_score("d", f" {truth} ", truth) == 1.0
    assert compute_score("d", "4 3 9 1", truth) == 0.5
    assert compute_score("d", "4 3 2 1 0 -1", truth) == pytest.approx(4 / 6)
    assert compute_score("d", "5 4 3 2 1", truth) == 0.0
    assert compute_score("d", "", truth) == 0.0


def test_answer_lengths_have_a_long_tail(assets: DemoAssets, tokenizer: PreTrainedTokenizerBase) -> None:
    truths = pd.read_parquet(assets.train_parquet)["reward_model"].map(lambda rm: rm["ground_truth"])
    lengths = np.array([len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in truths])
    p50, p99 = np.percentile(lengths, [50, 99])
    assert p99 / p50 >= 8
    assert lengths.max() <= assets.max_response_length


def test_model_loads_and_generates_eos_terminated_responses(
    assets: DemoAssets, tokenizer: PreTrainedTokenizerBase
) -> None:
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM's CPU attention minimum head size
    assert config.max_position_embeddings >= 1024
    assert config.vocab_size == len(tokenizer)
    assert config._attn_implementation == "eager"
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert AutoTokenizer.from_pretrained(assets.model_dir).encode(answer_text(20)) == tokenizer.encode(answer_text(20))

    torch.manual_seed(0)
    for count in (2, 3, 7, 15):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt_text(count)}],
            add_generation_prompt=True,
            return_dict=False,
            return_tensors="pt",
        )
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt))
        response = output[0, prompt.shape[1] :].tolist()
        assert response[-1] == tokenizer.eos_token_id
        assert len(response) <= assets.max_response_length
