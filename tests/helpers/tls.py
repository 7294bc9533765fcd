"""Test certificates: a self-signed certificate for 127.0.0.1, made with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, in ``directory``.
    Skips when openssl is missing (CI's REQUIRE_E2E then fails the run on an e2e skip)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", "/CN=gradwatch test", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key
