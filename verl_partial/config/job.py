"""Reads our blocks out of verl's composed config into typed dataclasses, failing fast on bad input.

Hydra hands verl an OmegaConf tree; our groups add top-level blocks (``backend``, ``partial``,
``rollout_correction``, ``balance``). Each block maps one to one onto a dataclass, so an unknown key
or a bad value is reported with its full key name -- in the driver, before Ray starts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from verl_partial.config.backend import BackendConfig
from verl_partial.config.balance import BalanceConfig
from verl_partial.config.partial import STATE_FILE, PartialConfig
from verl_partial.config.v1_only_keys import check_v1_only_keys, filter_groups_enabled
from verl_partial.core.engines.adapter import check_model_len, finish_mapper
from verl_partial.core.partial.group_filter import GroupFilter
from verl_partial.core.partial.pool import check_carry_fits

T = TypeVar("T")

PARTIAL_MANAGER = "verl_partial.glue.partial.rollout.PartialAgentLoopManager"


def block_values(config: DictConfig | dict[str, Any], block: str) -> dict[str, Any]:
    """``config[block]`` as a plain dict ({} when absent); a plain string there is a group that was never composed."""
    raw = config.get(block) if config is not None else None
    if raw is None:
        return {}
    if isinstance(raw, DictConfig):
        return OmegaConf.to_container(raw, resolve=True)
    if isinstance(raw, Mapping):
        return dict(raw)
    raise ValueError(
        f"{block} is the plain value {raw!r}, not verl-partial's config group {block}: either Hydra did not find "
        f"verl-partial's groups (check that `python -c 'import hydra_plugins.verl_partial_searchpath'` works in this "
        f"Python, i.e. verl-partial is installed there), or a YAML file wrote `{block}: {raw}` as a value. Select the "
        f"group with `+{block}={raw}` on the command line, or `- {block}: {raw}` in your config's defaults list"
    )


def block_to_dataclass(config: DictConfig | dict[str, Any], block: str, cls: type[T]) -> T:
    """Build ``cls`` from ``config[block]``; unknown keys are an error naming ``block.key``, bad values are refused
    by the dataclass itself, naming ``block.key`` and the allowed values."""
    values = block_values(config, block)
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {[f'{block}.{key}' for key in unknown]}; allowed keys: {sorted(known)}")
    return cls(**values)  # the dataclass checks types and values (verl_partial.config.checks)


def backend_config(config: DictConfig) -> BackendConfig | None:
    if config.get("backend") is None:
        return None
    return block_to_dataclass(config, "backend", BackendConfig)


def partial_config(config: DictConfig) -> PartialConfig | None:
    """The partial-rollout config when ``+partial=...`` was selected and enabled, else None."""
    if config.get("partial") is None:
        return None
    parsed = block_to_dataclass(config, "partial", PartialConfig)
    return parsed if parsed.enable else None


def group_filter_of(config: DictConfig) -> GroupFilter | None:
    """``algorithm.filter_groups`` as the pool's group filter, or None when not enabled (checked at start-up by
    :func:`verl_partial.config.v1_only_keys.check_filter_groups`)."""
    if not filter_groups_enabled(config):
        return None
    block = config.algorithm.filter_groups
    return GroupFilter(metric=str(block.metric), max_num_gen_batches=int(block.get("max_num_gen_batches", 0) or 0))


def balance_config(config: DictConfig) -> BalanceConfig | None:
    """The typed ``balance`` block, or None without ``+balance=...``."""
    if config.get("balance") is None:
        return None
    return block_to_dataclass(config, "balance", BalanceConfig)


# Agent loops partial rollout can park and resume: verl's single-turn loop and verl's tool agent loop.
PARTIAL_AGENT_LOOPS = ("single_turn_agent", "tool_agent")


def max_positions_of(hf_config: Any) -> int | None:
    """The model's ``max_position_embeddings``, found where verl 0.9.1 looks (``workers/rollout/utils.py`` 31-40,
    ``get_max_position_embeddings``): on the config, else on its ``text_config`` (multimodal models)."""
    value = getattr(hf_config, "max_position_embeddings", None)
    if value is None:
        value = getattr(getattr(hf_config, "text_config", None), "max_position_embeddings", None)
    return int(value) if value is not None else None


def model_max_positions(model_path: str | None, *, trust_remote_code: bool = False) -> int | None:
    """The model's ``max_position_embeddings``, read here with transformers' ``AutoConfig`` from local files only
    (a local folder or a hub id already in the HF cache): what vLLM and SGLang use as the context when
    ``actor_rollout_ref.rollout.max_model_len`` is null (verl's default).

    None when the config cannot be read here (a hub id not downloaded yet, a remote path verl copies later): then
    :func:`verl_partial.glue.partial_agent_loop.check_loaded_model_len` checks it in every rollout worker, on the
    config verl has loaded, before the first call -- the check is never skipped, only made later.
    """
    if not model_path:
        return None
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(
            os.path.expanduser(str(model_path)), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError):  # not on this machine, or a model type this process cannot read
        return None
    return max_positions_of(hf_config)


def check_partial_against_trainer(config: DictConfig) -> None:
    """Combinations partial rollout cannot honour fail here, naming the verl key to change."""
    rollout = config.actor_rollout_ref.rollout
    problems = []
    if str(config.algorithm.adv_estimator).lower() == "remax":
        problems.append("algorithm.adv_estimator=remax is unsupported: its greedy baseline rollouts are not groups")
    if not rollout.get("calculate_log_probs", False):
        problems.append(
            "actor_rollout_ref.rollout.calculate_log_probs must be true: parked samples keep per-token log-probs"
        )
    manager = rollout.get("agent", {}).get("agent_loop_manager_class")
    if manager != PARTIAL_MANAGER:
        problems.append(f"actor_rollout_ref.rollout.agent.agent_loop_manager_class must be {PARTIAL_MANAGER}")
    # The segment path runs verl's single-turn loop or its tool agent loop (verl_partial/glue/partial/tool_loop.py).
    agent_loop = rollout.get("agent", {}).get("default_agent_loop", "single_turn_agent")
    if agent_loop not in PARTIAL_AGENT_LOOPS:
        problems.append(
            f"actor_rollout_ref.rollout.agent.default_agent_loop must be one of {list(PARTIAL_AGENT_LOOPS)} for "
            f"partial rollout, got {agent_loop!r}"
        )
    checks: list[tuple[Any, tuple[Any, ...]]] = [
        (
            functools.partial(
                check_model_len,
                max_position_embeddings=model_max_positions(
                    config.actor_rollout_ref.model.get("path"),
                    trust_remote_code=bool(config.actor_rollout_ref.model.get("trust_remote_code", False)),
                ),
                rollout_name=str(rollout.get("name") or "vllm"),
            ),
            (rollout.get("max_model_len"), config.data.max_prompt_length, config.data.max_response_length),
        )
    ]
    parsed = partial_config(config)
    if parsed is not None:
        checks.append((check_carry_fits, (parsed, int(config.data.train_batch_size))))
    if rollout.get("name") is not None:  # verl requires a name; only bare test configs lack it
        checks.append((finish_mapper, (str(rollout.name),)))  # an engine whose stop reasons we have not read
    for check, args in checks:
        try:
            check(*args)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("partial rollout cannot run with this config:\n  - " + "\n  - ".join(problems))


def check_balance_against_trainer(config: DictConfig) -> None:
    """Group-preserving balancing relies on the actor splitting its shard into mini-batches in order."""
    balance = block_to_dataclass(config, "balance", BalanceConfig)
    if not config.trainer.get("balance_batch", True):
        raise ValueError("balance needs trainer.balance_batch=true: verl only balances (and we only hook) then")
    if balance.enable and config.actor_rollout_ref.actor.get("shuffle", False):
        raise ValueError(
            "balance.enable=true needs actor_rollout_ref.actor.shuffle=false: a shuffled actor regroups "
            "mini-batches per rank, so no order can keep groups together"
        )
    if balance.enable and uses_critic(config):
        check_balance_critic(config)
    if balance.rows == "transition":
        check_transition_rows(config)


def check_transition_rows(config: DictConfig) -> None:
    """``balance.rows=transition`` cuts multi-turn rows into model turns and mirrors verl v1's GRPO rule; refuse
    the settings it cannot honour, naming each key."""
    rollout, algorithm = config.actor_rollout_ref.rollout, config.algorithm
    problems = []
    if not rollout.get("multi_turn", {}).get("enable", False):
        problems.append(
            "actor_rollout_ref.rollout.multi_turn.enable must be true: a single-turn row is already one transition"
        )
    if str(algorithm.adv_estimator).lower() != "grpo":
        problems.append(
            f"algorithm.adv_estimator must be grpo (got {algorithm.adv_estimator}): advantages are computed per "
            "trajectory from its final transition and broadcast, verl v1's rule, which verl defines for GRPO only"
        )
    if uses_critic(config):
        problems.append("no critic (critic.enable=false): values per transition are not defined by verl")
    if algorithm.get("use_kl_in_reward", False):
        problems.append(
            "algorithm.use_kl_in_reward must be false: GRPO reads the final transition's reward, which would drop "
            "the KL penalty of the trajectory's earlier turns"
        )
    if problems:
        raise ValueError("balance.rows=transition cannot run with this config:\n  - " + "\n  - ".join(problems))


def uses_critic(config: DictConfig) -> bool:
    """verl 0.9.1's ``need_critic``: ``critic.enable`` when set, else whether the advantage estimator is GAE."""
    enable = config.get("critic", {}).get("enable")
    if enable is not None:
        return bool(enable)
    return str(config.algorithm.adv_estimator).lower() == "gae"


def check_balance_critic(config: DictConfig, *, critic_dp_size: int | None = None, actor_dp_size: int | None = None):
    """The critic trains on the same balanced batch (``RayPPOTrainer._update_critic``): its mini-batches keep
    the groups only if each is a union of whole actor mini-batches -- a multiple of the actor's mini-batch
    size, the same dp size, in order.

    The dp sizes are known only once the workers exist; the trainer hook passes them on the first step.
    """
    critic, actor = config.critic, config.actor_rollout_ref.actor
    problems = []
    if critic.get("shuffle", False):
        problems.append("critic.shuffle must be false: a shuffled critic regroups its mini-batches per rank")
    critic_mb, actor_mb = critic.get("ppo_mini_batch_size"), actor.get("ppo_mini_batch_size")
    if not (isinstance(critic_mb, int) and isinstance(actor_mb, int) and actor_mb > 0 and critic_mb % actor_mb == 0):
        problems.append(
            f"critic.ppo_mini_batch_size={critic_mb} must be a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor_mb}: the balancer packs groups into the actor's "
            "mini-batches, so a critic mini-batch must be a union of whole ones"
        )
    if critic_dp_size is not None and critic_dp_size != actor_dp_size:
        problems.append(
            f"the critic's data-parallel size ({critic_dp_size}) must equal the actor's ({actor_dp_size}): each rank "
            "cuts its own shard into mini-batches, so other shards regroup them. Give the critic the actor's "
            "parallel layout (critic.ulysses_sequence_parallel_size and the critic's model parallel sizes equal to "
            "actor_rollout_ref.actor's)"
        )
    if problems:
        raise ValueError(
            "balance.enable=true with a critic (critic.enable, or algorithm.adv_estimator=gae) needs:\n  - "
            + "\n  - ".join(problems)
            + "\nor set balance.enable=false"
        )


def check_trainer_path(config: DictConfig) -> None:
    """Our groups that hook verl's legacy RayPPOTrainer refuse verl's v1 PPOTrainer (``trainer.use_v1=true``).

    v1 (verl 0.9.1's default) never builds RayPPOTrainer, so those hooks would silently not run.
    Rollout correction is not listed: it reaches verl's own keys through the composed config, which
    both trainers read.
    """
    if not config.trainer.get("use_v1", False):
        ours = [f"+{block}" for block in ("partial", "backend", "balance") if config.get(block) is not None]
        if ours:
            check_v1_only_keys(config, " and ".join(ours), partial=partial_config(config) is not None)
        return
    reasons = []
    if config.get("backend") is not None:
        reasons.append(
            f"+backend={block_values(config, 'backend').get('name')}: the CPU backend is tested on verl's legacy "
            "RayPPOTrainer only (v1 also needs TransferQueue, which verl-partial does not install)"
        )
    if partial_config(config) is not None:
        reasons.append(
            "+partial: partial rollout hooks RayPPOTrainer's dataloader, agent-loop manager and checkpoints, "
            "which the v1 PPOTrainer does not build"
        )
    if config.get("balance") is not None:
        reasons.append(
            "+balance: the v1 PPOTrainer always runs its own sample-level _balance_batch (it pads the batch and "
            "spreads samples over ranks regardless of groups) and offers no hook to replace or measure it"
        )
    if reasons:
        raise ValueError(
            "trainer.use_v1 must be false (verl's legacy RayPPOTrainer) for:\n  - "
            + "\n  - ".join(reasons)
            + "\nThe +partial and +backend groups set trainer.use_v1=false; a later trainer.use_v1=true undoes "
            "that. Set trainer.use_v1=false, or drop these groups to run verl's v1 trainer."
        )


def correction_config(config: DictConfig | dict[str, Any]):
    """The typed ``rollout_correction`` block (a ``RolloutCorrectionConfig``), or None without one."""
    from verl_partial.config.correction import BLOCK, from_mapping

    if config.get(BLOCK) is None:
        return None
    return from_mapping(block_values(config, BLOCK))


def check_correction_against_trainer(config: DictConfig, correction: Any, *, partial_enabled: bool) -> None:
    """The composed config must already hold in verl's keys exactly what our block asks for.

    Our groups write ``algorithm.rollout_correction`` (and, for bypass, the actor's policy loss) by
    interpolation from the ``rollout_correction`` block, so any verl trainer reads them as they are;
    nothing rewrites them later. A mismatch means they were also set by hand: refuse it.
    """
    from verl_partial.config.correction import BLOCK, BYPASS_LOSS_MODE, check_against_trainer, to_verl_fields

    policy_loss = config.actor_rollout_ref.actor.policy_loss
    check_against_trainer(
        correction,
        calculate_log_probs=bool(config.actor_rollout_ref.rollout.get("calculate_log_probs", False)),
        policy_loss_mode=policy_loss.get("loss_mode", "vanilla"),
    )
    if correction.max_staleness is not None and not partial_enabled:
        raise ValueError(
            f"{BLOCK}.max_staleness={correction.max_staleness} needs +partial: token ages come from the "
            f"per-token policy versions partial rollout records. Add +partial=default, or set "
            f"{BLOCK}.max_staleness=null"
        )
    choice = _selected_group_option(BLOCK)
    if choice is not None and choice != correction.preset:
        raise ValueError(
            f"{BLOCK}.preset={correction.preset!r} but the group selected is +{BLOCK}={choice}: {BLOCK}.preset only "
            f"labels the values the group wrote, every other key still holds {choice}'s. Select the preset with "
            f"+{BLOCK}={correction.preset} (and override single keys with {BLOCK}.<key>=...)"
        )
    expected = to_verl_fields(correction)
    written = block_values(config.algorithm, BLOCK)
    for key, value in expected.items():
        if written.get(key) != value:
            raise ValueError(
                f"algorithm.{BLOCK}.{key} is {written.get(key)!r} but {BLOCK} (preset {correction.preset!r}) asks for "
                f"{value!r}: set rollout correction in one place only. With +{BLOCK}=<preset>, change "
                f"{BLOCK}.<key> and leave algorithm.{BLOCK} to the group (it interpolates it from {BLOCK})"
            )
    if correction.bypass_mode:
        in_loss = block_values(policy_loss, BLOCK)
        if any(in_loss.get(key) != value for key, value in expected.items()):
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.{BLOCK} must equal algorithm.{BLOCK} with "
                f"{BLOCK}.bypass_mode=true (the '{BYPASS_LOSS_MODE}' loss reads its correction there), got "
                f"{in_loss}: leave it to the +{BLOCK} group, which sets it to ${{algorithm.{BLOCK}}}"
            )


