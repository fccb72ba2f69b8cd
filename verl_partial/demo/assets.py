"""Locally generated demo assets: tokenizer, tiny Qwen2 model, RL parquet files, reward function.

Why: the CPU end-to-end tests and ``verl-partial demo`` must run verl's GRPO trainer without network access and in
seconds, yet still show the long-tailed response lengths that partial rollout is about. Everything here is built
from the countdown task in :mod:`verl_partial.demo.task` with fixed seeds and a single torch thread, so two builds
with the same parameters produce byte-identical files, and a cache directory can be reused across runs.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from verl_partial.demo import task as task_module
from verl_partial.demo.task import CountdownTask, answer_text, prompt_text

# Bump whenever the produced files change for the same parameters, so stale caches are rebuilt.
ASSET_VERSION = "1"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# ChatML, as in Qwen2: verl picks its Qwen continuous-token builder from model_type "qwen2", and that builder
# requires "<|im_end|>" to exist and "\n" to be one token. List-of-parts content is accepted because verl's
# chat-template helpers probe templates with {"type": "text", ...} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MODEL_SUBDIR = "model"
DATA_SUBDIR = "data"
MANIFEST_NAME = "manifest.json"
_STAGING_NAME = ".staging"

# Examples the tokenizer and the model are fitted on; drawn from their own seeded stream, not from train/val.
_PRETRAIN_EXAMPLES = 4096
# Tokens per pretraining batch (examples are grouped by length, so the long tail costs no padding). Small on
# purpose: at a fixed compute budget, many small steps fit this task much better than a few large ones.
_TOKENS_PER_BATCH = 256
_LEARNING_RATE = 3e-3
_WARMUP_STEPS = 10
# Sequence budgets are rounded up to this multiple so small parameter changes keep the same verl shapes.
_LENGTH_ROUNDING = 32
_MAX_POSITIONS = 1024


@dataclass(frozen=True)
class BuildParams:
    """Everything that determines the built files; stored in the manifest to decide whether a cache is valid."""

    seed: int
    train_size: int
    val_size: int
    train_steps: int
    vocab_size: int
    task: CountdownTask


@dataclass(frozen=True)
class DemoAssets:
    """Paths and sequence budgets of a built asset directory."""

    root: Path
    model_dir: Path
    train_parquet: Path
    val_parquet: Path
    reward_fn_path: Path
    reward_fn_name: str
    max_prompt_length: int
    max_response_length: int


def build_assets(
    cache_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    train_size: int = 256,
    val_size: int = 32,
    train_steps: int = 1500,
    vocab_size: int = 512,
    task: CountdownTask | None = None,
) -> DemoAssets:
    """Build the demo assets into ``cache_dir``, or reuse them if its manifest matches these parameters.

    ``train_steps`` trades build time for model quality: the default (about 15 s on one core) gives a model whose
    sampled response lengths follow the task's long tail; tests pass a few dozen steps because they only need
    loadable, EOS-emitting files. ``vocab_size`` is an upper bound: BPE runs out of merges on this small corpus
    below 300 tokens. The manifest is written last, so an interrupted build is redone rather than reused; two
    processes must not build into the same directory at once.
    """
    params = BuildParams(
        seed=seed,
        train_size=train_size,
        val_size=val_size,
        train_steps=train_steps,
        vocab_size=vocab_size,
        task=task or CountdownTask(),
    )
    root = Path(cache_dir).expanduser().resolve()
    manifest_path = root / MANIFEST_NAME
    expected = {"version": ASSET_VERSION, "params": asdict(params)}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if {key: manifest.get(key) for key in expected} == expected:
            return _assets(root, manifest)

    staging = root / _STAGING_NAME
    if staging.exists():
        shutil.rmtree(staging)
    (staging / DATA_SUBDIR).mkdir(parents=True)
    with _single_thread():
        lengths = _build_into(staging, params)

    manifest_path.unlink(missing_ok=True)
    for name in (MODEL_SUBDIR, DATA_SUBDIR):
        if (root / name).exists():
            shutil.rmtree(root / name)
        os.replace(staging / name, root / name)
    staging.rmdir()
    manifest = {**expected, **lengths}
    tmp_manifest = root / (MANIFEST_NAME + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_manifest, manifest_path)
    return _assets(root, manifest)


def hydra_overrides(assets: DemoAssets) -> list[str]:
    """verl 0.9.1 Hydra overrides (``ppo_trainer`` config) that point a GRPO run at these assets.

    ``reward.custom_reward_function`` is the current location of the reward hook (the top-level
    ``custom_reward_function`` is the legacy spelling that verl copies over when set).
    """
    return [
        f"data.train_files={_hydra_value(str(assets.train_parquet))}",
        f"data.val_files={_hydra_value(str(assets.val_parquet))}",
        f"data.max_prompt_length={assets.max_prompt_length}",
        f"data.max_response_length={assets.max_response_length}",
        f"actor_rollout_ref.model.path={_hydra_value(str(assets.model_dir))}",
        f"reward.custom_reward_function.path={_hydra_value(str(assets.reward_fn_path))}",
        f"reward.custom_reward_function.name={assets.reward_fn_name}",
    ]


def _assets(root: Path, manifest: dict[str, Any]) -> DemoAssets:
    return DemoAssets(
        root=root,
        model_dir=root / MODEL_SUBDIR,
        train_parquet=root / DATA_SUBDIR / "train.parquet",
        val_parquet=root / DATA_SUBDIR / "val.parquet",
        reward_fn_path=Path(task_module.__file__).resolve(),
        reward_fn_name=task_module.REWARD_FUNCTION_NAME,
        max_prompt_length=manifest["max_prompt_length"],
        max_response_length=manifest["max_response_length"],
    )


def _hydra_value(value: str) -> str:
    """Quote a value for Hydra's override grammar only when it holds characters that grammar would misread."""
    if re.fullmatch(r"[A-Za-z0-9_/.+-]+", value):
        return value
    if "'" in value:
        raise ValueError(f"cannot pass a path containing a single quote to Hydra: {value!r}")
    return f"'{value}'"


