"""Discovery without Kubernetes: a Prometheus ``file_sd`` target entry for rank 0's endpoint.

On Slurm or bare machines rank 0 lands on whichever node the scheduler picks, so no static
scrape configuration can name it. With ``WatchConfig.file_sd_path`` set, rank 0 writes one
target group in Prometheus's ``file_sd`` format when its endpoint is bound::

    [{"targets": ["node17:9977"], "labels": {"run_id": "...", "slurm_job_id": "4242"}}]

and removes it when publishing closes. A Prometheus whose ``file_sd_configs`` reads that
directory (``files: [/shared/prom-targets/*.json]``) starts scraping the job within its
``refresh_interval`` (it also watches the files) and drops the target once the file is gone.

The file is written atomically (a temporary file in the same directory, flushed and
``fsync``-ed, then ``os.replace``), so Prometheus never reads half an entry. A job killed with
SIGKILL cannot remove its file: the target then shows ``up == 0`` until something removes it
(a Slurm epilog, docs/operations.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SLURM_LABELS", "FileSDTarget", "job_labels", "target_address"]

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


class FileSDTarget:
    """One ``file_sd`` file holding this job's target group; :meth:`write` and
    :meth:`remove` are idempotent and raise ``OSError`` on failure.

    ``path`` names the file, or an existing directory, in which the file is
    ``gradwatch-<slurm job id or run id>.json`` (``-<array task id>`` appended for an array
    task).
    """

    def __init__(
        self, path: str | os.PathLike[str], address: str, labels: Mapping[str, str]
    ) -> None:
        path = Path(path)
        if path.is_dir():
            stem = labels.get("slurm_job_id") or labels["run_id"]
            task = labels.get("slurm_array_task_id")
            path = path / f"gradwatch-{stem}{f'-{task}' if task else ''}.json"
        self.path = path
        self.entry = [{"targets": [address], "labels": dict(labels)}]
        self._written = False

    def write(self) -> None:
        """Write the entry atomically (temporary file, fsync, rename)."""
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
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._written = True

    def remove(self) -> None:
        """Remove the file this target wrote (a no-op when it wrote none or it is gone)."""
        if self._written:
            self._written = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
