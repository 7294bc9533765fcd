"""Importing a tracker package when its sink is built (never on ``import gradwatch``): the one
place a missing tracker becomes an error that names the extra to install. A leaf of the sinks:
each sink imports it, and the package's ``__init__`` imports the sinks (lazily)."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_tracker(module: str, missing: str) -> ModuleType:
    """The tracker package ``module``, imported when a sink is built (never on ``import
    gradwatch``); when it is not installed, an ImportError ``gradwatch: <missing>`` that names
    the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"gradwatch: {missing}") from exc