@contextmanager
def _single_thread() -> Iterator[None]:
    """Pin torch to one thread (shared CPUs, and bitwise-reproducible reductions), restoring the caller's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_into(out: Path, params: BuildParams) -> dict[str, int]:
    """Write tokenizer, model and parquet files under ``out``; return the verl sequence budgets they need."""
    pretrain_counts = _sample_counts(params, "pretrain", _PRETRAIN_EXAMPLES)
    tokenizer = _train_tokenizer(pretrain_counts, params)
    model_dir = out / MODEL_SUBDIR
    tokenizer.save_pretrained(model_dir)

    train_counts = _sample_counts(params, "train", params.train_size)
    val_counts = _sample_counts(params, "val", params.val_size)
    _rl_frame(train_counts, "train").to_parquet(out / DATA_SUBDIR / "train.parquet", index=False)
    _rl_frame(val_counts, "val").to_parquet(out / DATA_SUBDIR / "val.parquet", index=False)

    sequences = [_example_ids(tokenizer, count) for count in pretrain_counts]
    model = _pretrain_model(tokenizer, sequences, params)
    model.save_pretrained(model_dir)
    # transformers does not serialise the attention backend; putting it in config.json makes plain
    # ``from_pretrained`` pick eager attention, which is what the CPU backend runs.
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["attn_implementation"] = "eager"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    counts = range(params.task.min_count, params.task.max_count + 1)
    max_prompt = max(len(_example_ids(tokenizer, count)[0]) for count in counts)
    max_answer = len(_example_ids(tokenizer, params.task.max_count)[1])
    max_response_length = _round_up(max_answer)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_response_length,
    ).save_pretrained(model_dir)
    return {"max_prompt_length": _round_up(max_prompt), "max_response_length": max_response_length}


def _round_up(length: int) -> int:
    return math.ceil(length / _LENGTH_ROUNDING) * _LENGTH_ROUNDING


def _sample_counts(params: BuildParams, stream: str, size: int) -> list[int]:
    """Draw ``size`` countdown starts from a stream of its own, so e.g. resizing train leaves val unchanged."""
    rng = random.Random(f"{params.seed}:{stream}")
    return [params.task.sample_count(rng) for _ in range(size)]


def _train_tokenizer(counts: list[int], params: BuildParams) -> PreTrainedTokenizerBase:
    """Fit Qwen2's tokenizer pipeline (byte-level BPE, one token per digit) on the task's text.

    transformers 5 loads any ``model_type: qwen2`` checkpoint with ``Qwen2Tokenizer``, which rebuilds Qwen's
    normaliser and pre-tokeniser around the saved vocabulary whatever ``tokenizer.json`` says; training through
    that same class is what keeps the tokenizer the model was fitted with identical to the one verl loads. Byte level
    also makes decode an exact inverse of encode, which matters because verl's reward manager scores decoded text.
    """
    texts = ["user\n", "assistant\n", "system\n"]
    for count in counts:
        texts += [prompt_text(count), answer_text(count)]
    tokenizer = Qwen2Tokenizer().train_new_from_iterator(
        texts, vocab_size=params.vocab_size, new_special_tokens=[IM_START, IM_END]
    )
    tokenizer.bos_token = PAD_TOKEN
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = _MAX_POSITIONS
    return tokenizer


def _rl_frame(counts: list[int], split: str) -> pd.DataFrame:
    """Rows in the layout verl's ``RLHFDataset`` and naive reward manager read."""
    return pd.DataFrame(
        [
            {
                "data_source": task_module.DATA_SOURCE,
                "prompt": [{"role": "user", "content": prompt_text(count)}],
                "ability": task_module.ABILITY,
                "reward_model": {"style": "rule", "ground_truth": answer_text(count)},
                "extra_info": {"split": split, "index": index, "count": count},
            }
            for index, count in enumerate(counts)
        ]
    )


