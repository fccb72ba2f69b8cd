"""Engine quirks that need no verl: how each engine reports why a call stopped, and the per-engine adapter."""
