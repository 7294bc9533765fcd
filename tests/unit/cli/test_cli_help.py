"""The command line's help and version texts are shown literally (no markup eats a bracket)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from gradwatch import __version__
from gradwatch.cli.main import app


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", result.output)


def test_plot_help_keeps_brackets() -> None:
    text = _help("plot")
    assert "pip install 'torch-gradwatch[plot]'" in text
    assert "Title [default: a summary]" in text
    assert "[default: 12.0" in text


def test_every_command_help_shows_its_defaults() -> None:
    for command in ("demo", "top", "plot"):  # config has no option with a default
        assert "[default: " in _help(command), command


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"gradwatch {__version__}"
