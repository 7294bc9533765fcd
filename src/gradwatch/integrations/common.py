"""What the framework callbacks share: the figures they add to the frameworks' logs, and the
lifetime of the watcher a callback builds for one run."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from gradwatch.snapshot import Snapshot

log = logging.getLogger("gradwatch")

PREFIX = "gradwatch/"


def log_figures(snap: Snapshot) -> dict[str, float]:
    """Flat ``{name: float}`` for a framework's logger: global and group norms, ratios, health."""
    out = {
        f"{PREFIX}global_grad_norm": snap.global_norm,
        f"{PREFIX}health": snap.health,
        f"{PREFIX}nonfinite_tensors": float(len(snap.nonfinite_params)),
        f"{PREFIX}exploding_tensors": float(snap.exploding),
    }
    for name, group in snap.groups.items():
        out[f"{PREFIX}grad_norm/{name}"] = group.norm
    for key, value in snap.ratios.items():
        out[f"{PREFIX}ratio/{key}"] = value
    if snap.clip_coef is not None:
        out[f"{PREFIX}clip_coef"] = snap.clip_coef
    return out


def close_watch(watch: Any, drain: bool) -> None:
    """Close a callback's watcher; ``drain=False`` (a run that raised) does not wait for peers'
    all-reduces that may never come."""
    from gradwatch.watcher import GradWatch

    if isinstance(watch, GradWatch):
        watch._close(drain)
    else:
        watch.close()


class RunOwner(Protocol):
    """A callback holding a watcher for the run it was started for."""

    def end_run(self, drain: bool) -> None:
        """Close the run's watcher (``drain``: wait, bounded, for its all-reduces in flight)
        and undo what the callback installed. Idempotent."""


class LiveRuns:
    """The callback runs begun in this process and not yet ended, with the thread each began on.

    A framework's training loop runs on the thread that called ``train()``/``fit()``, and a
    framework does not tell a callback when that call raises: the callback's end hook never
    runs and its watcher (endpoint, port, process group, route) would outlive the run. So a run
    that begins on a thread ends every run still open on that thread first, the callback's
    own previous run included: a second loop on that thread can only start once the first one
    has left. (A training loop nested inside another's hook, on the same thread, is not
    supported by the callbacks.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[RunOwner, int]] = {}

    def begin(self, owner: RunOwner) -> None:
        """End the runs left open on this thread (logged), then register ``owner``'s run."""
        thread = threading.get_ident()
        with self._lock:
            stale = [o for o, t in self._open.values() if t == thread]
            for o in stale:
                self._open.pop(id(o), None)
        for o in stale:
            log.warning(
                "gradwatch: a %s run on this thread never ended (training raised?): closing "
                "its watcher before the new run starts",
                type(o).__module__.rsplit(".", 1)[-1],
            )
            o.end_run(drain=False)  # its peers may never come
        with self._lock:
            self._open[id(owner)] = (owner, thread)

    def end(self, owner: RunOwner) -> None:
        """Forget ``owner``'s run (it ended)."""
        with self._lock:
            self._open.pop(id(owner), None)

    def __contains__(self, owner: object) -> bool:
        with self._lock:
            return id(owner) in self._open


#: The process's open callback runs (both frameworks).
LIVE_RUNS = LiveRuns()
