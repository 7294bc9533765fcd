"""Warnings about anomalous steps, in the ``gradwatch`` logger, rate-limited per kind.

A training job that goes NaN would otherwise log on every step; each kind of anomaly (non-finite
gradients; each isolated group that received gradient) is logged at most once per period.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from gradwatch.snapshot import Snapshot

log = logging.getLogger("gradwatch")

#: At most this many parameter names are listed in one warning.
MAX_NAMES = 20


class RateLimitedLog:
    """``logging`` warnings of each kind at most once per ``period_seconds`` (thread-safe)."""

    def __init__(self, period_seconds: float) -> None:
        self.period = period_seconds
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``kind`` was logged less than a period ago; True if
        logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.period:
                return False
            self._last[kind] = now
        log.warning(msg, *args)
        return True


class AnomalyLog:
    """Warns about a snapshot's non-finite gradients (unless AMP skipped the step: the scaler
    working as designed) and isolation violations, each kind at most once per minute."""

    def __init__(self, rank: int, isolation_threshold: float, period_seconds: float = 60.0):
        self.rank = rank
        self.isolation_threshold = isolation_threshold
        self._log = RateLimitedLog(period_seconds)

    def report(self, snap: Snapshot) -> None:
        if snap.nonfinite_params and not snap.amp_skipped:
            names = list(snap.nonfinite_params)
            more = f" (+{len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else ""
            shown = ", ".join(names[:MAX_NAMES]) + more
            self._log.warning(
                "nonfinite",
                "gradwatch: step %d: non-finite gradients in %d parameter(s) (seen by rank %d "
                "of %d): %s",
                snap.step,
                len(names),
                self.rank,
                snap.world_size,
                shown,
            )
        if snap.nonfinite_origin_ranks and not snap.amp_skipped:
            ranks = list(snap.nonfinite_origin_ranks)
            self._log.warning(
                "nonfinite-origin",
                "gradwatch: step %d: non-finite gradients started before the reduction on "
                "%d rank(s): rank(s) %s%s (host(s) %s), group(s) %s",
                snap.step,
                snap.nonfinite_origin_count or len(ranks),
                ", ".join(map(str, ranks[:MAX_NAMES])),
                f" (+{len(ranks) - MAX_NAMES} more)" if len(ranks) > MAX_NAMES else "",
                ", ".join(dict.fromkeys(snap.nonfinite_origin_hosts)) or "unknown",
                ", ".join(snap.nonfinite_origin_groups),
            )
        for group, violated in snap.isolation_violated.items():
            if violated:
                self._log.warning(
                    f"isolation:{group}",
                    "gradwatch: step %d: isolated group %r received gradient (norm %g > %g)",
                    snap.step,
                    group,
                    snap.groups[group].norm if group in snap.groups else math.nan,
                    self.isolation_threshold,
                )
