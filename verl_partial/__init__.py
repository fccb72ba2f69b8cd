"""verl-partial: partial rollout, rollout-correction presets and group-preserving balancing for verl."""

__version__ = "0.1.0"
