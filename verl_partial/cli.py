"""``verl-partial demo``: verl's own GRPO trainer on the CPU backend, with partial rollout on.

The demo is the README's first command and the base of the end-to-end tests: both build their
command line with :func:`demo_command`, so what the tests exercise is what users run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("VERL_PARTIAL_CACHE", Path.home() / ".cache" / "verl-partial")) / "demo"

# A small GRPO run sized for a 2-core machine: 8 prompts x 4 samples per step, one FSDP rank.
DEMO_TRAINER_OVERRIDES = (
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "algorithm.use_kl_in_reward=false",
    "data.val_max_samples=16",
    "trainer.val_before_train=false",
    "trainer.project_name=verl_partial_demo",
    "trainer.experiment_name=cpu_demo",
)


def demo_command(
    assets_overrides: Sequence[str],
    *,
    steps: int,
    output_dir: Path,
    partial: str | None = "default",
    extra: Sequence[str] = (),
    backend: str = "cpu",
) -> list[str]:
    """The full ``python -m verl.trainer.main_ppo`` command of the demo (and of the e2e tests).

    An override in ``extra`` replaces the demo's own value for the same key (Hydra rejects a key
    given twice). ``backend`` picks the rollout engine: ``cpu`` (ours) or ``cpu_vllm`` (verl's vLLM rollout).
    """
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"+backend={backend}"]
    if partial is not None:
        command.append(f"+partial={partial}")
    defaults = [
        *assets_overrides,
        *DEMO_TRAINER_OVERRIDES,
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        f"trainer.save_freq={steps}",
        f"trainer.default_local_dir={output_dir / 'checkpoints'}",
        "trainer.logger=[console]",
    ]
    replaced = {_override_key(item) for item in extra}
    return command + [item for item in defaults if _override_key(item) not in replaced] + list(extra)


def _override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _demo(args: argparse.Namespace) -> int:
    from verl_partial.demo.assets import build_assets, hydra_overrides

    print(f"building demo assets in {args.cache_dir} (reused when already built)", flush=True)
    assets = build_assets(Path(args.cache_dir))
    output_dir = Path(args.output_dir).resolve()
    command = demo_command(
        hydra_overrides(assets),
        steps=args.steps,
        output_dir=output_dir,
        partial=None if args.no_partial else args.partial,
        extra=args.overrides,
    )
    print("running:\n  " + " \\\n    ".join(shlex.quote(part) for part in command), flush=True)
    return subprocess.call(command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verl-partial", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run verl's GRPO trainer on the CPU backend with partial rollout")
    demo.add_argument("--steps", type=int, default=4, help="GRPO steps (default 4)")
    demo.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where the model/tokenizer/data are built")
    demo.add_argument("--output-dir", default="verl_partial_demo", help="checkpoints go here")
    demo.add_argument("--partial", default="default", help="partial-rollout preset (hydra_configs/partial/)")
    demo.add_argument("--no-partial", action="store_true", help="plain synchronous verl rollout")
    demo.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. +rollout_correction=seq_is_rs")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
