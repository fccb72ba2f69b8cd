#!/usr/bin/env bash
# GRPO on GSM8K with verl's FSDP trainer and a vLLM or SGLang rollout (ROLLOUT=vllm|sglang), partial rollout on
# (verl-partial). grpo_vllm.sh and grpo_sglang.sh run it with ROLLOUT set.
#
# What this script has been run on: composed on CPU in CI only (tests/unit/test_examples.py runs its command
# line through `python -m verl.trainer.main_ppo --cfg job` and `verl-partial check`). It has NEVER been run on
# a GPU: batch sizes and memory settings are verl's usual single-node starting point, not tuned values.
#
# Before: `pip install ".[vllm]"` (or ".[sglang]") from a verl-partial checkout, and GSM8K as parquet
# (verl's examples/data_preprocess/gsm8k.py writes $HOME/data/gsm8k/{train,test}.parquet).
# Validate your edits without GPUs: `verl-partial check <the overrides below>`.
# Compare with verl's synchronous rollout: drop the three +partial/+rollout_correction/+balance lines
# (+partial also sets trainer.use_v1=false, actor_rollout_ref.rollout.calculate_log_probs=true and its
# agent-loop manager; `python -m verl.trainer.main_ppo <overrides> --cfg job` shows every value).
# Extra Hydra overrides given to this script are appended, e.g. `bash examples/grpo.sh trainer.nnodes=2`.
set -euo pipefail

ROLLOUT=${ROLLOUT:-vllm}
case $ROLLOUT in vllm | sglang) ;; *) echo "ROLLOUT must be vllm or sglang, got $ROLLOUT" >&2; exit 2 ;; esac
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/gsm8k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/gsm8k/test.parquet}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}
ROLLOUT_TP=${ROLLOUT_TP:-1}

python3 -m verl.trainer.main_ppo \
    +partial=default \
    +rollout_correction=seq_is_rs \
    +balance=group \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=false \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=true \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.shuffle=false \
    actor_rollout_ref.rollout.name="$ROLLOUT" \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.ref.fsdp_config.param_offload=true \
    trainer.balance_batch=true \
    trainer.critic_warmup=0 \
    trainer.logger='[console]' \
    trainer.project_name=verl_partial_examples \
    trainer.experiment_name="grpo_${ROLLOUT}_partial_default" \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.nnodes="$NNODES" \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 \
    "$@"
