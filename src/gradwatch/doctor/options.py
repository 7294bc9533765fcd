"""What a ``gradwatch doctor`` run is given and gives back.

The options (``--device``, ``--dtype``, ``--checks`` parsed into :class:`DoctorOptions`, bad
input a one-line :class:`DoctorError`), one :class:`Check` per line of the table, the
environment it reports and the ``--json`` document. The checks themselves:
:mod:`gradwatch.doctor.checks`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

PASS, FAIL, SKIP, INCONCLUSIVE = "PASS", "FAIL", "SKIP", "INCONCLUSIVE"
#: Every status a check can have: passed, failed, not applicable here (SKIP), or measured but
#: too noisy for a verdict (INCONCLUSIVE).
STATUSES = (PASS, FAIL, SKIP, INCONCLUSIVE)

#: ``--dtype`` names -> gradient dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
class DoctorError(ValueError):
    """Bad input to the doctor (a device that does not exist, an unknown dtype): one line."""


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    status: str  # PASS, FAIL, SKIP or INCONCLUSIVE (STATUSES)
    measured: str
    threshold: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class DoctorOptions:
    device: torch.device
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES.values())
    quick: bool = False
    timeout: float = 60.0  # bounds the distributed handshake and every collective
    only: tuple[str, ...] = ()  # check families to run (FAMILIES); empty: all


#: The check families, in table order (``--checks``).
FAMILIES = (
    "environment",
    "exactness",
    "syncs",
    "memory",
    "cost",
    "threading",
    "kernels",
    "endpoint",
    "cuda",
    "distributed",
)


def parse_families(spec: str | None) -> tuple[str, ...]:
    """``syncs,distributed`` -> those families; None -> () (all)."""
    if spec is None:
        return ()
    names = tuple(dict.fromkeys(s.strip().lower() for s in spec.split(",") if s.strip()))
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise DoctorError(f"--checks {spec}: expected a comma list of {', '.join(FAMILIES)}")
    return names


def resolve_device(spec: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a device that exists, else DoctorError.

    Under torchrun ``auto`` and ``cuda`` mean the rank's own GPU (``LOCAL_RANK``)."""
    spec = spec.strip().lower()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local % torch.cuda.device_count())
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DoctorError(
                f"--device {spec}: CUDA is not available here (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or auto"
            )
        count = torch.cuda.device_count()
        if spec == "cuda":
            return torch.device("cuda", local % count)
        index = spec.partition(":")[2]
        if not index.isdigit():
            raise DoctorError(f"--device {spec}: expected cuda:N with N an integer")
        if int(index) >= count:
            raise DoctorError(
                f"--device {spec}: device index out of range ({count} CUDA device(s): "
                f"cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", int(index))
    raise DoctorError(f"--device {spec}: expected auto, cpu, cuda or cuda:N")


def parse_dtypes(spec: str | None) -> tuple[torch.dtype, ...]:
    """``float32,bfloat16`` -> dtypes; None or ``all`` -> every supported gradient dtype."""
    if spec is None or spec.strip().lower() == "all":
        return tuple(DTYPES.values())
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in DTYPES]
    if unknown or not names:
        raise DoctorError(f"--dtype {spec}: expected a comma list of {', '.join(DTYPES)}")
    return tuple(DTYPES[n] for n in dict.fromkeys(names))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and devices (the JSON document's ``environment``)."""
    from gradwatch.version import __version__

    env: dict[str, Any] = {
        "gradwatch": __version__,
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "device": str(device),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "rank": int(os.environ.get("RANK", "0")),
    }
    if torch.cuda.is_available():
        env["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
        env["cuda_driver"] = cuda_driver_version()
        with contextlib.suppress(RuntimeError, AttributeError):  # no NCCL in this build
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        env["cuda_devices"] = []
    return env


def cuda_driver_version(library: str = "libcuda.so.1") -> str | None:
    """The CUDA driver's version (``cuDriverGetVersion``: 12040 -> ``"12.4"``), or None when
    the driver library cannot be loaded or queried. torch exposes only the version it was
    built with (``torch.version.cuda``), not the installed driver's."""
    import ctypes

    try:
        lib = ctypes.CDLL(library)
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def to_json(checks: Sequence[Check], device: torch.device, seconds: float | None = None) -> str:
    """The ``--json`` document: environment, every check, the failing names, ``ok``, and the
    run's duration in seconds."""
    failed = [c.name for c in checks if c.status == FAIL]
    doc = {
        "environment": environment(device),
        "seconds": seconds,
        "checks": [c.to_dict() for c in checks],
        "failed": failed,
        "ok": not failed,
    }
    return json.dumps(doc, indent=2)
