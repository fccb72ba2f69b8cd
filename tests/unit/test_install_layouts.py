"""Our Hydra groups are found under a regular and an editable install, from a working directory outside the checkout.

Each case builds a throwaway venv (``--system-site-packages --without-pip`` plus a ``.pth`` onto this environment's
site-packages, so verl, Hydra, pip and setuptools need no download), installs a copy of the package into it with
``pip install --no-deps`` (``-e`` for editable), and composes ``main_ppo +partial=default`` from an
empty folder. Under setuptools' editable finder, Hydra's plugin scan cannot list our
``hydra_plugins`` module (verl_partial/plugin.py, ``register_with_hydra``): before that fix the
group composed as the string ``partial: default``. About 25 s per case.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("verl_partial", "hydra_configs", "hydra_plugins", "pyproject.toml", "README.md")


def _venv_with_package(tmp_path: Path, editable: bool) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(origin, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (venv_site / "_outer_env.pth").write_text(str(_outer_site_without_us(tmp_path)) + "\n")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*install, *(["-e"] if editable else []), str(source)], check=True, cwd=tmp_path)
    return python


def _ours(name: str) -> bool:
    return name.startswith("verl_partial") or (name.startswith("__editable__") and "verl_partial" in name)


def _outer_site_without_us(tmp_path: Path) -> Path:
    """This environment's site-packages as a folder of links, minus verl-partial itself.

    The outer environment may hold a regular install of verl-partial (nox and CI do). Left visible, it shadows the
    throwaway editable install: setuptools appends its editable finder to ``sys.meta_path``, after the path finder.
    """
    view = tmp_path / "outer-site"
    view.mkdir()
    for site_dir in map(Path, site.getsitepackages()):
        for entry in site_dir.iterdir():
            if _ours(entry.name) or (view / entry.name).exists():
                continue
            if entry.name == "hydra_plugins":  # a namespace shared with other packages' plugins
                (view / entry.name).mkdir()
                for plugin in entry.iterdir():
                    if plugin.name != "verl_partial_searchpath":
                        (view / entry.name / plugin.name).symlink_to(plugin)
                continue
            (view / entry.name).symlink_to(entry)
    return view


@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_groups_compose_from_any_directory(tmp_path: Path, editable: bool) -> None:
    python = _venv_with_package(tmp_path, editable)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    located = subprocess.run(
        [str(python), "-c", "import verl_partial; print(verl_partial.__file__)"],
        cwd=elsewhere,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert str(tmp_path / ("src" if editable else "venv")) in located, located  # the throwaway install is used
    composed = subprocess.run(
        [str(python), "-m", "verl.trainer.main_ppo", "+partial=default", "+rollout_correction=pure_is", "--cfg", "job"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
    )
    assert composed.returncode == 0, composed.stderr[-3000:]
    config = yaml.safe_load(composed.stdout)
    assert isinstance(config["partial"], dict) and config["partial"]["enable"] is True
    assert config["rollout_correction"]["preset"] == "pure_is"
    assert config["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "bypass_mode"
