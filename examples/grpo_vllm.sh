#!/usr/bin/env bash
# GRPO on GSM8K with verl's vLLM rollout and partial rollout: examples/grpo.sh with ROLLOUT=vllm.
# Before: `pip install ".[vllm]"` from a verl-partial checkout. What it has been run on: composed on CPU in CI only;
# it has NEVER been run on a GPU.
ROLLOUT=vllm exec bash "$(dirname "$0")/grpo.sh" "$@"
