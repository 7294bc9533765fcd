"""Host-side formulas of the per-rank view: from a :class:`~gradwatch.reduce.reduced.RankView` and
the step's (post-reduction) :class:`~gradwatch.snapshot.Snapshot` to the snapshot's rank-view
fields.

* **Non-finite origin** (on a non-finite step only): the ranks whose local (pre-reduction)
  squared norm of some group was NaN/Inf, their hosts (from the layout handshake) and those
  groups.
* **Replica spread**: a data-parallel replica's local squared norm is the sum over its ranks
  (pipeline stages of one replica add up) and groups; its norm is the square root. Reported:
  min, median, max of the replica norms, the lowest rank of the replica holding the max, and
  the outlier score ``max_r |x_r - median| / median`` (0 when every norm is 0, +Inf when the
  median is 0 and some norm is not; a non-finite replica norm ranks highest and makes the
  score +Inf), with the lowest rank of that replica.
* **Gradient noise scale** (McCandlish et al. 2018, "An Empirical Model of Large-Batch
  Training", appendix A): with ``b`` samples per replica, ``n`` replicas and ``B = b n``,
  ``|G_b|^2`` = the mean over replicas of their local squared norms and ``|G_B|^2`` = the
  squared norm of the reduced (averaged) gradient, the unbiased estimators
  ``|G|^2 ~ (B |G_B|^2 - b |G_b|^2) / (B - b)`` and
  ``tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)``; each is smoothed by its mean over the
  last :data:`NOISE_SCALE_WINDOW` steps with finite figures, and ``B_simple = mean(tr(Sigma))
  / mean(|G|^2)``, in the unit of ``b`` (samples or tokens; per-replica batches when no batch
  size is given). NaN while either mean is not positive (noise dominates, or a step's
  estimates are inconsistent): ``B_simple`` is a ratio of two positive quantities, never
  negative. Steps with a non-finite figure do not enter the window. Whole model and per group.

  Why a window and not an exponential average: a single bad step (a gradient scaled after the
  reduction, a spike a million times the others) leaves the estimate exactly
  :data:`NOISE_SCALE_WINDOW` steps later, where an EMA would carry it for hundreds of steps
  (at decay 0.95 a 1e6x step needs ~270 steps to fall below the other steps' weight). A
  window of 40 averages as many steps as an EMA of decay 0.95 does (``2 / (1 - decay) - 1``).

Pure Python on floats; imports no torch.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradwatch.snapshot import Snapshot

if TYPE_CHECKING:
    from gradwatch.reduce.reduced import RankView

#: Steps (with the per-rank view and finite figures) whose estimates the noise scale averages:
#: the bound on how long one step affects it.
NOISE_SCALE_WINDOW = 40
#: The key of the whole model in :class:`NoiseScale`.
WHOLE = ""
#: The unit of the gradient noise scale (its metrics' HELP and ``gradwatch top`` say it).
NOISE_SCALE_UNIT = "samples (the unit of batch_size; per-replica batches when batch_size is unset)"
#: Outlier score above which a replica is an outlier (its local norm more than twice the
#: replicas' median): the GradwatchReplicaOutlier alert's threshold, highlighted by ``top``.
REPLICA_OUTLIER_THRESHOLD = 1.0


class NoiseScale:
    """Windowed means of the unbiased ``tr(Sigma)`` and ``|G|^2`` estimates, per key
    (thread-safe; see the module docstring)."""

    def __init__(self, window: int = NOISE_SCALE_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"NoiseScale(window={window}) must be at least 1")
        self.window = window
        self._estimates: dict[str, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def update(self, key: str, small: float, big: float, b: float, replicas: int) -> float:
        """Add one step's ``|G_b|^2`` (``small``) and ``|G_B|^2`` (``big``); return
        ``B_simple`` over the window (NaN while undefined, never negative)."""
        with self._lock:
            kept = self._estimates.setdefault(key, deque(maxlen=self.window))
            if math.isfinite(small) and math.isfinite(big):
                B = b * replicas  # the paper's notation
                est_g2 = (B * big - b * small) / (B - b)
                est_trace = (small - big) / (1.0 / b - 1.0 / B)
                if math.isfinite(est_g2) and math.isfinite(est_trace):
                    kept.append((est_trace, est_g2))
            if not kept:
                return math.nan
            trace = math.fsum(t for t, _ in kept)
            g2 = math.fsum(g for _, g in kept)
            return trace / g2 if trace > 0 and g2 > 0 else math.nan


def rank_view_fields(
    view: RankView,
    snap: Snapshot,
    groups: Sequence[str],
    noise: NoiseScale,
    batch_size: float,
) -> dict[str, Any]:
    """The rank-view fields of ``snap`` (keyword arguments of :meth:`Snapshot.replace`)."""
    g = len(groups)
    out: dict[str, Any] = {"rank_view": True}
    # -- non-finite origin: only on a step the exact reduced figures call non-finite (a local
    # square can overflow to Inf where the exact engine does not, see gradwatch.stacks.ddp_hook)
    if snap.is_finite:
        out["nonfinite_origin_ranks"] = ()
        out["nonfinite_origin_count"] = 0
    elif view.per_rank is not None:
        origin = [r for r, row in enumerate(view.per_rank) if not all(map(math.isfinite, row))]
        out["nonfinite_origin_ranks"] = tuple(origin)
    else:
        out["nonfinite_origin_ranks"] = (
            (view.nonfinite_rank,) if view.nonfinite_rank is not None else ()
        )
    if not snap.is_finite:
        out["nonfinite_origin_count"] = view.nonfinite_count
    out["nonfinite_origin_hosts"] = tuple(
        view.hosts[r] if r < len(view.hosts) else "" for r in out["nonfinite_origin_ranks"]
    )
    out["nonfinite_origin_groups"] = tuple(
        groups[k] for k in range(g) if view.nonfinite_ranks[k] > 0 and not snap.is_finite
    )
    # -- replica spread
    n = len(view.replica_groups)
    replica_sq: list[list[float]] | None = None
    if view.per_rank is not None:
        rows = view.per_rank
        replica_sq = [
            [sum(rows[r][k] for r in ranks) for k in range(g)] for ranks in view.replica_groups
        ]
        norms = [
            math.sqrt(math.fsum(s)) if all(map(math.isfinite, s)) else sum(s) for s in replica_sq
        ]
        out.update(_spread(norms, view.replica_groups))
    # -- noise scale
    if n >= 2:
        b = float(batch_size)
        if replica_sq is not None:
            small_g = [math.fsum(s[k] for s in replica_sq) / n for k in range(g)]
        else:
            small_g = [
                view.finite_sums[k] / n if view.nonfinite_ranks[k] == 0 else math.nan
                for k in range(g)
            ]
        out["group_noise_scale"] = {  # the snapshot's groups only ("other" when it exists)
            name: noise.update(name, small_g[k], snap.groups[name].norm ** 2, b, n)
            for k, name in enumerate(groups)
            if name in snap.groups
        }
        out["gradient_noise_scale"] = noise.update(
            WHOLE, math.fsum(small_g), snap.global_norm**2, b, n
        )
    return out


def _spread(norms: list[float], replicas: Sequence[Sequence[int]]) -> Mapping[str, Any]:
    """min / median / max of the replica norms, who holds the max, the outlier score."""
    order = sorted(range(len(norms)), key=lambda i: (not math.isfinite(norms[i]), norms[i]))
    finite = [norms[i] for i in order if math.isfinite(norms[i])]
    if len(finite) < len(norms):  # a non-finite replica: the statistics are not finite
        top = order[-1]
        return {
            "replica_grad_norm_min": finite[0] if finite else norms[top],
            "replica_grad_norm_median": math.nan,
            "replica_grad_norm_max": norms[top],
            "replica_grad_norm_max_rank": replicas[top][0],
            "replica_outlier_score": math.inf,
            "replica_outlier_rank": replicas[top][0],
        }
    median = statistics.median(norms)
    far = max(range(len(norms)), key=lambda i: (abs(norms[i] - median), -i))
    dev = abs(norms[far] - median)
    score = dev / median if median > 0 else (0.0 if dev == 0 else math.inf)
    top = order[-1]
    return {
        "replica_grad_norm_min": norms[order[0]],
        "replica_grad_norm_median": median,
        "replica_grad_norm_max": norms[top],
        "replica_grad_norm_max_rank": replicas[top][0],
        "replica_outlier_score": score,
        "replica_outlier_rank": replicas[far][0],
    }
