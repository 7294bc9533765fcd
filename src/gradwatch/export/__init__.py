"""The exporter: what global rank 0 does with each collected step.

One publisher thread puts every materialized snapshot on the Prometheus endpoint's published
state, then offers it to the other sinks (:class:`Sink`: the history file, the trackers, any
sink a user adds), each written from its own bounded queue and thread. The modules, each with
one job:

* :mod:`~gradwatch.export.metricdef`: what one metric's definition is (:class:`MetricDef`:
  name, type, labels, HELP text, buckets, how its samples are read) and the values it reads.
* :mod:`~gradwatch.export.metrics`: the catalog (:data:`METRICS`), one definition per exported
  metric, referred to by object everywhere else; a contract.
* :mod:`~gradwatch.export.state`: the published state (counts and the last step's samples, one
  immutable object per publish) and the exporter's self-stats.
* :mod:`~gradwatch.export.collector`: the prometheus_client Collector rendering the catalog.
* :mod:`~gradwatch.export.publisher`: the :class:`Sink` protocol and the publisher thread.
* :mod:`~gradwatch.export.sinkworker`: one sink's bounded queue and thread (drops, retries,
  stalls: counted per sink, logged rate-limited).
* :mod:`~gradwatch.export.http`: bind the port, start and feed the exporter process (renders
  the exposition on change, never per request).
* :mod:`~gradwatch.export.server`: the exporter process (HTTP, TLS, basic auth, per-client
  limits), run outside the training interpreter.
* :mod:`~gradwatch.export.webconfig`: TLS and basic authentication from the exporter-toolkit
  web configuration file (or the older TLS fields).
* :mod:`~gradwatch.export.publishing`: :func:`open_publishing`, the watcher's entry point, and
  :class:`Publishing` / :class:`MetricsServer`, which wire the above together.

docs/metrics.md is rendered from the catalog outside the package (``scripts/gen_metrics_docs.py``).

Nothing here can raise into the training loop once publishing is open: errors are logged and
counted (``gradwatch_publish_errors_total`` for the endpoint, ``gradwatch_sink_errors_total``
and ``gradwatch_sink_dropped_steps_total`` per sink).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names are imported lazily (PEP 562): the exporter process imports gradwatch.export.server
# without the rest (no pydantic, no torch, no prometheus_client).
_EXPORTS = {
    "SnapshotCollector": "collector",
    "HEAD_TIMEOUT": "server",
    "LISTEN_BACKLOG": "server",
    "MAX_INFLIGHT_PER_CLIENT": "server",
    "MAX_SCRAPE_WAIT": "server",
    "MAX_SCRAPES_PER_SECOND": "server",
    "SCRAPE_BURST": "server",
    "RENDER_INTERVAL": "http",
    "METRICS": "metrics",
    "METRICS_BY_NAME": "metrics",
    "MetricDef": "metricdef",
    "MetricSource": "metricdef",
    "MetricType": "metricdef",
    "MAX_PENDING": "publisher",
    "PendingLike": "publisher",
    "Sink": "publisher",
    "CLOSE_TIMEOUT": "publishing",
    "EXIT_CLOSE_TIMEOUT": "publishing",
    "MetricsServer": "publishing",
    "Publishing": "publishing",
    "open_publishing": "publishing",
    "COLLECT_SECONDS_BUCKETS": "metricdef",
    "MAX_PARAM_SERIES": "metricdef",
    "select_param_series": "metricdef",
    "WebSettings": "webconfig",
    "load_web_config": "webconfig",
}

if TYPE_CHECKING:
    from gradwatch.export.collector import SnapshotCollector
    from gradwatch.export.http import RENDER_INTERVAL
    from gradwatch.export.metricdef import (
        COLLECT_SECONDS_BUCKETS,
        MAX_PARAM_SERIES,
        MetricDef,
        MetricSource,
        MetricType,
        select_param_series,
    )
    from gradwatch.export.metrics import METRICS, METRICS_BY_NAME
    from gradwatch.export.publisher import MAX_PENDING, PendingLike, Sink
    from gradwatch.export.publishing import (
        CLOSE_TIMEOUT,
        EXIT_CLOSE_TIMEOUT,
        MetricsServer,
        Publishing,
        open_publishing,
    )
    from gradwatch.export.server import (
        HEAD_TIMEOUT,
        LISTEN_BACKLOG,
        MAX_INFLIGHT_PER_CLIENT,
        MAX_SCRAPE_WAIT,
        MAX_SCRAPES_PER_SECOND,
        SCRAPE_BURST,
    )
    from gradwatch.export.webconfig import WebSettings, load_web_config

__all__ = [
    "CLOSE_TIMEOUT",
    "COLLECT_SECONDS_BUCKETS",
    "EXIT_CLOSE_TIMEOUT",
    "HEAD_TIMEOUT",
    "LISTEN_BACKLOG",
    "MAX_INFLIGHT_PER_CLIENT",
    "MAX_PARAM_SERIES",
    "MAX_PENDING",
    "MAX_SCRAPES_PER_SECOND",
    "MAX_SCRAPE_WAIT",
    "METRICS",
    "METRICS_BY_NAME",
    "RENDER_INTERVAL",
    "SCRAPE_BURST",
    "MetricDef",
    "MetricSource",
    "MetricType",
    "MetricsServer",
    "PendingLike",
    "Publishing",
    "Sink",
    "SnapshotCollector",
    "WebSettings",
    "load_web_config",
    "open_publishing",
    "select_param_series",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
