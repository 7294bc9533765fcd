"""What ``gradwatch demo`` (the parent, :mod:`gradwatch.cli.demo`) and its torchrun job
(:mod:`gradwatch.cli.demo_job`) say to each other, and the defaults both use.

The two sides import this module and never read each other's data by string key, so a field
is added here once. It imports no torch (the parent starts fast; only the job loads torch).

* :class:`JobArgs`: the job's command line (the parent builds it with :meth:`JobArgs.to_argv`,
  the job reads it with :meth:`JobArgs.from_argv`).
* Messages: files in the job's work directory (:class:`Workdir`). Rank 0 writes each JSON
  message to a temporary name and renames it, so a reader sees a whole message or none:

  - :class:`Ready` (``endpoint.json``): rank 0 serves; the metrics URL (the real port when
    ``--port 0``) and the phase boundaries;
  - :class:`JobError` (``error.json``): rank 0 could not serve (``kind`` ``"port_in_use"`` for
    a taken port, else ``"error"``);
  - :class:`Summary` (``summary.json``): training is over; what rank 0 saw in *every* snapshot
    (a scrape can miss a step, the job cannot), built by :class:`SummaryRecorder`;
  - the ack (``ack``, an empty file): the parent made its final scrape, rank 0 may stop serving.

NaN and infinities are written as the ``NaN``/``Infinity`` literals Python's ``json`` reads back
(a NaN norm is the point of the demo).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from gradwatch.cli.step_events import StepEvents
from gradwatch.config import DEFAULT_DEMO_PORT
from gradwatch.snapshot import Snapshot

__all__ = [
    "DEFAULT_ANOMALY_PAUSE",
    "DEFAULT_BIND",
    "DEFAULT_LOG_EVERY",
    "DEFAULT_STEPS",
    "DEFAULT_STEP_SLEEP",
    "HealthMin",
    "JobArgs",
    "JobError",
    "LastStep",
    "Ready",
    "Summary",
    "SummaryRecorder",
    "Workdir",
]

#: Training steps of a demo run.
DEFAULT_STEPS = 200
#: Seconds each step sleeps, so a person can follow the table.
DEFAULT_STEP_SLEEP = 0.1
#: Seconds the job pauses after an injected step, so a scraper polling a few times a second
#: sees the step's gauges (the counters keep it anyway).
DEFAULT_ANOMALY_PAUSE = 1.0
#: Address rank 0's endpoint binds to (the exporter convention: every interface).
DEFAULT_BIND = "0.0.0.0"
#: Rank 0 prints a progress line to the job's log every this many steps.
DEFAULT_LOG_EVERY = 20

_M = TypeVar("_M")


@dataclass(frozen=True)
class JobArgs:
    """The job's command line (``python -m gradwatch.cli.demo_job ...``).

    ``ack`` makes rank 0 wait for the parent's ack before closing the endpoint; ``parent_pid``
    makes every rank stop when that process disappears. Without both the job runs by hand.
    ``batch_size`` None is the demo model's own batch (``demo_job.DEMO_BATCH``).
    """

    workdir: Path
    steps: int = DEFAULT_STEPS
    port: int = DEFAULT_DEMO_PORT
    bind: str = DEFAULT_BIND
    step_sleep: float = DEFAULT_STEP_SLEEP
    anomaly_pause: float = DEFAULT_ANOMALY_PAUSE
    linger: float = 0.0
    nan_at: tuple[int, ...] = ()
    explode_at: tuple[int, ...] = ()
    seed_at: int | None = None
    blend_at: int | None = None
    ack: bool = False
    parent_pid: int | None = None
    batch_size: int | None = None
    log_every: int = DEFAULT_LOG_EVERY
    spike_at: tuple[int, ...] = ()
    nan_rank: int | None = None  # NaN on this rank's local gradients only (before the all-reduce)
    guard: bool = False  # train through watch.guard(optimizer): bad steps are skipped by it

    def to_argv(self) -> list[str]:
        """The arguments :meth:`from_argv` reads back into an equal :class:`JobArgs`."""
        argv = [
            "--workdir", str(self.workdir),
            "--steps", str(self.steps),
            "--port", str(self.port),
            "--bind", self.bind,
            "--sleep", repr(self.step_sleep),
            "--anomaly-pause", repr(self.anomaly_pause),
            "--linger", repr(self.linger),
            "--log-every", str(self.log_every),
        ]  # fmt: skip
        for step in self.nan_at:
            argv += ["--nan-at", str(step)]
        for step in self.explode_at:
            argv += ["--explode-at", str(step)]
        for step in self.spike_at:
            argv += ["--spike-at", str(step)]
        for flag, value in (
            ("--seed-at", self.seed_at),
            ("--blend-at", self.blend_at),
            ("--parent-pid", self.parent_pid),
            ("--batch-size", self.batch_size),
            ("--nan-rank", self.nan_rank),
        ):
            if value is not None:
                argv += [flag, str(value)]
        if self.ack:
            argv.append("--ack")
        if self.guard:
            argv.append("--guard")
        return argv

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> JobArgs:
        """Parse the job's command line (``--help`` and usage errors exit, as argparse does)."""
        p = argparse.ArgumentParser(
            prog="python -m gradwatch.cli.demo_job",
            description="The training job behind gradwatch demo.",
        )
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
        p.add_argument("--seed-at", type=int, default=None)
        p.add_argument("--blend-at", type=int, default=None)
        p.add_argument("--nan-at", type=int, action="append", default=[])
        p.add_argument("--explode-at", type=int, action="append", default=[])
        p.add_argument("--spike-at", type=int, action="append", default=[])
        p.add_argument("--port", type=int, default=DEFAULT_DEMO_PORT)
        p.add_argument("--bind", default=DEFAULT_BIND)
        p.add_argument("--sleep", type=float, default=DEFAULT_STEP_SLEEP, help="seconds per step")
        p.add_argument("--anomaly-pause", type=float, default=DEFAULT_ANOMALY_PAUSE)
        p.add_argument("--linger", type=float, default=0.0)
        p.add_argument("--ack", action="store_true", help="wait for WORKDIR/ack before closing")
        p.add_argument("--parent-pid", type=int, default=None)
        p.add_argument("--batch-size", type=int, default=None)
        p.add_argument("--log-every", type=int, default=DEFAULT_LOG_EVERY)
        p.add_argument("--nan-rank", type=int, default=None)
        p.add_argument("--guard", action="store_true", help="step through watch.guard()")
        ns = p.parse_args(list(argv))
        return cls(
            workdir=ns.workdir,
            steps=ns.steps,
            port=ns.port,
            bind=ns.bind,
            step_sleep=ns.sleep,
            anomaly_pause=ns.anomaly_pause,
            linger=ns.linger,
            nan_at=tuple(ns.nan_at),
            explode_at=tuple(ns.explode_at),
            seed_at=ns.seed_at,
            blend_at=ns.blend_at,
            ack=ns.ack,
            parent_pid=ns.parent_pid,
            batch_size=ns.batch_size,
            log_every=ns.log_every,
            spike_at=tuple(ns.spike_at),
            nan_rank=ns.nan_rank,
            guard=ns.guard,
        )


