"""Discovery without Kubernetes: a Prometheus ``file_sd`` target entry for rank 0's endpoint.

On Slurm or bare machines rank 0 lands on whichever node the scheduler picks, so no static
scrape configuration can name it. With ``WatchConfig.file_sd_path`` set, rank 0 writes one
target group in Prometheus's ``file_sd`` format when its endpoint is bound::

    [{"targets": ["node17:9977"], "labels": {"run_id": "...", "slurm_job_id": "4242"}}]

and removes it when publishing closes. A Prometheus whose ``file_sd_configs`` reads that
directory (``files: [/shared/prom-targets/*.json]``) starts scraping the job within its
``refresh_interval`` (it also watches the files) and drops the target once the file is gone.

The file is written atomically (a temporary file in the same directory, flushed and
``fsync``-ed, then ``os.replace``), so Prometheus never reads half an entry.

* **One file per endpoint, named after the job, not the run** (:func:`target_file_name`): in a
  Slurm step ``gradwatch-<job id>[-<array task id>]-step<step id>.json`` (two steps of one
  allocation get two files; a requeued job replaces its own), elsewhere
  ``gradwatch-<host>-<port>.json`` (a restarted job on the same node and port, e.g. torchrun's
  ``--max-restarts``, replaces the file of the run it replaces, even one killed by SIGKILL).
* **Kept while the job runs**: a daemon thread checks every :data:`KEEP_INTERVAL` seconds and
  writes the file again when it is gone (its directory deleted and re-created, an over-eager
  cleanup); a file another job has since written under the same name is left alone.
* **Never another job's**: :meth:`FileSDTarget.remove` deletes the file only while it still
  holds this job's entry, so the first of two jobs sharing a name never deletes the other's
  live target.
* **Removed on SIGTERM** too (:func:`remove_on_sigterm`): the handler removes every live
  target, then the previous handler runs (the default one terminates the process as before).
  A job killed with SIGKILL cannot remove its file: the next run of the same job replaces it,
  and a Slurm epilog can remove it (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "KEEP_INTERVAL",
    "SLURM_LABELS",
    "FileSDTarget",
    "job_labels",
    "remove_on_sigterm",
    "target_address",
    "target_file_name",
]

log = logging.getLogger("gradwatch")

#: Seconds between two checks that the target file still exists (rewritten when it is gone).
KEEP_INTERVAL = 10.0

#: Slurm environment variables copied into the target's labels when set (label: variable).
SLURM_LABELS: Mapping[str, str] = {
    "slurm_job_id": "SLURM_JOB_ID",
    "slurm_job_name": "SLURM_JOB_NAME",
    "slurm_array_job_id": "SLURM_ARRAY_JOB_ID",
    "slurm_array_task_id": "SLURM_ARRAY_TASK_ID",
    "slurm_cluster_name": "SLURM_CLUSTER_NAME",
}


def job_labels(
    run_id: str, extra: Mapping[str, str] = (), environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The target's labels: ``run_id``, the Slurm job's (:data:`SLURM_LABELS`, when set),
    then ``extra`` (which wins)."""
    environ = os.environ if environ is None else environ
    labels = {"run_id": run_id}
    labels.update({k: environ[v] for k, v in SLURM_LABELS.items() if environ.get(v)})
    labels.update(dict(extra))
    return labels


def target_address(bind_address: str, port: int) -> str:
    """``host:port`` Prometheus can reach: the bound address, or this machine's host name
    (``socket.gethostname()``: no DNS lookup at construction) when bound to all interfaces;
    IPv6 literals in brackets. Bind to one address to announce that one (e.g. the node's
    address on the network Prometheus scrapes)."""
    host = bind_address
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(bind_address)
        host = socket.gethostname() if ip.is_unspecified else bind_address
        if ip.version == 6 and not ip.is_unspecified:
            host = f"[{bind_address}]"
    return f"{host}:{port}"


