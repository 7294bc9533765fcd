"""``gradwatch doctor``: prove gradwatch on this machine's device (exactness, no sync, memory,
cost, threading, the collective under torchrun, the endpoint) in under a minute.

The checks live in :mod:`gradwatch.doctor`, the options and the JSON document in
:mod:`gradwatch.doctor_options` (imported when the command runs: torch is not
imported by ``gradwatch --help``). Output: one table (check, status, measured, threshold), or
with ``--json`` one JSON document (``environment``, ``checks``, ``failed``, ``ok``). Exit status
0 when no check failed, 1 naming the failing checks on stderr, 2 for bad input (a device that
does not exist, an unknown dtype) with a one-line message.
"""

from __future__ import annotations

import sys
import time
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
        "Each check is PASS, FAIL or SKIP with the measured figure and its threshold "
        "(docs/gpu.md). Exit status 0 when nothing failed, 1 naming the failing checks, 2 for "
        "bad input. On a cluster: `gradwatch doctor` on each node, then `torchrun "
        "--nproc-per-node N -m gradwatch.cli.main doctor` for the collective.",
    )
)


def _table(rows: list[Any]) -> str:
    header = ("check", "status", "measured", "threshold")
    cells = [header, *[(c.name, c.status, c.measured, c.threshold) for c in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(3)]
    lines = [
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    details = [f"  {c.name}: {c.detail}" for c in rows if c.detail]
    return "\n".join(lines + (["", "details:", *details] if details else []))


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
    from gradwatch.doctor_options import (
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
    from gradwatch.doctor import run_checks

    if not json_output:
        typer.echo(f"gradwatch doctor on {options.device} (each check: PASS, FAIL or SKIP)")
    started = time.monotonic()
    checks = run_checks(options)
    elapsed = time.monotonic() - started
    if json_output:
        typer.echo(to_json(checks, options.device, elapsed))
    else:
        typer.echo(_table(checks))
        typer.echo(f"\n{len(checks)} checks in {elapsed:.1f} s")
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed:
        typer.echo(f"gradwatch doctor: FAILED: {', '.join(failed)}", err=True)
        sys.stdout.flush()
        raise typer.Exit(EXIT_FAILED)


def register(app: typer.Typer) -> None:
    app.command("doctor", help=HELP, no_args_is_help=False)(doctor_command)
