"""The packed vector's sections: the one definition of their offsets, pure arithmetic.

Given a layout's counts (parameters ``N``, replica slots ``R``, the rank view's groups and
slots, the update groups, the timing flag), :func:`sections` says where each part of the
packed vector lives; :mod:`gradwatch.reduce.packing` fills it and reads it back by these
offsets only (see its docstring for what each section holds).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from gradwatch.norms.updates import section_width
from gradwatch.reduce.ranktiming import TIMING_WIDTH


class LayoutShape(Protocol):
    """What the sections depend on: the counts of a :class:`~gradwatch.reduce.layout.Layout`."""

    @property
    def size(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank_view_groups(self) -> int: ...
    @property
    def rank_view_slots(self) -> bool: ...
    @property
    def update_groups(self) -> int: ...
    @property
    def rank_timing(self) -> bool: ...


class Sections(NamedTuple):
    """Where each part of the packed vector lives: the one definition of its offsets."""

    squares: slice  # N squared-norm contributions (only the piece's contributor adds)
    squares_high: slice  # N, the high band (same contributors)
    squares_low: slice  # N, the low band (same contributors)
    bands: slice  # the three bands together, as the engine lays them out
    nonfinite: slice  # N non-finite flags (every holder adds)
    has_grad: slice  # N has-gradient flags (every holder adds)
    replicas: slice  # R replica sums
    step: int  # the sum of the ranks' steps
    length: int
    rank_view: slice = slice(0, 0)  # after the residues: per-rank slots or bounded sums
    updates: slice = slice(0, 0)  # after the rank view: update figures per group (summed)
    # After the step: the sums of the ranks' step residues ``q = step mod 2^STEP_RESIDUE_BITS``
    # and of their squares: every rank tells from these alone, identically, whether the ranks
    # collected different steps (``world * sum(q^2) != sum(q)^2``; :func:`steps_differ`).
    residues: slice = slice(0, 0)
    rank_timing: slice = slice(0, 0)  # last: the working-time histogram (TIMING_WIDTH)


def _rank_view_width(layout: LayoutShape) -> int:
    g = layout.rank_view_groups
    if g == 0:
        return 0
    return layout.world_size * (g + 1) if layout.rank_view_slots else 2 * g + 3


def sections(layout: LayoutShape) -> Sections:
    """Where each part of ``layout``'s packed vector lives (the same on every rank). A frozen
    dataclass layout (:class:`~gradwatch.reduce.layout.Layout`) never changes: its sections
    are computed once and kept on it (every collect reads them several times)."""
    params = getattr(type(layout), "__dataclass_params__", None)
    if params is None or not params.frozen:
        return _sections(layout)
    cached = vars(layout).get(_CACHED)
    if cached is None:
        cached = vars(layout)[_CACHED] = _sections(layout)
    return cached


#: The attribute a frozen layout keeps its sections in.
_CACHED = "_sections"


def _sections(layout: LayoutShape) -> Sections:
    n, r = layout.size, layout.replicas
    view, timing = 5 * n + r + 3, TIMING_WIDTH if layout.rank_timing else 0
    upd = view + _rank_view_width(layout)
    end = upd + section_width(layout.update_groups)
    return Sections(
        rank_view=slice(view, upd),
        updates=slice(upd, end),
        residues=slice(5 * n + r + 1, 5 * n + r + 3),
        rank_timing=slice(end, end + timing),
        squares=slice(0, n),
        squares_high=slice(n, 2 * n),
        squares_low=slice(2 * n, 3 * n),
        bands=slice(0, 3 * n),
        nonfinite=slice(3 * n, 4 * n),
        has_grad=slice(4 * n, 5 * n),
        replicas=slice(5 * n, 5 * n + r),
        step=5 * n + r,
        length=end + timing,
    )
