"""Engine quirks that need verl's (or the engine's) code: one module per engine."""
