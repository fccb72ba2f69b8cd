"""Partial rollout: the pool of parked samples, the step scheduler and what they decide with."""
