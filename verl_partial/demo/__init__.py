"""Self-contained demo assets (task, reward, tokenizer, tiny model, parquet files) for running verl on CPU."""

from verl_partial.demo.assets import DemoAssets, build_assets, hydra_overrides
from verl_partial.demo.task import CountdownTask, compute_score

__all__ = ["CountdownTask", "DemoAssets", "build_assets", "compute_score", "hydra_overrides"]
