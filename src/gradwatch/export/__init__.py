"""The exporter: what global rank 0 does with each collected step.

One publisher thread hands every materialized snapshot to a list of sinks (:class:`Sink`): the
Prometheus endpoint's published state, the history file, and any sink a user adds. The modules,
each with one job:

* :mod:`~gradwatch.export.metrics`: the catalog (:data:`METRICS`), every exported name, type,
  label, HELP text and the source of its value; a contract.
* :mod:`~gradwatch.export.state`: the published state (counts and the last step's samples, one
  immutable object per publish) and the exporter's self-stats.
* :mod:`~gradwatch.export.collector`: the prometheus_client Collector rendering the catalog.
* :mod:`~gradwatch.export.publisher`: the :class:`Sink` protocol and the publisher thread.
* :mod:`~gradwatch.export.http`: bind, TLS, the scrape rate bound and cache, the HTTP server.
* :mod:`~gradwatch.export.publishing`: :func:`open_publishing`, the watcher's entry point, and
  :class:`Publishing` / :class:`MetricsServer`, which wire the above together.
* :mod:`~gradwatch.export.reference`: docs/metrics.md rendered from the catalog.

Nothing here can raise into the training loop once publishing is open: errors are logged once
per kind and counted in ``gradwatch_publish_errors_total``.
"""

from __future__ import annotations

from gradwatch.export.collector import SnapshotCollector
from gradwatch.export.http import (
    MAX_SCRAPE_WAIT,
    MAX_SCRAPES_PER_SECOND,
    PROMETHEUS_USER_AGENT,
    SCRAPE_BURST,
)
from gradwatch.export.metrics import (
    METRICS,
    METRICS_BY_NAME,
    MetricDef,
    MetricSource,
    MetricType,
)
from gradwatch.export.publisher import MAX_PENDING, PendingLike, Sink
from gradwatch.export.publishing import (
    EXIT_CLOSE_TIMEOUT,
    MetricsServer,
    Publishing,
    open_publishing,
)
from gradwatch.export.reference import metrics_reference_markdown
from gradwatch.export.state import COLLECT_SECONDS_BUCKETS, MAX_PARAM_SERIES, select_param_series

__all__ = [
    "COLLECT_SECONDS_BUCKETS",
    "EXIT_CLOSE_TIMEOUT",
    "MAX_PARAM_SERIES",
    "MAX_PENDING",
    "MAX_SCRAPES_PER_SECOND",
    "MAX_SCRAPE_WAIT",
    "METRICS",
    "METRICS_BY_NAME",
    "PROMETHEUS_USER_AGENT",
    "SCRAPE_BURST",
    "MetricDef",
    "MetricSource",
    "MetricType",
    "MetricsServer",
    "PendingLike",
    "Publishing",
    "Sink",
    "SnapshotCollector",
    "metrics_reference_markdown",
    "open_publishing",
    "select_param_series",
]
