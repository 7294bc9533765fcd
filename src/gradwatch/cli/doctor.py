"""``gradwatch doctor``: prove gradwatch on this machine's device (exactness, no sync, memory,
cost, threading, the collective under torchrun, the endpoint) in under a minute.

The checks live in :mod:`gradwatch.doctor.checks`, the options and the JSON document in
:mod:`gradwatch.doctor.options` (imported when the command runs: torch is not
imported by ``gradwatch --help``). Output: one table (check, status, measured, threshold) that
fits :data:`WIDTH` columns, or with ``--json`` one JSON document (``environment``, ``checks``,
``failed``, ``ok``). Under torchrun only rank 0 prints it; another rank prints nothing unless a
check failed there, and then only its failing checks (the table or the document) and the
``FAILED`` line on stderr naming its rank. torch's own warnings are not
shown (they say nothing about this machine). Exit status 0 when no check failed, 1 naming the
failing checks on stderr, 2 for bad input (a device that does not exist, an unknown dtype) with
a one-line message.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from typing import Annotated, Any

import typer

#: Exit statuses: a failing check, and bad input (the convention of command-line usage errors).
EXIT_FAILED = 1
EXIT_INVALID = 2

HELP = "\n\n".join(
    (
        "Check gradwatch on this machine: exactness on hard cases against an independent float64 "
        "reference, zero device syncs in collect(), peak extra memory, cost against "
        "torch.nn.utils.get_total_norm and clip_grad_norm_, result() across threads, the "
        "endpoint, and under torchrun one collect across all ranks with the job's backend.",
        "Each check is PASS, FAIL, SKIP (not applicable here) or INCONCLUSIVE (measured on a "
        "machine too busy for a verdict) with the measured figure and its threshold "
        "(docs/gpu.md). Exit status 0 when nothing failed, 1 naming the failing checks, 2 for "
        "bad input. On a cluster: `gradwatch doctor` on each node, then `torchrun "
        "--nproc-per-node N -m gradwatch.cli.main doctor` for the collective (rank 0 prints "
        "the table, the other ranks only their failures).",
    )
)


#: The widest line the table and its details print.
WIDTH = 100
#: Width of the status column (``INCONCLUSIVE`` and two spaces).
_STATUS = 14


def _table(rows: list[Any], width: int = WIDTH) -> str:
    """The checks in at most ``width`` columns: per check, its status and name on one line,
    then what was measured against its threshold, wrapped and indented below; then the
    details, wrapped likewise."""
    indent = " " * (_STATUS + 2)
    lines = [f"{'status':<{_STATUS}}check", f"{indent}measured (threshold)", "-" * width]
    for c in rows:
        lines += textwrap.wrap(
            f"{c.status:<{_STATUS}}{c.name}", width, subsequent_indent=" " * _STATUS,
            break_on_hyphens=False,
        )  # fmt: skip
        lines += textwrap.wrap(
            f"{c.measured} (threshold: {c.threshold})", width, initial_indent=indent,
            subsequent_indent=indent, break_on_hyphens=False,
        )  # fmt: skip
    details: list[str] = []
    for c in rows:
        if c.detail:
            details += textwrap.wrap(
                f"{c.name}: {c.detail}", width, initial_indent="  ", subsequent_indent="      ",
                break_on_hyphens=False,
            )  # fmt: skip
    return "\n".join(lines + (["", "details:", *details] if details else []))


def _rank() -> int:
    """This process's global rank under torchrun (``RANK``), 0 otherwise."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _no_third_party_warnings() -> Iterator[None]:
    """torch's own warnings (a FutureWarning about torch's internals, a profiler notice) say
    nothing about this machine: not shown. A warning raised from gradwatch's code is, as it
    should be fixed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch(\.|$)")
        yield


def doctor_command(
    device: Annotated[
        str,
        typer.Option("--device", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N."),
    ] = "auto",
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Gradient dtypes to check, comma separated: float32, bfloat16, float16, "
            "float64 (default: all).",
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document instead of the table.")
    ] = False,
    quick: Annotated[
        bool, typer.Option("--quick", help="Smaller cost and memory cases, fewer rounds.")
    ] = False,
    only: Annotated[
        str | None,
        typer.Option(
            "--checks",
            help="Run only these check families, comma separated: environment, exactness, "
            "syncs, memory, cost, threading, endpoint, cuda, distributed (default: all).",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=1.0,
            help="Seconds the torchrun rendezvous, handshake and collective may take before the "
            "distributed check fails (never hangs).",
        ),
    ] = 60.0,
) -> None:
    from gradwatch.doctor.options import (
        DoctorError,
        DoctorOptions,
        parse_dtypes,
        parse_families,
        resolve_device,
        to_json,
    )

    try:
        options = DoctorOptions(
            device=resolve_device(device),
            dtypes=parse_dtypes(dtype),
            quick=quick,
            timeout=timeout,
            only=parse_families(only),
        )
    except DoctorError as exc:
        typer.echo(f"gradwatch doctor: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID) from None
    from gradwatch.doctor.checks import run_checks

    rank = _rank()
    if not json_output and rank == 0:
        typer.echo(f"gradwatch doctor on {options.device} (each check: PASS, FAIL, SKIP or "
                   "INCONCLUSIVE)")  # fmt: skip
    started = time.monotonic()
    with _no_third_party_warnings():
        checks = run_checks(options)
    elapsed = time.monotonic() - started
    failing = [c for c in checks if c.status == "FAIL"]
    if rank != 0:  # under torchrun rank 0 prints everything; the others their failures only
        if failing:
            typer.echo(to_json(failing, options.device, elapsed) if json_output
                       else _table(failing))  # fmt: skip
            names = ", ".join(c.name for c in failing)
            typer.echo(textwrap.fill(f"gradwatch doctor (rank {rank}): FAILED: {names}", WIDTH),
                       err=True)  # fmt: skip
            raise typer.Exit(EXIT_FAILED)
        return
    if json_output:
        typer.echo(to_json(checks, options.device, elapsed))
    else:
        typer.echo(_table(checks))
        typer.echo(f"\n{len(checks)} checks in {elapsed:.1f} s")
    if failing:
        names = ", ".join(c.name for c in failing)
        typer.echo(textwrap.fill(f"gradwatch doctor: FAILED: {names}", WIDTH), err=True)
        sys.stdout.flush()
        raise typer.Exit(EXIT_FAILED)


def register(app: typer.Typer) -> None:
    app.command("doctor", help=HELP, no_args_is_help=False)(doctor_command)
