"""GPU-regime simulator: the real partial-rollout scheduler against a roofline model of vLLM, in virtual time.

Pure Python + numpy (no verl, no Ray), so pip users can project their own shape: ``verl-partial simulate``.
"""
