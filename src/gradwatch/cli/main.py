"""The ``gradwatch`` console script (typer): one subcommand per module of this package.

``demo`` (:mod:`gradwatch.cli.demo`), ``top`` (:mod:`gradwatch.cli.top`), ``config``
(:mod:`gradwatch.cli.config_cmd`), ``plot`` (:mod:`gradwatch.cli.plot`) and ``doctor``
(:mod:`gradwatch.cli.doctor`). Each module exposes a
``register(app)`` function; this module only assembles them, so the commands stay independent.
"""

from __future__ import annotations

import typer

from gradwatch.cli import config_cmd, demo, doctor, plot, top

app = typer.Typer(
    name="gradwatch",
    help="Gradient health for PyTorch training jobs: demo, live view, config check, plots.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts are literal: "pip install 'torch-gradwatch[plot]'" and "[default: ...]" must not
    # be read as rich markup tags (which would silently drop them).
    rich_markup_mode=None,
)

for module in (demo, top, config_cmd, plot, doctor):
    module.register(app)


def _print_version(value: bool) -> None:
    if value:
        from gradwatch.version import __version__

        typer.echo(f"gradwatch {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print gradwatch's version and exit.",
    ),
) -> None:
    """Gradient health for PyTorch training jobs: demo, live view, config check, plots."""


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
