"""Self-contained demo assets (task, reward, tokenizer, tiny model, parquet files) for running verl on CPU.

Import the modules themselves (``verl_partial.demo.assets``, ``.task``, ``.summary``): this package imports
nothing, so that ``verl-partial --help`` does not load torch and transformers through the asset builder.
"""
