"""The benchmarks and simulations behind the figures in README.md and docs/.

Not part of the installed package: run them from a checkout's root, as modules, e.g.
``python -m benchmarks.bench_balance``; each module's docstring gives its command and method. They import
``verl_partial`` as installed (``pip install -e .``) and their own helpers as ``benchmarks.*``.
"""