def _example_ids(tokenizer: PreTrainedTokenizerBase, count: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) exactly as a rollout sees them: templated prompt, then answer and EOS."""
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text(count)}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    response_ids = tokenizer.encode(answer_text(count), add_special_tokens=False) + [tokenizer.eos_token_id]
    return list(prompt_ids), response_ids


def _pretrain_model(
    tokenizer: PreTrainedTokenizerBase, sequences: list[tuple[list[int], list[int]]], params: BuildParams
) -> Qwen2ForCausalLM:
    """Fit a tiny Qwen2 to the responses by next-token prediction, so its sampled lengths track the task's.

    The loss covers only response tokens (prompt positions are masked), as the policy is never asked to produce
    prompts. Batches hold examples of similar length under a token budget, so long-tail examples are seen as often,
    per token, as short ones and no compute goes to padding.
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params.seed)
        model = Qwen2ForCausalLM(config)
    model.train()

    batches = _length_grouped_batches(sequences, tokenizer.pad_token_id)
    order = random.Random(f"{params.seed}:batches")
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, params.train_steps), last_epoch=-1
    )
    for _ in range(params.train_steps):
        input_ids, attention_mask, labels = batches[order.randrange(len(batches))]
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    return model


def _lr_factor(step: int, total_steps: int) -> float:
    """Linear warmup then cosine decay to zero: stable with a high peak rate, which keeps the step count small."""
    if step < _WARMUP_STEPS:
        return (step + 1) / _WARMUP_STEPS
    progress = (step - _WARMUP_STEPS) / max(1, total_steps - _WARMUP_STEPS)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _length_grouped_batches(
    sequences: list[tuple[list[int], list[int]]], pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask, labels) batches of similar-length examples under a token budget."""
    ordered = sorted(sequences, key=lambda seq: len(seq[0]) + len(seq[1]))
    groups: list[list[tuple[list[int], list[int]]]] = [[]]
    for seq in ordered:
        width = len(seq[0]) + len(seq[1])
        if groups[-1] and (len(groups[-1]) + 1) * width > _TOKENS_PER_BATCH:
            groups.append([])
        groups[-1].append(seq)

    batches = []
    for group in groups:
        width = max(len(prompt) + len(response) for prompt, response in group)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)
        labels = torch.full((len(group), width), -100, dtype=torch.long)
        for row, (prompt, response) in enumerate(group):
            ids = prompt + response
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            labels[row, len(prompt) : len(ids)] = torch.tensor(response)
        batches.append((input_ids, attention_mask, labels))
    return batches
