"""Generate docs/metrics.md from the metric catalog (gradwatch.export.METRICS).

    python scripts/gen_metrics_docs.py           # (re)write docs/metrics.md
    python scripts/gen_metrics_docs.py --check   # exit 1 if the committed file is out of date
    python scripts/gen_metrics_docs.py --output - # print it

The catalog is the single source of the Collector and of the reference, so the documented
names, types, labels and HELP texts are the exported ones. tests/unit/test_export.py fails when the
committed file and the catalog differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradwatch.export import metrics_reference_markdown

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "metrics.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the output is out of date")
    parser.add_argument(
        "--output",
        default=str(TARGET),
        help="file to write, or - for stdout (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    text = metrics_reference_markdown()
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    output = Path(args.output)
    if args.check:
        current = output.read_text() if output.exists() else ""
        if current != text:
            print(
                f"{output} is out of date with gradwatch.export.METRICS: run "
                "`python scripts/gen_metrics_docs.py`",
                file=sys.stderr,
            )
            return 1
        print(f"{output} is up to date")
        return 0
    output.write_text(text)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
