"""gradwatch: exact, distributed-aware gradient health for PyTorch, served to Prometheus.

Public API::

    from gradwatch import GradWatch, WatchConfig, total_norm
    watch = gradwatch.watch(model)   # configured from GRADWATCH_* (no-op when disabled)
"""

from __future__ import annotations

__version__ = "0.1.0"

from gradwatch.config import WatchConfig
from gradwatch.enable import NoOpWatch, watch
from gradwatch.errors import (
    GradWatchError,
    GradWatchTimeoutError,
    LayoutMismatchError,
    PortInUseError,
    UnsupportedParallelismError,
)
from gradwatch.snapshot import GroupStats, Snapshot
from gradwatch.stats import total_norm
from gradwatch.watcher import GradWatch, PendingSnapshot

__all__ = [
    "GradWatch",
    "GradWatchError",
    "GradWatchTimeoutError",
    "GroupStats",
    "LayoutMismatchError",
    "NoOpWatch",
    "PendingSnapshot",
    "PortInUseError",
    "Snapshot",
    "UnsupportedParallelismError",
    "WatchConfig",
    "__version__",
    "total_norm",
    "watch",
]
