"""Host-side formulas of optimizer-update health: the reduced update section as snapshot
fields.

On Python floats, after the one read of the packed vector (no torch). The section
(:func:`gradwatch.norms.updates.section_width`) holds, per group of the rank view's group order, the
summed weight squares, update squares, stalled and moving elements (each piece counted once),
then how many ranks could not measure their update and how many had no previous collect
(:class:`gradwatch.norms.updates.UpdateMeter`). From them:

* ``weight_norm = sqrt(sum w)``, ``update_norm = sqrt(sum u)`` (exact sums, ``math.fsum``);
* ``update_ratio = update_norm / weight_norm``, NaN when the weight norm is 0 or not finite;
* ``stalled_fraction = stalled / moving``, NaN when no element was meant to move;
* the update figures are None when some rank could not measure its update or had no previous
  collect: nothing unmeasured is published.

A *silent skip* (:attr:`gradwatch.snapshot.Snapshot.no_update_step`): the update is a measured
0 while the previous collect's gradients were finite and non-zero and neither AMP nor the
optimizer-step guard skipped that step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gradwatch.snapshot import GroupStats, Snapshot


def _norm(square: float) -> float:
    return math.sqrt(square) if square >= 0.0 else math.nan


def update_ratio(update_norm: float, weight_norm: float) -> float:
    """``update / weight``; NaN when undefined (the weight norm is 0 or not finite)."""
    if not math.isfinite(weight_norm) or weight_norm == 0.0:
        return math.nan
    return update_norm / weight_norm


def stalled_fraction(stalled: float, moving: float) -> float:
    """``stalled / moving``; NaN when no element was meant to move."""
    return stalled / moving if moving > 0.0 else math.nan


def _figures(w: float, u: float, s: float, e: float, measured: bool) -> dict[str, Any]:
    weight = _norm(w)
    if not measured:
        return {"weight_norm": weight}
    update = _norm(u)
    return {
        "weight_norm": weight,
        "update_norm": update,
        "update_ratio": update_ratio(update, weight),
        "stalled_fraction": stalled_fraction(s, e),
    }


def update_fields(
    values: Sequence[float],
    view_groups: Sequence[str],
    groups: Mapping[str, GroupStats],
    previous: Snapshot | None,
) -> dict[str, Any]:
    """The snapshot changes of one reduced update section: the whole-model figures, each
    shown group's :class:`GroupStats` with its figures, and ``no_update_step`` judged against
    ``previous`` (the last measured snapshot: the gradients the last step applied)."""
    g = len(view_groups)
    w, u, s, e = (values[k * g : (k + 1) * g] for k in range(4))
    unmeasured, first = values[4 * g], values[4 * g + 1]
    measured = unmeasured == 0.0 and first == 0.0
    whole = _figures(math.fsum(w), math.fsum(u), math.fsum(s), math.fsum(e), measured)
    position = {name: k for k, name in enumerate(view_groups)}
    shown = {
        name: replace(stats, **_figures(w[k], u[k], s[k], e[k], measured))
        for name, stats in groups.items()
        for k in (position[name],)
    }
    return {**whole, "groups": shown, "no_update_step": _silent_skip(whole, previous)}


def _silent_skip(whole: Mapping[str, Any], previous: Snapshot | None) -> bool:
    """No weight changed although the last collect's gradients asked for a change."""
    if whole.get("update_norm") != 0.0 or previous is None:
        return False
    return (
        previous.is_finite
        and previous.global_norm > 0.0
        and not previous.amp_skipped
        and previous.guard_skipped is None
    )
