"""verl-partial's patches of verl, one module per concern, applied by :func:`verl_partial.patches.apply.install`."""
