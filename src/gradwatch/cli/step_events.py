"""The steps of a run, by class: which steps were non-finite, AMP-skipped or exploding.

The classification itself belongs to :class:`gradwatch.Snapshot` (``nonfinite_step``,
``amp_skipped``, ``exploding_step``: an exploding step includes every non-finite one;
``spike_step``: the global or a group norm spiked; ``guard_skipped``: the optimizer-step guard
skipped the update), the same
one the exporter's ``gradwatch_*_steps_total`` counters use. This module only lists the steps of
each class, for the views that name steps rather than count them: the demo's summary and
``gradwatch plot``. Never decide a class here, so all views agree on a NaN step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gradwatch.snapshot import Snapshot


@dataclass
class StepEvents:
    """Steps of each class, in the order added (a step may be in two: a NaN step is both
    non-finite and exploding)."""

    nonfinite: list[int] = field(default_factory=list)
    amp_skipped: list[int] = field(default_factory=list)
    exploding: list[int] = field(default_factory=list)
    spikes: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # the guard skipped the optimizer step

    @classmethod
    def of(cls, snapshots: Iterable[Snapshot]) -> StepEvents:
        events = cls()
        for snap in snapshots:
            events.add(snap)
        return events

    def add(self, snap: Snapshot) -> None:
        """Record ``snap``'s step in every class :class:`Snapshot` puts it in."""
        if snap.nonfinite_step:
            self.nonfinite.append(snap.step)
        if snap.amp_skipped:
            self.amp_skipped.append(snap.step)
        if snap.exploding_step:
            self.exploding.append(snap.step)
        if snap.spike_step:
            self.spikes.append(snap.step)
        if snap.guard_skipped is not None:
            self.skipped.append(snap.step)
