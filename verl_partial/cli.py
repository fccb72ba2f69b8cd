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
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from verl_partial.demo.summary import METRICS_GLOB, Summary, metrics_file, read_steps, run_metric_files
from verl_partial.sim.cli import add_arguments as add_simulate_arguments
from verl_partial.sim.cli import run as simulate

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


def _run_dir(args: argparse.Namespace) -> Path:
    """The demo's output folder: ``--output``, else a new timestamped folder beside the cached assets.

    Without ``--resume`` a run is always fresh: a default folder is new, and an ``--output`` already
    holding a run is refused rather than resumed or overwritten. ``--resume`` continues ``--output``
    or, without it, the most recent default folder.
    """
    runs = Path(args.cache_dir).resolve() / "runs"
    if args.output is not None:
        run_dir = Path(args.output).resolve()
    elif args.resume:
        previous = sorted(path for path in runs.glob("*") if path.is_dir()) if runs.exists() else []
        if not previous:
            raise SystemExit(f"--resume: no previous demo run under {runs}; start one without --resume")
        run_dir = previous[-1]
    else:
        run_dir = runs / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    holds_run = (run_dir / "checkpoints").exists() or any(run_dir.glob(METRICS_GLOB))
    if holds_run and not args.resume:
        raise SystemExit(f"{run_dir} already holds a demo run: pass --resume to continue it, or another --output")
    if args.resume and not holds_run:
        raise SystemExit(f"--resume: {run_dir} holds no demo run to continue")
    return run_dir


def _latest_checkpoint(checkpoints: Path) -> Path | None:
    tracker = checkpoints / "latest_checkpointed_iteration.txt"
    return checkpoints / f"global_step_{tracker.read_text().strip()}" if tracker.exists() else None


def _demo(args: argparse.Namespace) -> int:
    from verl_partial.demo.assets import build_assets, hydra_overrides

    run_dir = _run_dir(args)
    checkpoints = run_dir / "checkpoints"
    latest = _latest_checkpoint(checkpoints)
    if args.resume and latest is not None and int(latest.name.rpartition("_")[2]) >= args.steps:
        raise SystemExit(
            f"{latest} is already step {latest.name.rpartition('_')[2]}: pass --steps above it to train on"
        )
    print(f"building demo assets in {args.cache_dir} (reused when already built)", flush=True)
    assets = build_assets(Path(args.cache_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    command = demo_command(
        hydra_overrides(assets),
        steps=args.steps,
        output_dir=run_dir,
        partial=None if args.no_partial else args.partial,
        extra=[
            "trainer.logger=[console,file]",
            f"trainer.resume_mode={'auto' if args.resume else 'disable'}",
            *args.overrides,
        ],
    )
    log_path = run_dir / "verl.log"
    metrics_path = metrics_file(run_dir)
    print(f"demo run folder: {run_dir}", flush=True)
    print("running:\n  " + " \\\n    ".join(shlex.quote(part) for part in command), flush=True)
    print(f"verl's output goes to {log_path} (follow it with: tail -f {shlex.quote(str(log_path))})", flush=True)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path)}
    with open(log_path, "a") as log:
        process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
        reported: set[int] = set()
        while process.poll() is None:
            time.sleep(2.0)
            _report_progress(metrics_path, reported, args.steps)
        _report_progress(metrics_path, reported, args.steps)
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        print("\n".join(["", f"verl exited with {process.returncode}; last lines of {log_path}:", *tail]), flush=True)
        return process.returncode
    summary = Summary.from_steps(read_steps(run_metric_files(run_dir)))
    print(
        "\n"
        + summary.render(
            run_dir=run_dir, log_path=log_path, checkpoint=_latest_checkpoint(checkpoints), twin=_twin_command(args)
        )
    )
    return 0


def _twin_command(args: argparse.Namespace) -> str:
    """The demo run to compare with: the same steps and overrides, partial rollout switched the other way."""
    switch = "--partial default" if args.no_partial else "--no-partial"
    what = "with partial rollout" if args.no_partial else "with verl's synchronous rollout"
    extra = " ".join(shlex.quote(item) for item in args.overrides)
    command = f"verl-partial demo {switch} --steps {args.steps}" + (f" {extra}" if extra else "")
    return f"{command}   (the same run {what})"


def _report_progress(metrics_path: Path, reported: set[int], total: int) -> None:
    """One line per finished training step, read from verl's metrics file while the run goes on."""
    for step, data in sorted(read_steps([metrics_path]).items()):
        if step in reported or "timing_s/step" not in data:
            continue
        reported.add(step)
        generation = data.get("timing_s/gen")
        print(
            f"  step {step}/{total} done: {data['timing_s/step']:.1f} s"
            + (f" ({generation:.1f} s generation)" if generation is not None else ""),
            flush=True,
        )


