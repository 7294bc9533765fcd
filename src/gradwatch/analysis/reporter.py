"""How the stages of a watcher speak: the self-stats counters, and warnings logged once.

Every stage (the collect pass in :mod:`gradwatch.step.collector`, the summarizer in
:mod:`gradwatch.analysis.summary`) is handed the same :class:`Reporter`; none calls back into
:class:`~gradwatch.watcher.GradWatch`. On global rank 0 with publishing, the reporter feeds the
exporter's self-stats (``gradwatch_internal_errors_total``, ``gradwatch_collecting``, the audit
series); elsewhere the counters are dropped and only the logs remain.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger("gradwatch")


class SelfStatsSink(Protocol):
    """The part of :class:`gradwatch.export.state.SelfStats` the stages write."""

    def add_internal_error(self, kind: str) -> None: ...

    def set_collecting(self, collecting: bool) -> None: ...

    def add_audit(self, source: str, ratio: float, agrees: bool) -> None: ...


class Reporter:
    """Counters and once-per-kind logs of one watcher (thread-safe: results are built on the
    publisher thread while the training thread collects).

    Args:
        rank: this process's global rank, named in messages.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.stats: SelfStatsSink | None = None  # set once publishing starts (rank 0)
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def first(self, kind: str) -> bool:
        """True the first time ``kind`` is seen (the caller logs it), False after."""
        with self._lock:
            if kind in self._logged:
                return False
            self._logged.add(kind)
            return True

    def log_once(self, kind: str, msg: str, *args: object) -> None:
        """A WARNING, the first time ``kind`` happens."""
        if self.first(kind):
            log.warning(msg, *args)

    def internal_error(self, kind: str) -> None:
        """Count one ``gradwatch_internal_errors_total{kind}``."""
        stats = self.stats
        if stats is not None:
            stats.add_internal_error(kind)

    def collecting(self, collecting: bool) -> None:
        """Set ``gradwatch_collecting``."""
        stats = self.stats
        if stats is not None:
            stats.set_collecting(collecting)

    def audit(self, source: str, ratio: float, agrees: bool) -> None:
        """Export one audit verdict (``gradwatch_reported_norm_ratio{source}``)."""
        stats = self.stats
        if stats is not None:
            stats.add_audit(source, ratio, agrees)