def _selected_group_option(group: str) -> str | None:
    """The option Hydra composed for ``group`` (``+group=option``), when running under Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def check_resume_keeps_partial(config: DictConfig, *, partial_enabled: bool) -> None:
    """A checkpoint written with +partial holds parked groups and drawn prompts only partial rollout can resume."""
    if partial_enabled:
        return
    folder = _resume_folder(config.trainer)
    if folder is None:
        return
    state = os.path.join(folder, STATE_FILE)
    if os.path.exists(state):
        raise ValueError(
            f"trainer.resume_mode={config.trainer.resume_mode} resumes {folder}, whose {state} holds partial-rollout "
            "state (parked groups and prompts already drawn from the dataloader), but this run has no +partial: "
            "they would be silently dropped. Add +partial=<the preset of the run that wrote it>, or start fresh "
            "with trainer.resume_mode=disable or another trainer.default_local_dir"
        )


def _resume_folder(trainer: DictConfig) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` would resume, or None (same rules as verl 0.9.1)."""
    mode = trainer.get("resume_mode", "auto")
    if mode == "disable" or trainer.get("default_hdfs_dir") is not None:
        return None
    if mode == "resume_path":
        path = trainer.get("resume_from_path")
        return os.path.abspath(path) if isinstance(path, str) else None
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path, get_checkpoint_tracker_filename

    root = os.path.abspath(trainer.default_local_dir)
    return find_latest_ckpt_path(root) if os.path.exists(get_checkpoint_tracker_filename(root)) else None


def validate_root_config(config: DictConfig) -> None:
    """Validate every block of ours present in ``config``; raises ValueError naming the key."""
    backend_config(config)
    partial = partial_config(config)
    if partial is not None:
        check_partial_against_trainer(config)
    if config.get("balance") is not None:
        check_balance_against_trainer(config)
    check_trainer_path(config)
    correction = correction_config(config)
    if correction is not None:
        check_correction_against_trainer(config, correction, partial_enabled=partial is not None)
    check_resume_keeps_partial(config, partial_enabled=partial is not None)