def _check(overrides: Sequence[str]) -> int:
    """``verl-partial check``: compose as ``main_ppo`` does, then run the driver's own validation of our blocks.

    ``--cfg job --resolve`` only composes; the values are checked when the job starts, after its set-up. This runs
    the very checks the driver runs (:func:`verl_partial.config.job.validate_root_config`), so a command line that
    passes here passes them at start-up.
    """
    import verl  # loads verl's plugins, ours among them: our Hydra groups and resolvers are registered
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from verl_partial.config.job import validate_root_config

    verl_config_dir = Path(verl.__file__).parent / "trainer" / "config"
    try:
        with initialize_config_dir(config_dir=str(verl_config_dir), version_base=None):
            config = compose(config_name="ppo_trainer", overrides=list(overrides), return_hydra_config=True)
    except HydraException as error:
        print(f"verl-partial check: the overrides do not compose with verl's ppo_trainer:\n{error}", file=sys.stderr)
        return 2
    # Our rollout-correction check compares the block with the preset Hydra selected, as under @hydra.main.
    HydraConfig.instance().set_config(config)
    try:
        with open_dict(config):
            del config["hydra"]
        validate_root_config(config)
        OmegaConf.to_container(config, resolve=True)  # what the TaskRunner does first: every interpolation resolves
    except (ValueError, OmegaConfBaseException) as error:
        print(f"verl-partial check: invalid config:\n{error}", file=sys.stderr)
        return 1
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
    blocks = [block for block in ("partial", "rollout_correction", "balance", "backend") if config.get(block)]
    checked = ", ".join(blocks) if blocks else "none of verl-partial's blocks selected"
    print(
        f"verl-partial check: ok ({checked}). verl's own checks that need the workers (GPU counts, batch sizes per "
        "GPU) run when the job starts."
    )
    return 0


DESCRIPTION = """\
Partial rollout, rollout-correction presets and group-preserving balancing for verl's GRPO/PPO trainer.

You use them as Hydra overrides of verl's own trainer, e.g.
  python -m verl.trainer.main_ppo +partial=default +rollout_correction=seq_is_rs +balance=group ...
These commands help before and around such a run."""

EPILOG = """\
examples:
  verl-partial demo                      a 4-step GRPO run on this CPU, partial rollout on (minutes)
  verl-partial demo --no-partial         the same run with verl's plain synchronous rollout, to compare
  verl-partial check +partial=default partial.max_staleness=2 ...
                                         validate your overrides without starting a job
  verl-partial simulate --model Qwen2.5-7B --gpus 8
                                         project the presets onto your GPUs and response lengths"""


def main(argv: Sequence[str] | None = None) -> int:
    from verl_partial.config.partial import PRESETS

    parser = argparse.ArgumentParser(
        prog="verl-partial",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,check,simulate}")
    demo = commands.add_parser(
        "demo",
        help="run verl's GRPO trainer on this CPU with partial rollout, and summarise it",
        description="Train a tiny model on a countdown task with verl's own GRPO trainer on this CPU (no GPU, no "
        "download), partial rollout on, then print one line per step and a summary. Run it again with "
        "--no-partial to see the same run with verl's synchronous rollout.",
    )
    demo.add_argument("--steps", type=int, default=4, help="GRPO steps in all (default 4)")
    demo.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where the model/tokenizer/data are built")
    demo.add_argument(
        "--output",
        default=None,
        help="run folder for checkpoints, metrics and verl's log (default: a new folder under <cache-dir>/runs/)",
    )
    demo.add_argument(
        "--resume", action="store_true", help="continue --output (default: the latest run) from its checkpoint"
    )
    partial = demo.add_mutually_exclusive_group()
    partial.add_argument(
        "--partial", default="default", choices=sorted(PRESETS), help="partial-rollout preset (default: default)"
    )
    partial.add_argument("--no-partial", action="store_true", help="verl's plain synchronous rollout, to compare")
    demo.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. +rollout_correction=seq_is_rs")
    check = commands.add_parser(
        "check",
        help="validate a trainer command line's overrides without starting a job",
        description="Compose verl's trainer config (ppo_trainer) with your overrides as `python -m "
        "verl.trainer.main_ppo` does, and validate verl-partial's blocks (partial, rollout_correction, balance, "
        "backend) and the trainer keys they depend on, as the job would at start-up. Exits 1 naming the key on "
        "bad input, 2 when the overrides do not compose. No Ray, no GPU, no model download. verl's own checks "
        "that need the workers (GPU counts, batch sizes per GPU) still run when the job starts.",
    )
    check.add_argument("overrides", nargs="*", help="the Hydra overrides of your main_ppo command line")
    add_simulate_arguments(
        commands.add_parser(
            "simulate",
            help="project partial rollout onto your GPUs, model and response lengths (simulated, seconds of CPU)",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "check":
        return _check(args.overrides)
    if args.command == "simulate":
        simulate(args)
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
