"""The package's version: a leaf module (no import), so anything may read it without importing
the package's face (``gradwatch/__init__``, which exposes the watcher and the exporter)."""

__version__ = "0.1.0"
