"""What ``gradwatch demo``'s parent and its training job share: the checked options
(:class:`DemoOptions`, every flag, handed to the job whole), the typed messages the job sends
back (ready, error, summary) and the private work directory they travel through
(:class:`Workdir`): each a typed JSON file, checked when read, so no option or field is restated
by hand on either side. No torch and no terminal: the parent (:mod:`gradwatch.cli.demo`), its
view (:mod:`gradwatch.cli.demo_view`) and the job (:mod:`gradwatch.cli.demo_job`) all read it.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, TypeVar

from pydantic import ConfigDict, TypeAdapter

from gradwatch.cli.step_events import StepEvents
from gradwatch.config import DEFAULT_DEMO_PORT
from gradwatch.snapshot import Snapshot

#: Training steps of a demo run.
DEFAULT_STEPS = 200
#: Seconds each step sleeps, so a person can follow the table.
DEFAULT_STEP_SLEEP = 0.1
#: Address rank 0's endpoint binds to (the exporter convention: every interface).
DEFAULT_BIND = "0.0.0.0"
#: Most ranks ``--nproc`` starts.
MAX_NPROC = 64
#: Seconds the job pauses after an injected step, so a scraper polling a few times a second
#: sees the step's gauges (the counters keep it anyway).
ANOMALY_PAUSE = 1.0
_M = TypeVar("_M")


# -- the options ----------------------------------------------------------------------------


class DemoOptionError(ValueError):
    """An option of ``gradwatch demo`` out of range; ``flag`` names it."""

    def __init__(self, flag: str, problem: str) -> None:
        super().__init__(f"{flag}: {problem}")
        self.flag = flag
        self.problem = problem


@dataclass(frozen=True)
class DemoOptions:
    """The options of ``gradwatch demo``, checked: each field is the flag of the same name.

    The parent builds it once from its command line; the job reads it back with
    :meth:`from_json`. Construction checks every range and the options that depend on each
    other (:class:`DemoOptionError` names the flag), so the job gets the run the parent checked.
    ``seed_at``/``blend_at`` None are :attr:`phases`' defaults.
    """

    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")

    nproc: int = 2
    steps: int = DEFAULT_STEPS
    port: int = DEFAULT_DEMO_PORT
    bind: str = DEFAULT_BIND
    nan_at: int | None = None
    explode_at: int | None = None
    spike_at: int | None = None
    seed_at: int | None = None
    blend_at: int | None = None
    step_sleep: float = DEFAULT_STEP_SLEEP
    linger: float = 0.0
    nan_rank: int | None = None  # NaN on this rank's local gradients only (before the all-reduce)
    guard: bool = False  # train through watch.guard(optimizer): bad steps are skipped by it

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise DemoOptionError(*problem)

    def _problem(self) -> tuple[str, str] | None:
        """The first ``(flag, problem)`` of these options, None when they are consistent."""
        bounds = (
            ("--nproc", self.nproc, 1, MAX_NPROC),
            ("--steps", self.steps, 1, None),
            ("--port", self.port, 0, 65535),
            ("--step-sleep", self.step_sleep, 0.0, None),
            ("--linger", self.linger, 0.0, None),
        )
        for flag, value, lo, hi in bounds:
            if value < lo or (hi is not None and value > hi):
                return flag, f"must be >= {lo}" + (f" and <= {hi}" if hi is not None else "")
        for flag, step in (
            ("--nan-at", self.nan_at),
            ("--explode-at", self.explode_at),
            ("--spike-at", self.spike_at),
        ):
            if step is not None and not 0 <= step < self.steps:
                return flag, f"must be in [0, {self.steps}) (--steps)"
        for flag, step in (("--seed-at", self.seed_at), ("--blend-at", self.blend_at)):
            if step is not None and not 0 <= step <= self.steps:
                return flag, f"must be in [0, {self.steps}]"
        if self.seed_at is not None and self.blend_at is not None and self.blend_at < self.seed_at:
            return "--blend-at", "must not be before --seed-at"
        if self.nan_rank is not None:
            if self.nan_at is None:
                return "--nan-rank", "needs --nan-at (the step to inject at)"
            if not 0 <= self.nan_rank < self.nproc:
                return "--nan-rank", f"must be in [0, {self.nproc}) (--nproc)"
        if not math.isfinite(self.step_sleep) or not math.isfinite(self.linger):
            return "--step-sleep/--linger", "must be finite"
        return None

    @property
    def phases(self) -> tuple[int, int]:
        """``(seed_at, blend_at)``: the seed grows at a quarter of the run, blending starts
        midway between that and the end, unless given."""
        seed = self.steps // 4 if self.seed_at is None else self.seed_at
        blend = (seed + self.steps + 1) // 2 if self.blend_at is None else self.blend_at
        return seed, max(blend, seed)

    def phase(self, step: int) -> Literal["host", "seed", "blend"]:
        """The phase of ``step``: ``"host"``, ``"seed"`` (host frozen) or ``"blend"``."""
        seed_at, blend_at = self.phases
        if step < seed_at:
            return "host"
        return "seed" if step < blend_at else "blend"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoOptions:
        """The options :meth:`to_json` wrote; a wrong type, an unknown field or an option out
        of range raises :class:`ValueError` naming the field."""
        return _adapter(cls).validate_json(text)


@functools.cache
def _adapter(kind: type[_M]) -> TypeAdapter[_M]:
    return TypeAdapter(kind)


# -- what the job tells the parent ----------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Rank 0 serves its endpoint (``endpoint.json``): its URL, with the real port when
    ``--port 0``."""

    metrics_url: str


