#!/usr/bin/env bash
# GRPO on GSM8K with verl's SGLang rollout and partial rollout: examples/grpo.sh with ROLLOUT=sglang.
# Before: `pip install ".[sglang]"` from a verl-partial checkout. What it has been run on: composed on CPU in CI only;
# it has NEVER been run on a GPU.
ROLLOUT=sglang exec bash "$(dirname "$0")/grpo.sh" "$@"
