"""docs/scale.md's series figures are the catalog's: computed here through the real Collector
(``series_count``, the function docs/metrics.md's figure comes from), never typed by hand."""

from __future__ import annotations

from pathlib import Path

from gradwatch.export.metricdef import NORM_BUCKETS
from scripts.gen_metrics_docs import series_count

SCALE = Path(__file__).resolve().parents[3] / "docs" / "scale.md"
METRICS_DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"

#: The fleet docs/scale.md sizes: jobs, per-parameter series per job, scrape interval.
JOBS, TOP_K, INTERVAL = 5_000, 50, 15


def text() -> str:
    return " ".join(SCALE.read_text().split())  # line breaks do not split a figure


def test_series_per_job_agree_with_the_catalog_and_metrics_md() -> None:
    ten = series_count(10)
    per_group = series_count(11) - ten
    hist = len(NORM_BUCKETS) + 3
    doc = text()
    assert f"exposes **{ten} series**" in doc
    assert f"holds {ten} series" in " ".join(METRICS_DOC.read_text().split())
    assert f"adds **{per_group}** ({hist} of them" in doc
    assert f"so 5 groups expose {series_count(5)}." in doc
    # without the buckets (+Inf included), the sum and count of each group's histogram remain
    assert f"leaves {per_group - (len(NORM_BUCKETS) + 1)} series per group" in doc


def test_fleet_figures_follow_from_the_series_per_job() -> None:
    per_job = series_count(10) + TOP_K
    doc = text()
    assert f"At {per_job} series per job (10 groups and `param_metrics_top_k={TOP_K}`)" in doc
    assert f"{JOBS:,} concurrent jobs are {JOBS * per_job:,} active series" in doc
    rate = round(JOBS * per_job / INTERVAL, -2)
    assert f"scraped every {INTERVAL} s (about {rate:,.0f} samples/s)" in doc