@dataclass(frozen=True)
class JobError:
    """Rank 0 could not start serving (``error.json``); ``kind`` is ``"port_in_use"`` for a
    taken port, else ``"error"``."""

    kind: Literal["port_in_use", "error"]
    message: str


@dataclass(frozen=True)
class LastStep:
    """The figures of the last snapshot of the run; the optimizer-update figures
    (``update_stats``, whole model) are None where the snapshot has none."""

    step: int
    global_norm: float
    groups: dict[str, float]
    ratios: dict[str, float]
    health: float
    weight_norm: float | None = None
    update_norm: float | None = None
    update_ratio: float | None = None
    stalled_fraction: float | None = None


@dataclass(frozen=True)
class HealthMin:
    """The lowest health score of the run and the first step that had it."""

    value: float
    step: int


@dataclass
class Summary:
    """Training is over (``summary.json``): what rank 0 saw in every snapshot, one :meth:`add`
    per step (a scrape can miss a step, the job cannot).

    Attributes:
        steps_run: snapshots rank 0 saw.
        world_size, parallelism: as the snapshots describe the job.
        last: the last snapshot's figures (None when no step ran).
        events: the steps of each class (:class:`StepEvents`, as ``Snapshot`` classifies them).
        isolation_violation_steps: isolated group -> steps where its isolation was violated
            (every isolated group present, violated or not).
        health_min: the lowest health (None when no step ran).
        nonfinite_origins: step -> the ranks whose local gradients were non-finite before the
            reduction (the per-rank view; steps with a known origin only).
    """

    steps_run: int = 0
    world_size: int = 1
    parallelism: str = ""
    last: LastStep | None = None
    events: StepEvents = field(default_factory=StepEvents)
    isolation_violation_steps: dict[str, list[int]] = field(default_factory=dict)
    health_min: HealthMin | None = None
    nonfinite_origins: dict[int, list[int]] = field(default_factory=dict)

    def add(self, snap: Snapshot) -> None:
        """Count ``snap``, the newest snapshot."""
        self.steps_run += 1
        self.world_size, self.parallelism = snap.world_size, snap.parallelism
        self.last = LastStep(
            step=snap.step,
            global_norm=snap.global_norm,
            groups={g: s.norm for g, s in snap.groups.items()},
            ratios=dict(snap.ratios),
            health=snap.health,
            weight_norm=snap.weight_norm,
            update_norm=snap.update_norm,
            update_ratio=snap.update_ratio,
            stalled_fraction=snap.stalled_fraction,
        )
        self.events.add(snap)
        for group, violated in snap.isolation_violated.items():
            steps = self.isolation_violation_steps.setdefault(group, [])
            if violated:
                steps.append(snap.step)
        if self.health_min is None or snap.health < self.health_min.value:
            self.health_min = HealthMin(value=snap.health, step=snap.step)
        if snap.nonfinite_origin_ranks:
            self.nonfinite_origins[snap.step] = list(snap.nonfinite_origin_ranks)


class Workdir:
    """The private directory of one run, the job's ``--workdir``: every message between the
    parent and the job is a file here (NaN and infinities as Python's ``json`` literals: a NaN
    norm is the point of the demo)."""

    OPTIONS = "options.json"
    READY = "endpoint.json"
    ERROR = "error.json"
    SUMMARY = "summary.json"
    ACK = "ack"
    _FILES: ClassVar[Mapping[type, str]] = {
        DemoOptions: OPTIONS, Ready: READY, JobError: ERROR, Summary: SUMMARY
    }  # fmt: skip

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, message: DemoOptions | Ready | JobError | Summary) -> None:
        """Write ``message`` to its file, whole (a temporary name, then a rename)."""
        name = self._FILES[type(message)]
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(asdict(message)))
        os.replace(tmp, self.path / name)

    def read(self, kind: type[_M]) -> _M | None:
        """The message of type ``kind``: None while it is missing or malformed (from an older
        job, or a file someone else put there: the parent then reports the job as failed, not a
        traceback)."""
        try:
            return _adapter(kind).validate_json((self.path / self._FILES[kind]).read_text())
        except (OSError, ValueError):
            return None

    def read_options(self) -> DemoOptions:
        """The job's options: the defaults when no ``options.json`` was written (a job started
        by hand); a malformed file raises :class:`ValueError` naming the field."""
        path = self.path / self.OPTIONS
        if not path.exists():
            return DemoOptions()
        return DemoOptions.from_json(path.read_text())

    def has_error(self) -> bool:
        return (self.path / self.ERROR).exists()

    def ack(self) -> None:
        """The parent's final scrape is done: rank 0 may stop serving."""
        (self.path / self.ACK).touch()

    def acked(self) -> bool:
        return (self.path / self.ACK).exists()
