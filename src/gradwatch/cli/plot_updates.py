"""The optimizer-update panels of ``gradwatch plot``, for histories written with
``update_stats=True`` (:mod:`gradwatch.norms.updates`).

Two panels, drawn only when some record carries an update figure (``weight_norm``,
``update_norm``, ``update_ratio`` or ``stalled_fraction``, whole model or per group):

* **weights**: the whole model's weight norm and the norm of the update the last optimizer step
  before each collect applied, on a log scale; a collect whose update was a measured 0 (no
  weight changed: a skipped step) is a marker along the panel's floor, not a gap;
* **updates**: the update-to-weight ratio, whole model (black) and per group, on a log scale,
  with the stalled fraction (the intended updates rounded away, bf16/fp16 weights) dotted on a
  second axis in [0, 1] at the right.

A figure the record does not carry (the first collect, an unmeasured step, a history written
without update stats), an undefined ratio (NaN) and a value of another type are gaps, never
drawn as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: The update panels, top to bottom, and their height ratios in the figure.
UPDATE_PANELS = ("weights", "updates")
UPDATE_PANEL_HEIGHTS = {"weights": 2.0, "updates": 2.0}
#: The whole model's label in the updates panel.
MODEL = "model"
#: Color and marker of a collect whose update was a measured 0, in the weights panel.
NO_UPDATE_COLOR = "tab:red"
NO_UPDATE_MARKER = "x"

_FIELDS = ("weight_norm", "update_norm", "update_ratio", "stalled_fraction")


def _number(value: Any) -> float:
    """A record's numeric field, or NaN when absent or of another type (bool, string, list)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _positive(values: Sequence[float]) -> list[float]:
    """``values`` with every non-positive or non-finite value masked (a gap on a log axis)."""
    return [v if math.isfinite(v) and v > 0 else math.nan for v in values]


@dataclass(frozen=True)
class UpdateSeries:
    """The update figures of a history, one value per record (NaN where absent).

    Attributes:
        weight: the whole model's weight norm.
        update: the whole model's update norm.
        ratio: ``"model"`` and each group: the update-to-weight ratio.
        stalled: ``"model"`` and each group carrying it: the stalled fraction.
    """

    weight: list[float]
    update: list[float]
    ratio: dict[str, list[float]] = field(default_factory=dict)
    stalled: dict[str, list[float]] = field(default_factory=dict)

    @property
    def no_update(self) -> list[int]:
        """Indices of the records whose update was a measured 0."""
        return [i for i, v in enumerate(self.update) if v == 0.0]


def _group_field(record: dict[str, Any], group: str, name: str) -> float:
    stats = (record.get("groups") or {}).get(group)
    return _number(stats.get(name)) if isinstance(stats, dict) else math.nan


def update_series(records: Sequence[dict[str, Any]]) -> UpdateSeries | None:
    """The update figures of ``records`` (sorted by step), or None when none carries one."""
    groups: list[str] = []
    for r in records:
        for g, stats in (r.get("groups") or {}).items():
            if isinstance(stats, dict) and g not in groups and any(
                _number(stats.get(f)) == _number(stats.get(f)) for f in _FIELDS
            ):
                groups.append(g)
    whole = {f: [_number(r.get(f)) for r in records] for f in _FIELDS}
    if not groups and not any(v == v for values in whole.values() for v in values):
        return None
    ratio = {MODEL: whole["update_ratio"]}
    stalled = {MODEL: whole["stalled_fraction"]}
    for g in groups:
        ratio[g] = [_group_field(r, g, "update_ratio") for r in records]
        stalled[g] = [_group_field(r, g, "stalled_fraction") for r in records]
    return UpdateSeries(
        weight=whole["weight_norm"],
        update=whole["update_norm"],
        ratio={k: v for k, v in ratio.items() if any(x == x for x in v)},
        stalled={k: v for k, v in stalled.items() if any(x == x for x in v)},
    )


def draw_weights(ax: Any, steps: Sequence[int], series: UpdateSeries) -> None:
    """The weights panel: weight norm and update norm (log), measured-0 updates marked."""
    ax.plot(steps, _positive(series.weight), color="black", lw=1.5, label="weight norm")
    ax.plot(steps, _positive(series.update), color="tab:blue", lw=1.1, label="update norm")
    zeros = [steps[i] for i in series.no_update]
    if zeros:
        ax.plot(zeros, [0.0] * len(zeros), NO_UPDATE_MARKER, color=NO_UPDATE_COLOR, ms=7,
                mew=2, transform=ax.get_xaxis_transform(), clip_on=False,
                label=f"no update ({len(zeros)})")  # fmt: skip
    if any(math.isfinite(v) and v > 0 for v in [*series.weight, *series.update]):
        ax.set_yscale("log")
    ax.set_ylabel("weights, update")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              fontsize="small")  # fmt: skip


def draw_updates(ax: Any, steps: Sequence[int], series: UpdateSeries) -> None:
    """The updates panel: update ratios (log, left) and stalled fractions (dotted, right)."""
    names = list(dict.fromkeys([*series.ratio, *series.stalled]))
    colors = {n: "black" if n == MODEL else f"C{i % 10}" for i, n in enumerate(names)}
    handles: list[Any] = []
    for name, values in series.ratio.items():
        color = colors[name]
        (line,) = ax.plot(steps, _positive(values), color=color, lw=1.3 if name == MODEL else 1.0,
                          label=f"ratio {name}")  # fmt: skip
        handles.append(line)
    if any(math.isfinite(v) and v > 0 for values in series.ratio.values() for v in values):
        ax.set_yscale("log")
    ax.set_ylabel("update / weight")
    if series.stalled:
        right = ax.twinx()
        for name, values in series.stalled.items():
            (line,) = right.plot(steps, values, color=colors[name], ls=":", lw=1.2,
                                 label=f"stalled {name}")  # fmt: skip
            handles.append(line)
        right.set_ylim(-0.02, 1.02)
        right.set_ylabel("stalled fraction")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.08, 1.0),
              borderaxespad=0.0, fontsize="small")  # fmt: skip