# -- messages -------------------------------------------------------------------------------


_Message = TypeVar("_Message", bound="_FlatMessage")


class _FlatMessage:
    """A message of scalar fields: one JSON object, each field read back as its annotated type
    (``int``, ``str``, or one of a ``Literal``'s values, the last one standing for the rest)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[_Message], text: str) -> _Message:
        d = json.loads(text)
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            kind, value = hints[f.name], d[f.name]
            choices = get_args(kind) if get_origin(kind) is Literal else None
            if choices:
                values[f.name] = value if value in choices else choices[-1]
            else:
                values[f.name] = kind(value)
        return cls(**values)


@dataclass(frozen=True)
class Ready(_FlatMessage):
    """Rank 0 serves its endpoint (``endpoint.json``)."""

    metrics_url: str
    port: int
    steps: int
    seed_at: int
    blend_at: int


@dataclass(frozen=True)
class JobError(_FlatMessage):
    """Rank 0 could not start serving (``error.json``); ``kind`` is ``"port_in_use"`` for a
    taken port, else ``"error"``."""

    kind: Literal["port_in_use", "error"]
    message: str
    port: int


@dataclass(frozen=True)
class LastStep:
    """The figures of the last snapshot of the run."""

    step: int
    global_norm: float
    groups: Mapping[str, float]
    ratios: Mapping[str, float]
    health: float

    @classmethod
    def of(cls, snap: Snapshot) -> LastStep:
        return cls(
            step=snap.step,
            global_norm=snap.global_norm,
            groups={g: s.norm for g, s in snap.groups.items()},
            ratios=dict(snap.ratios),
            health=snap.health,
        )


@dataclass(frozen=True)
class HealthMin:
    """The lowest health score of the run and the first step that had it."""

    value: float
    step: int


@dataclass
class Summary:
    """Training is over (``summary.json``): the run's plan and what rank 0 saw.

    Attributes:
        steps, seed_at, blend_at: the planned steps and phase boundaries.
        metrics_url: rank 0's endpoint.
        steps_run: snapshots rank 0 saw.
        world_size, parallelism: as the snapshots describe the job.
        last: the last snapshot's figures (None when no step ran).
        events: the non-finite, AMP-skipped and exploding steps (:class:`StepEvents`).
        isolation_violation_steps: isolated group -> steps where its isolation was violated
            (every isolated group present, violated or not).
        health_min: the lowest health (None when no step ran).
        nonfinite_origins: step -> the ranks whose local gradients were non-finite before the
            reduction (the per-rank view; steps with a known origin only).
        guarded: the job stepped through ``watch.guard()`` (``events.skipped`` lists the steps
            it skipped).
    """

    steps: int
    seed_at: int
    blend_at: int
    metrics_url: str | None
    steps_run: int = 0
    world_size: int = 1
    parallelism: str = ""
    last: LastStep | None = None
    events: StepEvents = field(default_factory=StepEvents)
    isolation_violation_steps: dict[str, list[int]] = field(default_factory=dict)
    health_min: HealthMin | None = None
    nonfinite_origins: dict[int, list[int]] = field(default_factory=dict)
    guarded: bool = False

    def to_json(self) -> str:
        data = asdict(self)
        data["events"] = self.events.to_dict()
        if self.last is not None:
            data["last"] = {
                **asdict(self.last),
                "groups": dict(self.last.groups),
                "ratios": dict(self.last.ratios),
            }
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        d = json.loads(text)
        last = d.get("last")
        hmin = d.get("health_min")
        return cls(
            steps=int(d["steps"]),
            seed_at=int(d["seed_at"]),
            blend_at=int(d["blend_at"]),
            metrics_url=d.get("metrics_url"),
            steps_run=int(d["steps_run"]),
            world_size=int(d["world_size"]),
            parallelism=str(d["parallelism"]),
            last=None if last is None else LastStep(**last),
            events=StepEvents.from_dict(d["events"]),
            isolation_violation_steps={
                g: [int(s) for s in steps] for g, steps in d["isolation_violation_steps"].items()
            },
            health_min=None if hmin is None else HealthMin(**hmin),
            nonfinite_origins={
                int(k): [int(r) for r in v] for k, v in d.get("nonfinite_origins", {}).items()
            },
            guarded=bool(d.get("guarded", False)),
        )


class SummaryRecorder:
    """Rank 0's running :class:`Summary` of the snapshots it saw, one :meth:`add` per step."""

    def __init__(self, *, steps: int, seed_at: int, blend_at: int, metrics_url: str | None):
        self.summary = Summary(
            steps=steps, seed_at=seed_at, blend_at=blend_at, metrics_url=metrics_url
        )

    def add(self, snap: Snapshot) -> None:
        s = self.summary
        s.steps_run += 1
        s.world_size, s.parallelism = snap.world_size, snap.parallelism
        s.last = LastStep.of(snap)
        s.events.add(snap)
        s.guarded = s.guarded or snap.consecutive_skipped_steps is not None
        for group, violated in snap.isolation_violated.items():
            steps = s.isolation_violation_steps.setdefault(group, [])
            if violated:
                steps.append(snap.step)
        if s.health_min is None or snap.health < s.health_min.value:
            s.health_min = HealthMin(value=snap.health, step=snap.step)
        if snap.nonfinite_origin_ranks:
            s.nonfinite_origins[snap.step] = list(snap.nonfinite_origin_ranks)


