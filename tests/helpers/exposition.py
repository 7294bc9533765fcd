"""The endpoint's exposition text for a published state, through the real exporter's collector
(no HTTP server): what a scrape of rank 0 would return."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gradwatch.export.collector import SnapshotCollector
from gradwatch.export.state import PublishedState, SelfStats


def exposition_text(
    state: PublishedState, *, world_size: int = 1, parallelism: str = "single"
) -> str:
    """One scrape of ``state`` (collecting, run ``run`` started at time 0), as text."""
    stats = SelfStats()
    stats.set_collecting(True)
    registry = CollectorRegistry()
    registry.register(
        SnapshotCollector(
            state, stats, world_size=world_size, parallelism=parallelism, run_id="run",
            start_time=0.0,
        )
    )
    return generate_latest(registry).decode()
