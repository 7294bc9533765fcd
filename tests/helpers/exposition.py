"""The endpoint's exposition text for a published state, through the real exporter's collector
(no HTTP server): what a scrape of rank 0 would return."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

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


#: Sample name -> {sorted label pairs: value}
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse(text: str) -> Samples:
    """Sample name -> {sorted label pairs: value}; asserts no timestamps and unique series."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.timestamp is None, f"{s.name} carries a timestamp"
            key = tuple(sorted(s.labels.items()))
            series = out.setdefault(s.name, {})
            assert key not in series, f"duplicate series {s.name}{key}"
            series[key] = s.value
    return out