# -- the work directory ---------------------------------------------------------------------


class Workdir:
    """The directory the parent creates and passes as ``--workdir``: where messages go."""

    READY = "endpoint.json"
    ERROR = "error.json"
    SUMMARY = "summary.json"
    ACK = "ack"

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, name: str, text: str) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path / name)

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def write_ready(self, ready: Ready) -> None:
        self._write(self.READY, ready.to_json())

    def write_error(self, error: JobError) -> None:
        self._write(self.ERROR, error.to_json())

    def write_summary(self, summary: Summary) -> None:
        self._write(self.SUMMARY, summary.to_json())

    def read_ready(self) -> Ready | None:
        """The :class:`Ready` message, None until rank 0 wrote a valid one."""
        return _parse(self._read(self.READY), Ready.from_json)

    def read_error(self) -> JobError | None:
        return _parse(self._read(self.ERROR), JobError.from_json)

    def has_error(self) -> bool:
        return (self.path / self.ERROR).exists()

    def read_summary(self) -> Summary | None:
        return _parse(self._read(self.SUMMARY), Summary.from_json)

    def ack(self) -> None:
        """The parent's final scrape is done: rank 0 may stop serving."""
        (self.path / self.ACK).touch()

    def acked(self) -> bool:
        return (self.path / self.ACK).exists()


def _parse(text: str | None, parse: Callable[[str], _M]) -> _M | None:
    """``parse(text)``, or None for a missing or malformed message (from an older job, or a
    file someone else put there: the parent then reports the job as failed, not a traceback)."""
    if text is None:
        return None
    try:
        return parse(text)
    except (ValueError, KeyError, TypeError):
        return None
