"""Exceptions raised by gradwatch. Every message starts with "gradwatch:" so it is findable."""

from __future__ import annotations


class GradWatchError(RuntimeError):
    """Base class of gradwatch's own errors."""


class PortInUseError(GradWatchError, OSError):
    """The metrics port is taken (raised at construction, never during training)."""


class GradWatchTimeoutError(GradWatchError, TimeoutError):
    """A gradwatch collective did not complete in ``collective_timeout_seconds``."""


class LayoutMismatchError(GradWatchError):
    """Ranks disagree on the model, the configuration or the parallel layout."""


class UnsupportedParallelismError(GradWatchError):
    """A wrapper gradwatch cannot measure correctly (e.g. FSDP1)."""


class GuardStopError(GradWatchError):
    """The guard skipped ``max_consecutive_skips`` steps in a row and
    ``on_max_consecutive_skips="raise"``: raised from the next guarded ``step()`` on every
    rank, before that step is applied."""


class SetupRefusedError(GradWatchError):
    """Another rank refused the setup after the construction handshake (a taken port, an
    unusable sink or ``file_sd_path`` on rank 0): every rank refuses it together."""
