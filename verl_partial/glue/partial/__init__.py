"""Partial rollout inside verl's agent loop: the manager, the workers' loops and the segment backend."""
