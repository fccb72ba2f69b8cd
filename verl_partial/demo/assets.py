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
from verl_partial.demo.task import (
    CountdownTask,
    answer_text,
    prompt_text,
    split_count,
    tool_call_text,
    tool_prompt_text,
)

# Bump whenever the produced files change for the same parameters, so stale caches are rebuilt.
ASSET_VERSION = "3"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Hermes tool-call markers (what verl's ``multi_turn.format=hermes`` parser looks for); single tokens in the
# tool-use tokenizer, so a call is a short sequence the tiny model learns quickly.
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# verl tool config (``multi_turn.tool_config_path``) registering :class:`verl_partial.demo.tools.CalculatorTool`.
TOOL_CONFIG_PATH = Path(__file__).with_name("tool_config.yaml")

# ChatML, as in Qwen2: verl picks its Qwen continuous-token builder from model_type "qwen2", and that builder
# requires "<|im_end|>" to exist and "\n" to be one token. List-of-parts content is accepted because verl's
# chat-template helpers probe templates with {"type": "text", ...} parts. Assistant tool calls render in the Hermes
# format (as Qwen2.5 does), tool results as a "tool" turn. The tools list is not rendered: the demo model learns its
# one tool in pretraining, and prompts stay short.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
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
# Tool-use assets: fraction of pretraining examples that call the calculator (the others answer directly), so the
# pretrained model calls the tool often but not always and RL has something to learn.
_TOOL_CALL_RATE = 0.75
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
    tool_use: bool = False


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
    tool_use: bool = False


@dataclass(frozen=True)
class Example:
    """One pretraining sequence. ``loss_mask`` marks the response ids the model produces (1) as opposed to tool
    output it is shown (0, no loss): the response mask verl's tool agent loop builds at rollout."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


def build_assets(
    cache_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    train_size: int = 256,
    val_size: int = 32,
    train_steps: int = 1500,
    vocab_size: int = 512,
    task: CountdownTask | None = None,
    tool_use: bool = False,
) -> DemoAssets:
    """Build the demo assets into ``cache_dir``, or reuse them if its manifest matches these parameters.

    ``train_steps`` trades build time for model quality: the default (about 15 s on one core) gives a model whose
    sampled response lengths follow the task's long tail; tests pass a few dozen steps because they only need
    loadable, EOS-emitting files. ``vocab_size`` is an upper bound: BPE runs out of merges on this small corpus
    below 300 tokens. ``tool_use`` builds the tool-use variant instead (prompts "Count down from a+b to 1." and a
    model that usually calls the calculator of :mod:`verl_partial.demo.tools`; run it with :func:`tool_overrides`).
    The manifest is written last, so an interrupted build is redone rather than reused; two
    processes must not build into the same directory at once.
    """
    params = BuildParams(
        seed=seed,
        train_size=train_size,
        val_size=val_size,
        train_steps=train_steps,
        vocab_size=vocab_size,
        task=task or CountdownTask(),
        tool_use=tool_use,
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


def tool_overrides() -> list[str]:
    """Overrides that run verl's own ``ToolAgentLoop`` with the demo calculator (for ``tool_use`` assets).

    Hermes is the tool-call format the tool-use tokenizer and model are built for; one call per turn and at most
    three assistant turns bound a trajectory even when the model keeps calling.
    """
    return [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={_hydra_value(str(TOOL_CONFIG_PATH))}",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ]


def _assets(root: Path, manifest: dict[str, Any]) -> DemoAssets:
    tool_use = bool(manifest["params"]["tool_use"])
    return DemoAssets(
        root=root,
        model_dir=root / MODEL_SUBDIR,
        train_parquet=root / DATA_SUBDIR / "train.parquet",
        val_parquet=root / DATA_SUBDIR / "val.parquet",
        reward_fn_path=Path(task_module.__file__).resolve(),
        reward_fn_name=task_module.TOOL_REWARD_FUNCTION_NAME if tool_use else task_module.REWARD_FUNCTION_NAME,
        max_prompt_length=manifest["max_prompt_length"],
        max_response_length=manifest["max_response_length"],
        tool_use=tool_use,
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
    pretrain = _sample_problems(params, "pretrain", _PRETRAIN_EXAMPLES)
    tokenizer = _train_tokenizer(pretrain, params)
    model_dir = out / MODEL_SUBDIR
    tokenizer.save_pretrained(model_dir)

    for split, size in (("train", params.train_size), ("val", params.val_size)):
        frame = _rl_frame(_sample_problems(params, split, size), split)
        frame.to_parquet(out / DATA_SUBDIR / f"{split}.parquet", index=False)

    calls = random.Random(f"{params.seed}:pretrain:calls")
    examples = [
        _example(tokenizer, problem, calls_tool=problem.terms is not None and calls.random() < _TOOL_CALL_RATE)
        for problem in pretrain
    ]
    model = _pretrain_model(tokenizer, examples, params)
    model.save_pretrained(model_dir)
    # transformers does not serialise the attention backend; putting it in config.json makes plain
    # ``from_pretrained`` pick eager attention, which is what the CPU backend runs.
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["attn_implementation"] = "eager"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # Longest prompt and response any problem can have: the largest count, and for tool use every way to write it
    # as a sum (prompt and call length depend on the digits), with the tool call when there is one.
    largest = params.task.max_count
    if params.tool_use:
        worst = [_Problem(largest, split_terms) for split_terms in ((a, largest - a) for a in range(1, largest))]
    else:
        counts = range(params.task.min_count, largest + 1)
        worst = [_Problem(count, None) for count in counts]
    worst_examples = [_example(tokenizer, problem, calls_tool=params.tool_use) for problem in worst]
    max_prompt = max(len(example.prompt_ids) for example in worst_examples)
    max_response_length = _round_up(max(len(example.response_ids) for example in worst_examples))
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


@dataclass(frozen=True)
class _Problem:
    """One countdown problem; ``terms`` = (a, b) for the tool-use prompt "Count down from a+b to 1."."""

    count: int
    terms: tuple[int, int] | None

    def user_text(self) -> str:
        return prompt_text(self.count) if self.terms is None else tool_prompt_text(*self.terms)


def _sample_problems(params: BuildParams, stream: str, size: int) -> list[_Problem]:
    """Draw ``size`` problems from a stream of their own, so e.g. resizing train leaves val unchanged.

    The counts come from the same stream whether or not ``tool_use`` is on; the split into a sum has its own.
    """
    rng = random.Random(f"{params.seed}:{stream}")
    counts = [params.task.sample_count(rng) for _ in range(size)]
    if not params.tool_use:
        return [_Problem(count, None) for count in counts]
    terms_rng = random.Random(f"{params.seed}:{stream}:terms")
    return [_Problem(count, split_count(count, terms_rng)) for count in counts]


def _train_tokenizer(problems: list[_Problem], params: BuildParams) -> PreTrainedTokenizerBase:
    """Fit Qwen2's tokenizer pipeline (byte-level BPE, one token per digit) on the task's text.

    transformers 5 loads any ``model_type: qwen2`` checkpoint with ``Qwen2Tokenizer``, which rebuilds Qwen's
    normaliser and pre-tokeniser around the saved vocabulary whatever ``tokenizer.json`` says; training through
    that same class is what keeps the tokenizer the model was fitted with identical to the one verl loads. Byte level
    also makes decode an exact inverse of encode, which matters because verl's reward manager scores decoded text.
    The tool-use tokenizer also learns the tool call and tool turn text, with the Hermes markers as special tokens.
    """
    texts = ["user\n", "assistant\n", "system\n"]
    special_tokens = [IM_START, IM_END]
    if params.tool_use:
        texts.append("tool\n")
        special_tokens += [TOOL_CALL_START, TOOL_CALL_END]
    for problem in problems:
        texts += [problem.user_text(), answer_text(problem.count)]
        if problem.terms is not None:
            texts += [tool_call_text(*problem.terms), str(problem.count)]
    tokenizer = Qwen2Tokenizer().train_new_from_iterator(
        texts, vocab_size=params.vocab_size, new_special_tokens=special_tokens
    )
    tokenizer.bos_token = PAD_TOKEN
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = _MAX_POSITIONS
    return tokenizer


def _rl_frame(problems: list[_Problem], split: str) -> pd.DataFrame:
    """Rows in the layout verl's ``RLHFDataset`` and naive reward manager read."""
    rows = []
    for index, problem in enumerate(problems):
        extra_info: dict[str, Any] = {"split": split, "index": index, "count": problem.count}
        if problem.terms is not None:
            extra_info["terms"] = list(problem.terms)
        rows.append(
            {
                "data_source": task_module.DATA_SOURCE if problem.terms is None else task_module.TOOL_DATA_SOURCE,
                "prompt": [{"role": "user", "content": problem.user_text()}],
                "ability": task_module.ABILITY,
                "reward_model": {"style": "rule", "ground_truth": answer_text(problem.count)},
                "extra_info": extra_info,
            }
        )
    return pd.DataFrame(rows)


def _example(tokenizer: PreTrainedTokenizerBase, problem: _Problem, *, calls_tool: bool) -> Example:
    """The token ids a rollout of ``problem`` sees: templated prompt, then the response and its loss mask.

    Without a tool call the response is the answer and EOS. With one it is the Hermes call and EOS (the model's
    turn), the tool turn exactly as verl's continuous-token builder appends it for this ChatML template (the tail of
    the templated conversation, mask 0), then the answer and EOS.
    """
    user = {"role": "user", "content": problem.user_text()}
    prompt_ids = _render(tokenizer, [user])
    answer_ids = tokenizer.encode(answer_text(problem.count), add_special_tokens=False) + [tokenizer.eos_token_id]
    if not calls_tool:
        return Example(prompt_ids, answer_ids, [1] * len(answer_ids))
    if problem.terms is None:
        raise ValueError("a tool call needs a tool-use problem")
    call_ids = tokenizer.encode(tool_call_text(*problem.terms), add_special_tokens=False) + [tokenizer.eos_token_id]
    expression = "{}+{}".format(*problem.terms)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    conversation = [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(problem.count)},
    ]
    full_ids = _render(tokenizer, conversation)
    produced = prompt_ids + call_ids
    if full_ids[: len(produced)] != produced:
        raise AssertionError("the chat template does not render a tool call as the model generates it")
    tool_turn_ids = full_ids[len(produced) :]
    return Example(
        prompt_ids,
        call_ids + tool_turn_ids + answer_ids,
        [1] * len(call_ids) + [0] * len(tool_turn_ids) + [1] * len(answer_ids),
    )


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def random_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    seed: int,
) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 Qwen2 on ``tokenizer``'s vocabulary, the same for a given seed on every machine.

    The demo's model and the benchmarks' larger ones share it, so every engine sees one architecture family with
    tied embeddings and eager attention (what both rollout engines and FSDP load without downloads).
    """
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def _pretrain_model(
    tokenizer: PreTrainedTokenizerBase, examples: list[Example], params: BuildParams
) -> Qwen2ForCausalLM:
    """Fit a tiny Qwen2 to the responses by next-token prediction, so its sampled lengths track the task's.

    The loss covers only the tokens the model produces (prompt and tool-output positions are masked), as the policy
    is never asked to produce those. Batches hold examples of similar length under a token budget, so long-tail
    examples are seen as often, per token, as short ones and no compute goes to padding.
    """
    # head size 64 / 2 = 32: the smallest vLLM's CPU attention supports (vLLM's Qwen2 derives it from hidden size
    # and heads and ignores a ``head_dim`` key), so the same model runs on both rollout engines.
    model = random_qwen2(
        tokenizer, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, seed=params.seed
    )
    model.train()

    batches = _length_grouped_batches(examples, tokenizer.pad_token_id)
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
    examples: list[Example], pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded (input_ids, attention_mask, labels) batches of similar-length examples under a token budget."""

    def width(example: Example) -> int:
        return len(example.prompt_ids) + len(example.response_ids)

    groups: list[list[Example]] = [[]]
    for example in sorted(examples, key=width):
        if groups[-1] and (len(groups[-1]) + 1) * width(example) > _TOKENS_PER_BATCH:
            groups.append([])
        groups[-1].append(example)

    batches = []
    for group in groups:
        batch_width = max(width(example) for example in group)
        input_ids = torch.full((len(group), batch_width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(group), batch_width), dtype=torch.long)
        labels = torch.full((len(group), batch_width), -100, dtype=torch.long)
        for row, example in enumerate(group):
            ids = example.prompt_ids + example.response_ids
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            targets = [t if keep else -100 for t, keep in zip(example.response_ids, example.loss_mask, strict=True)]
            labels[row, len(example.prompt_ids) : len(ids)] = torch.tensor(targets)
        batches.append((input_ids, attention_mask, labels))
    return batches
