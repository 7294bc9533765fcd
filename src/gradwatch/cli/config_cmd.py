"""``gradwatch config``: the effective configuration and where each value came from.

Resolution is :func:`gradwatch.configfile.resolve_config`, the same function a training script
can call (``load_config(path)``), so what this command prints is what the job gets:
defaults < ``--config`` file < ``GRADWATCH_*`` environment (< arguments in code, which a command
line cannot show). Output is a rich table on a terminal, aligned plain text otherwise (pipes,
logs, CI), or the values alone as JSON with ``--json``.

Groups that no parameter of any model can join (every pattern taken first by an earlier group's)
are warned about on stderr (exit status 0). The command has no model, so a group whose patterns
match no parameter of *your* model is reported when ``GradWatch`` is built, with an example
parameter name.

Every configuration problem exits with status 2 and a one-line-per-error message on stderr that
names the field and its source (``invalid value for port: ... (from env GRADWATCH_PORT='abc')``),
the unknown key of a file, or the unreadable/malformed file. Never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from gradwatch.config import (
    WatchConfig,
    did_you_mean,
    env_var,
    shadowed_groups,
    unknown_env_vars,
)
from gradwatch.configfile import ConfigError, ResolvedConfig, resolve_config

#: Exit status for invalid configuration (the convention of command-line usage errors).
EXIT_INVALID = 2

HELP = "\n\n".join(
    (
        "Print the effective gradwatch configuration and where each value came from.",
        "Precedence, lowest first: defaults < --config FILE < GRADWATCH_* environment < "
        "arguments given in code (WatchConfig(...), gradwatch.watch(model, ...), "
        "load_config(FILE, ...)).",
        "The file's keys are WatchConfig field names (TOML, YAML or JSON, by suffix); unknown "
        "keys are errors. Invalid values, unknown keys and unreadable files exit with status 2.",
    )
)


def _value_text(value: Any) -> str:
    """Compact JSON: the notation of GRADWATCH_* variables, so a value can be pasted back."""
    return json.dumps(value, separators=(", ", ": "), allow_nan=True)


def _rows(resolved: ResolvedConfig) -> list[tuple[str, str, str]]:
    values = resolved.config.model_dump(mode="json")
    return [(name, _value_text(values[name]), resolved.sources[name]) for name in values]


def _print_table(resolved: ResolvedConfig, config_file: Path | None) -> None:
    rows = _rows(resolved)
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        title = "gradwatch configuration" + (f" ({config_file})" if config_file else "")
        table = Table(title=Text(title), title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value", overflow="fold")
        table.add_column("source")
        for name, value, source in rows:
            style = "dim" if source == "default" else ("cyan" if source.startswith("env") else "")
            # Text, not str: values such as ["layer[0-9]*"] must not be read as rich markup.
            table.add_row(Text(name), Text(value), Text(source), style=style)
        Console().print(table)
        return
    widths = [max(len(r[i]) for r in [("field", "value", "source"), *rows]) for i in range(2)]
    for name, value, source in [("field", "value", "source"), *rows]:
        sys.stdout.write(f"{name:<{widths[0]}}  {value:<{widths[1]}}  {source}\n")


def config_command(
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Settings file: .toml, .yaml/.yml or .json, keys = WatchConfig field names. "
            "GRADWATCH_* variables override it.",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print the effective values only, as one JSON object."),
    ] = False,
) -> None:
    try:
        resolved = resolve_config(config_file)
    except ConfigError as exc:
        sys.stderr.write(f"gradwatch config: {exc}\n")
        raise typer.Exit(EXIT_INVALID) from None
    known = [env_var(f) for f in WatchConfig.model_fields]
    for name in unknown_env_vars():
        hint = did_you_mean(name.upper(), known, show=str)
        sys.stderr.write(
            f"gradwatch config: warning: {name} is not a gradwatch setting, ignored{hint}\n"
        )
    for group, takers in shadowed_groups(resolved.config.groups).items():
        sys.stderr.write(
            f"gradwatch config: warning: group {group!r} can match no parameter: every pattern "
            f"is taken by an earlier group first ({takers}); a parameter joins the first group "
            "whose pattern matches it\n"
        )
    if as_json:
        sys.stdout.write(json.dumps(resolved.config.model_dump(mode="json"), indent=2) + "\n")
        return
    _print_table(resolved, config_file)


def register(app: typer.Typer) -> None:
    """Add the ``config`` command to ``app``."""
    app.command("config", help=HELP)(config_command)
