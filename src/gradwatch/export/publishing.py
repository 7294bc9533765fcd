"""What global rank 0 runs to publish: one publisher thread, its sinks, and the endpoint.

:func:`open_publishing` is the watcher's one entry point. It builds a :class:`Publishing`:

* with ``WatchConfig.port``: the endpoint, i.e. a sink (the
  :class:`~gradwatch.export.state.PublishedState` a scrape reads) plus a server
  (:class:`~gradwatch.export.http.HTTPEndpoint` serving the
  :class:`~gradwatch.export.collector.SnapshotCollector`);
* with ``WatchConfig.history_path``: the history file, a sink
  (:class:`~gradwatch.export.history.HistoryWriter`, opened lazily by its own thread so a slow
  or broken file system can neither block construction nor raise into training);
* with ``WatchConfig.sinks``: the tracker sinks (:mod:`gradwatch.export.sinks`: TensorBoard, W&B,
  MLflow), imported only then;
* plus any user sink (:class:`~gradwatch.export.publisher.Sink`);
* with ``WatchConfig.file_sd_path``: the endpoint's Prometheus ``file_sd`` target, written once
  the port is bound and removed at close (:mod:`gradwatch.export.filesd`).

All of them are fed by the same :class:`~gradwatch.export.publisher.Publisher` thread (the
endpoint directly, every other sink through its own queue and thread), so the training thread
only ever queues a pending result and no sink can hold up the endpoint or another sink.
:class:`MetricsServer` is a :class:`Publishing` that must serve (the endpoint on its own, as
tests and tools use it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from prometheus_client import CollectorRegistry

from gradwatch.config import WatchConfig, new_run_id
from gradwatch.errors import GradWatchError
from gradwatch.export.collector import SnapshotCollector
from gradwatch.export.filesd import (
    FileSDTarget,
    job_labels,
    remove_on_sigterm,
    target_address,
)
from gradwatch.export.http import HTTPEndpoint
from gradwatch.export.publisher import PendingLike, Publisher, Sink
from gradwatch.export.state import PublishedState, SelfStats
from gradwatch.snapshot import Snapshot

__all__ = [
    "CLOSE_TIMEOUT",
    "EXIT_CLOSE_TIMEOUT",
    "PUBLISH_TIMEOUT",
    "MetricsServer",
    "Publishing",
    "open_publishing",
]

# One logger for the whole exporter: users filter or silence "gradwatch.export".
log = logging.getLogger("gradwatch.export")

#: :meth:`Publishing.close` (hence ``GradWatch.close()``) returns within this many seconds.
CLOSE_TIMEOUT = 5.0

#: How long interpreter exit waits for the publisher and the HTTP server of a publishing nobody
#: closed (a collective stuck on a dead peer must not hold the exit for minutes).
EXIT_CLOSE_TIMEOUT = 2.0

#: How long :meth:`MetricsServer.publish` waits for the exporter process to serve a snapshot.
PUBLISH_TIMEOUT = 10.0

_P = TypeVar("_P", bound="Publishing")


def open_publishing(
    cfg: WatchConfig,
    *,
    world_size: int,
    parallelism: str,
    extra_sinks: Sequence[Sink] = (),
) -> Publishing | None:
    """The publishing of global rank 0: endpoint (``cfg.port``), history file
    (``cfg.history_path``) and ``extra_sinks``, fed by one publisher thread.

    None when there is nothing to feed (no port, no history path, no extra sink): then no
    thread is started. Raises what binding the endpoint raises
    (:class:`~gradwatch.errors.PortInUseError`, a TLS :class:`~gradwatch.errors.GradWatchError`).
    """
    from gradwatch.export.history import HistoryWriter

    sinks: list[Sink] = []
    if cfg.history_path is not None:
        sinks.append(HistoryWriter(cfg.history_path, cfg.history_max_bytes, lazy=True))
    if cfg.sinks:
        from gradwatch.export.sinks import sinks_from_config

        sinks.extend(sinks_from_config(cfg))
    sinks.extend(extra_sinks)
    if cfg.port is None and not sinks:
        return None
    return Publishing(cfg, world_size=world_size, parallelism=parallelism, sinks=sinks)


class Publishing:
    """One publisher thread feeding ``sinks``, after the endpoint's state when ``cfg.port`` is set.

    These threads touch it: the **training thread** calls :meth:`submit` and
    :meth:`observe_collect_seconds` (never block on the network or the device, never raise);
    the **publisher thread** materializes each pending result, publishes it on the endpoint's
    state and offers it to every other sink; one **sink thread** per sink writes it there
    (:mod:`gradwatch.export.sinkworker`); the **exporter thread** renders the published state
    (read once, so an exposition never shows half of one step and half of another) when it
    changed and hands the bytes to the exporter process, which serves every scrape. All public
    methods are thread-safe.

    Construction binds the port in the caller's thread (0 = ephemeral) and starts the exporter
    process. :meth:`close` returns within its ``timeout`` (5 s by default) whatever the sinks
    or the endpoint are doing. Unclosed publishings are closed when collected and at
    interpreter exit (``weakref.finalize``, which holds no reference to the object itself),
    within ``EXIT_CLOSE_TIMEOUT`` seconds.

    Attributes:
        url: ``http(s)://host:port/metrics`` (loopback when bound to all interfaces), or None
            without an endpoint.
        port: the bound TCP port (an ephemeral one resolved), or None.
        registry: the endpoint's dedicated registry (no process/gc collectors), holding only
            gradwatch's Collector; None without an endpoint.
        start_time: when this run started (Unix seconds, at construction), exported as
            ``gradwatch_start_time_seconds``.
        run_id: ``WatchConfig.run_id``, or one generated at construction
            (:func:`~gradwatch.config.new_run_id`): the ``run_id`` label of
            ``gradwatch_run_info``. A restarted job shows new values of both, which the alert
            rules treat as a counter reset.
    """

    #: Refuse a configuration without ``port`` (:class:`MetricsServer`).
    _must_serve: ClassVar[bool] = False

    def __init__(
        self,
        cfg: WatchConfig,
        *,
        world_size: int,
        parallelism: str,
        sinks: Sequence[Sink] = (),
    ) -> None:
        if self._must_serve and cfg.port is None:
            raise ValueError(
                f"gradwatch: {type(self).__name__} needs a port (WatchConfig.port is None)"
            )
        self.start_time: float = time.time()
        self.run_id: str = cfg.run_id if cfg.run_id is not None else new_run_id(self.start_time)
        self._stats = SelfStats()
        self._state: PublishedState | None = None
        self._http: HTTPEndpoint | None = None
        self.url: str | None = None
        self.port: int | None = None
        self.registry: CollectorRegistry | None = None
        if cfg.port is not None:
            self._state = PublishedState(cfg)
            collector = SnapshotCollector(
                self._state,
                self._stats,
                world_size=world_size,
                parallelism=parallelism,
                run_id=self.run_id,
                start_time=self.start_time,
                ratios=cfg.ratios,
            )
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(collector)
            self._http = HTTPEndpoint(cfg, self.registry, collector.version)
            self.url, self.port = self._http.url, self._http.port
        self._discovery: FileSDTarget | None = None
        try:
            if cfg.file_sd_path is not None and self.port is not None:
                self._discovery = _write_discovery(cfg, self.port, self.run_id)
            self._publisher = Publisher(
                self._state,
                sinks,
                self._stats,
                queue_size=cfg.sink_queue_size,
                sink_timeout=cfg.sink_timeout_seconds,
            )
        except BaseException:
            if self._discovery is not None:
                with contextlib.suppress(OSError):
                    self._discovery.remove()
            if self._http is not None:
                self._http.close(0.0)  # a failed construction holds no port
            raise
        self._finalizer = weakref.finalize(
            self, _shutdown, self._publisher, self._http, EXIT_CLOSE_TIMEOUT, self._discovery
        )
        if self.url is not None:
            log.info("gradwatch: serving metrics at %s", self.url)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def sinks(self) -> tuple[Sink, ...]:
        """Every sink, in the order they receive a snapshot (the endpoint's state first)."""
        return self._publisher.sinks

    @property
    def published_step(self) -> int | None:
        """Step of the last snapshot the endpoint shows; None before the first or without one."""
        return self._state.published_step if self._state is not None else None

    @property
    def self_stats(self) -> SelfStats:
        """The exporter's own counters, where the watcher reports whether it is collecting
        (``gradwatch_collecting``) and its internal errors; thread-safe."""
        return self._stats

    def add_sink(self, sink: Sink) -> None:
        """Feed ``sink`` too, from the next published snapshot on; it is closed with the rest.

        Ignored after :meth:`close`.
        """
        if not self.closed:
            self._publisher.add_sink(sink)

    def submit(self, pending: PendingLike) -> None:
        """Queue a pending result for publication. Never blocks on it, never raises.

        Beyond ``MAX_PENDING`` waiting results the oldest is dropped and counted. Ignored after
        :meth:`close`.
        """
        self._publisher.submit(pending)  # a deque append under a lock

    def observe_collect_seconds(self, seconds: float) -> None:
        """Record the training thread's time in one ``collect()`` call. Never raises."""
        self._stats.observe(float(seconds))  # a bucket count under a lock

    def flush(
        self, timeout: float = 10.0, settle: Callable[[], object] | None = None
    ) -> bool:
        """Wait until everything submitted so far is on the endpoint and the endpoint serves it
        (the self-stats included), then until every sink wrote it or lost it (counted), and the
        endpoint serves those counts.

        ``settle`` runs once the endpoint's state holds every submitted step and before the
        endpoint is synced: what it counts (the watcher's late norm audits) is served when this
        returns. The whole wait is bounded by ``timeout`` seconds; the endpoint goes first, so a
        blocked sink never keeps it behind, and a sink that is failing or stalled is not waited
        for (:meth:`~gradwatch.export.sinkworker.SinkWorker.flush`). Returns False when a sink
        has not written everything (logged; its steps are written or counted as lost later), on
        timeout, or at once when closed.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if self.closed:
            return False
        handled = self._publisher.flush_endpoint(deadline)
        if settle is not None:
            settle()
        if not (handled and self._sync(deadline)):
            return False
        if not self._publisher.workers:
            return True
        # The sinks' own counts (errors, drops) may have changed meanwhile: served too.
        return self._publisher.flush_sinks(deadline) and self._sync(deadline)

    def _sync(self, deadline: float) -> bool:
        """Wait until the endpoint serves what the state and self-stats hold now."""
        return self._http is None or self._http.sync(max(deadline - time.monotonic(), 0.0))

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush, stop the publisher, stop serving and release the port, then close every sink
        that has a ``close()``; returns within ``timeout`` seconds whatever a sink or the
        endpoint is doing. What could not be flushed is counted in
        ``gradwatch_dropped_snapshots_total`` and logged once. Idempotent."""
        if self._finalizer.detach() is not None:
            _shutdown(self._publisher, self._http, timeout, self._discovery)

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"{type(self).__name__}(url={self.url!r}, sinks={len(self.sinks)}, {state})"


class MetricsServer(Publishing):
    """A :class:`Publishing` that must serve: ``cfg.port`` is required (0 = ephemeral).

    :meth:`publish` puts a snapshot on the endpoint at once, in the caller's thread, without the
    publisher (tools and tests that show a given snapshot).
    """

    _must_serve = True

    def publish(self, snapshot: Snapshot, timeout: float = PUBLISH_TIMEOUT) -> bool:
        """Publish ``snapshot`` on the endpoint now, in the caller's thread, and wait (at most
        ``timeout`` seconds) until the exporter process serves it; False if it did not in time.

        Raises what building the state raises (e.g. for a malformed snapshot).
        """
        assert self._state is not None and self._http is not None  # a MetricsServer serves
        self._state.write(snapshot)
        return self._http.sync(timeout)


def _write_discovery(cfg: WatchConfig, port: int, run_id: str) -> FileSDTarget:
    """Write the endpoint's ``file_sd`` target; a failure raises naming ``file_sd_path``."""
    assert cfg.file_sd_path is not None
    target = FileSDTarget(
        cfg.file_sd_path,
        target_address(cfg.bind_address, port),
        job_labels(run_id, cfg.file_sd_labels),
    )
    try:
        target.write()
    except OSError as exc:
        raise GradWatchError(
            f"gradwatch: file_sd_path {str(cfg.file_sd_path)!r} (GRADWATCH_FILE_SD_PATH): "
            f"could not write the target file {str(target.path)!r}: {exc}"
        ) from exc
    log.info("gradwatch: Prometheus file_sd target written to %s", target.path)
    target.keep()  # written again if its directory disappears
    remove_on_sigterm(target)
    return target


def _shutdown(
    publisher: Publisher,
    http: HTTPEndpoint | None,
    timeout: float,
    discovery: FileSDTarget | None = None,
) -> None:
    """Flush, stop the publisher, stop serving, remove the ``file_sd`` target, close the sinks:
    all within ``timeout`` seconds (plus a few milliseconds), whatever a sink or the endpoint
    is doing.

    Flushing first means no publisher thread is still inside ``pending.result()`` when the
    caller tears the process group down right after, and every pending step reaches the sinks
    before they are closed. What could not be flushed in time is counted in
    ``gradwatch_dropped_snapshots_total`` and logged once. Every wait has a deadline: the
    publisher is a daemon thread, and sinks are closed from a daemon thread that is abandoned
    when it overruns (a history file on a hung mount must not hold the job's exit).
    """
    timeout = max(timeout, 0.0)
    deadline = time.monotonic() + timeout
    # Keep a share of the budget for stopping and closing once flushing has used its own.
    teardown = min(1.0, timeout * 0.2)
    try:
        publisher.flush(max(deadline - teardown - time.monotonic(), 0.0))
        lost = publisher.stop(max(deadline - teardown / 2 - time.monotonic(), 0.0))
        if lost:
            log.warning(
                "gradwatch: closing: %d collected step(s) could not be published within %.1fs "
                "(a sink such as the history file is blocked, or a collective is pending); "
                "counted in gradwatch_dropped_snapshots_total. The publisher is a daemon "
                "thread and is abandoned",
                lost,
                timeout,
            )
    finally:
        try:
            if http is not None:
                http.close(max(deadline - time.monotonic(), 0.0))
        finally:
            try:
                if discovery is not None:
                    discovery.remove()
            except OSError as exc:
                log.warning(
                    "gradwatch: could not remove the file_sd target %s: %s", discovery.path, exc
                )
            finally:
                _close_sinks(publisher.sinks, deadline)


def _close_sinks(sinks: Sequence[Sink], deadline: float) -> None:
    """Close every sink that has a ``close()``, in a daemon thread joined until ``deadline``."""
    closer = threading.Thread(
        target=_close_each, args=(sinks,), name="gradwatch-close-sinks", daemon=True
    )
    closer.start()
    closer.join(max(deadline - time.monotonic(), 0.05))
    if closer.is_alive():
        log.warning(
            "gradwatch: closing the sinks did not finish in time (a file system that blocks?); "
            "left to a daemon thread"
        )


def _close_each(sinks: Sequence[Sink]) -> None:
    for sink in sinks:
        close = getattr(sink, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception as exc:  # closing must not raise into training
            log.warning("gradwatch: could not close the sink %r: %s", sink, exc)
