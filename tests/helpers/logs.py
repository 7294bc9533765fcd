"""The gradwatch logger's records as text, for workers in spawned worlds (where pytest's
``caplog`` does not reach)."""

from __future__ import annotations

import logging


class Capture(logging.Handler):
    """The gradwatch logger's records (WARNING and above), as text, while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Capture:
        logging.getLogger("gradwatch").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("gradwatch").removeHandler(self)
