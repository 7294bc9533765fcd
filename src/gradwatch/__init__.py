"""gradwatch: exact, distributed-aware gradient health for PyTorch, served to Prometheus.

Public API::

    from gradwatch import GradWatch, WatchConfig, total_norm
    watch = gradwatch.watch(model)   # configured from GRADWATCH_* (no-op when disabled)

Names are imported lazily (PEP 562): ``import gradwatch`` alone does not import torch, so the
``gradwatch`` command's ``top``, ``config`` and ``plot`` start in a fraction of a second; the
first use of a name that needs torch imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradwatch._moved import install as _install_moved_paths
from gradwatch.version import __version__

_install_moved_paths()

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "GradWatch": "gradwatch.watcher",
    "PendingSnapshot": "gradwatch.watcher",
    "GuardedOptimizer": "gradwatch.step.guard",
    "WatchConfig": "gradwatch.config",
    "NoOpWatch": "gradwatch.watcher",
    "watch": "gradwatch.watcher",
    "GradWatchError": "gradwatch.errors",
    "GradWatchTimeoutError": "gradwatch.errors",
    "LayoutMismatchError": "gradwatch.errors",
    "PortInUseError": "gradwatch.errors",
    "UnsupportedParallelismError": "gradwatch.errors",
    "GroupStats": "gradwatch.snapshot",
    "Snapshot": "gradwatch.snapshot",
    "Sink": "gradwatch.export",
    "total_norm": "gradwatch.norms.stats",
    "ddp_comm_hook": "gradwatch.stacks.ddp_hook",
    "capture_window": "gradwatch.reduce.collective",
}

__all__ = [
    "GradWatch",
    "GradWatchError",
    "GradWatchTimeoutError",
    "GroupStats",
    "GuardedOptimizer",
    "LayoutMismatchError",
    "NoOpWatch",
    "PendingSnapshot",
    "PortInUseError",
    "Sink",
    "Snapshot",
    "UnsupportedParallelismError",
    "WatchConfig",
    "__version__",
    "capture_window",
    "ddp_comm_hook",
    "total_norm",
    "watch",
]

if TYPE_CHECKING:
    from gradwatch.config import WatchConfig
    from gradwatch.errors import (
        GradWatchError,
        GradWatchTimeoutError,
        LayoutMismatchError,
        PortInUseError,
        UnsupportedParallelismError,
    )
    from gradwatch.export import Sink
    from gradwatch.norms.stats import total_norm
    from gradwatch.reduce.collective import capture_window
    from gradwatch.snapshot import GroupStats, Snapshot
    from gradwatch.stacks.ddp_hook import ddp_comm_hook
    from gradwatch.step.guard import GuardedOptimizer
    from gradwatch.watcher import GradWatch, NoOpWatch, PendingSnapshot, watch


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gradwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
