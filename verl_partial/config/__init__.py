"""Typed configuration of every block of ours. Pure (no verl, Ray or torch) except :mod:`.job`, which reads the composed
Hydra config and checks our blocks against verl's trainer settings."""