def target_file_name(address: str, environ: Mapping[str, str] | None = None) -> str:
    """The file name of a job's target in a ``file_sd`` directory: the job's identity, stable
    across restarts of the same job and distinct for two jobs running at once.

    In a Slurm step (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set, as ``srun`` does):
    ``gradwatch-<job id>[-<array task id>]-step<step id>.json``; in a Slurm batch script
    without ``srun``: ``gradwatch-<job id>[-<array task id>].json``; elsewhere the endpoint's
    own identity, ``gradwatch-<host>-<port>.json`` (``address`` is ``host:port``). Characters
    other than letters, digits, ``.``, ``_`` and ``-`` become ``_``."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if job:
        task = environ.get("SLURM_ARRAY_TASK_ID")
        step = environ.get("SLURM_STEP_ID")
        stem = job + (f"-{task}" if task else "") + (f"-step{step}" if step else "")
    else:
        host, _, port = address.rpartition(":")
        stem = f"{host.strip('[]')}-{port}"
    return "gradwatch-" + re.sub(r"[^A-Za-z0-9._-]", "_", stem) + ".json"


class FileSDTarget:
    """One ``file_sd`` file holding this job's target group; :meth:`write` and
    :meth:`remove` are idempotent and raise ``OSError`` on failure.

    ``path`` names the file, or an existing directory, in which the file is
    :func:`target_file_name` of ``address``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        address: str,
        labels: Mapping[str, str],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / target_file_name(address, environ)
        self.path = path
        self.entry = [{"targets": [address], "labels": dict(labels)}]
        self._data = b""  # what the last write wrote: the file is ours while it holds this
        self._written = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._warned = False

    def write(self) -> None:
        """Write the entry atomically (temporary file, fsync, rename)."""
        with self._lock:
            self._write()

    def _write(self) -> None:
        data = (json.dumps(self.entry, indent=2, sort_keys=True) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)  # Prometheus often runs as another user
            os.replace(tmp, self.path)
            self._data = data
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._written = True

    def owns_file(self) -> bool:
        """The file holds this target's entry (not another job's that took the name)."""
        try:
            return self.path.read_bytes() == self._data
        except OSError:
            return False

    def remove(self) -> None:
        """Stop keeping the file and remove it if it still holds this target's entry (a
        no-op when it wrote none, it is gone, or another job has written it since)."""
        self._stop.set()
        unregister_for_sigterm(self)
        with self._lock:
            if not self._written:
                return
            self._written = False
            if self.owns_file():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)

    def remove_now(self) -> None:
        """:meth:`remove` without taking a lock (the SIGTERM handler's: the interrupted main
        thread may hold one)."""
        self._stop.set()
        if self._written and self.owns_file():
            self._written = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def keep(self, interval: float = KEEP_INTERVAL) -> None:
        """Check every ``interval`` seconds, in a daemon thread, that the file exists, and
        write it again when it is gone (never over another job's file), until :meth:`remove`.
        Failures are logged once, never raised: the job does not depend on its target."""
        if self._keeper is not None:
            return
        self._keeper = threading.Thread(
            target=self._keep, args=(interval,), name="gradwatch-file-sd", daemon=True
        )
        self._keeper.start()

    def _keep(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    if self._written and not self.path.exists():
                        self._write()
                        log.warning(
                            "gradwatch: the file_sd target %s was gone: written again", self.path
                        )
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "gradwatch: could not write the file_sd target %s again (retried "
                        "every %gs): %s", self.path, interval, exc
                    )


# -- removal on SIGTERM ------------------------------------------------------------------------

_live: list[FileSDTarget] = []
_live_lock = threading.Lock()
_previous: Any = None
_installed = False


def remove_on_sigterm(target: FileSDTarget) -> bool:
    """Remove ``target`` when the process gets SIGTERM, then hand the signal on.

    Installed once, from the main thread only (Python runs signal handlers there; elsewhere,
    or when SIGTERM is ignored, nothing is installed and False is returned). The handler
    removes every registered target, then calls the handler it replaced; with the default
    one it restores it and sends SIGTERM again, so the process ends exactly as without
    gradwatch (exit by signal 15)."""
    global _previous, _installed
    with _live_lock:
        if target not in _live:
            _live.append(target)
        if _installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        current = signal.getsignal(signal.SIGTERM)
        if current is signal.SIG_IGN or current is None:
            return False
        _previous = current
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True
        return True


def unregister_for_sigterm(target: FileSDTarget) -> None:
    """``target`` is no longer removed on SIGTERM (it was removed, or never registered)."""
    with _live_lock:
        if target in _live:
            _live.remove(target)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # No lock here: the handler runs on the main thread, which may hold any of them.
    for target in list(_live):
        with contextlib.suppress(OSError):
            target.remove_now()
    previous = _previous
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
