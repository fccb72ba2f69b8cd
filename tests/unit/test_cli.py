"""``verl-partial``'s command line: a help that loads no ML stack, preset names checked, ``check`` validating
our blocks without a job, and our Hydra search path listed once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verl_partial import cli
from verl_partial.config.partial import PRESETS

GROUPS = Path(__file__).resolve().parents[2] / "hydra_configs"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["check", "--help"], ["simulate", "--help"]])
def test_help_loads_no_torch_transformers_verl_or_ray(argv: list[str]) -> None:
    """What made ``--help`` take seconds: the demo package imported transformers (and torch) at import."""
    program = (
        "import sys\n"
        "from verl_partial import cli\n"
        "try:\n"
        f"    cli.main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'verl', 'ray', 'hydra'})\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert "usage: verl-partial" in result.stdout
    assert "HEAVY []" in result.stdout, result.stdout


def test_demo_partial_offers_the_presets_and_rejects_any_other_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(PRESETS) == sorted(path.stem for path in (GROUPS / "partial").glob("*.yaml"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--partial", "defualt"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--partial: invalid choice: 'defualt'" in error
    assert all(name in error for name in PRESETS)


def test_demo_refuses_a_preset_together_with_no_partial(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--partial", "kimi", "--no-partial"])
    assert "not allowed with argument --partial" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("+partial=default", "partial.max_staleness=-1"), "partial.max_staleness"),
        (("+partial=default", "partial.staleness_policy=wiat"), "partial.staleness_policy"),
        (
            ("+partial=default", "+rollout_correction=seq_is_rs", "rollout_correction.is_level=word"),
            "rollout_correction.is_level",
        ),
        (("+partial=default", "+balance=group", "balance.rows=sample_x"), "balance.rows"),
        (("+backend=cpu", "backend.name=tpu"), "backend.name"),
        (("+partial=default", "trainer.use_v1=true"), "trainer.use_v1"),
    ],
)
def test_check_refuses_bad_values_naming_the_key(
    overrides: tuple[str, ...], key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cfg job --resolve`` exits 0 for these; ``check`` runs the driver's validation and names the key."""
    assert cli.main(["check", *overrides]) == 1
    assert key in capsys.readouterr().err


def test_check_reports_an_unknown_preset_as_a_composition_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "+partial=wiat"]) == 2
    error = capsys.readouterr().err
    assert "Could not find 'partial/wiat'" in error and "tail_on_policy" in error


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_check_accepts_every_partial_preset(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", f"+partial={preset}", "+rollout_correction=seq_is_rs", "+balance=group"]) == 0
    assert "verl-partial check: ok (partial, rollout_correction, balance)" in capsys.readouterr().out


def test_a_hydra_error_lists_our_search_path_once(tmp_path: Path) -> None:
    """verl imports our plugin module, which registers the search-path plugin Hydra's own scan also found."""
    result = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "+partial=wiat"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "Could not find 'partial/wiat'" in result.stderr
    assert result.stderr.count("provider=verl-partial") == 1, result.stderr
