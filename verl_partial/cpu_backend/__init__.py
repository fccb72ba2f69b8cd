"""CPU rollout backend; the engine lives in ``verl_partial.cpu_backend.engine`` (pure PyTorch, no verl / ray)."""
