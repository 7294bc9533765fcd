"""The doctor's ``cuda[late-peer]`` check run on the CPU with the stand-in of a vector that has
not landed (as in tests/unit/test_never_stops_alone.py: a ``meta`` tensor for the device
vector, its host copy in ``_pinned`` and a landing flag set only when the late rank arrives):
it PASSes on this code and FAILs, with its figure, when a late landing stops collection."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from gradwatch.doctor import cuda_paths
from gradwatch.doctor.options import FAIL, PASS
from gradwatch.reduce.collective import wait_landed
from gradwatch.reduce.packing import Reducer
from gradwatch.reduce.reduced import ReducedVector

CPU = torch.device("cpu")


class NeverLands:
    """A late peer on the CPU: the held step's vector becomes one whose pinned copy has not
    landed (after the clip and the guard read it on the device), until :meth:`arrive`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.last: ReducedVector | None = None
        self.flag: threading.Event | None = None
        original = Reducer.pack_and_reduce

        def recording(reducer: Reducer, *args: Any, **kwargs: Any) -> ReducedVector:
            self.last = original(reducer, *args, **kwargs)
            return self.last

        monkeypatch.setattr(Reducer, "pack_and_reduce", recording)

    def hold(self) -> None:
        self.last = None

    def held(self) -> None:
        reduced = self.last
        assert reduced is not None and reduced.on_cpu
        reduced._pinned = reduced._packed.clone()
        reduced._packed = torch.zeros(reduced._packed.shape, dtype=torch.float64, device="meta")
        reduced._landed = self.flag = threading.Event()

    def arrive(self) -> None:
        assert self.flag is not None
        self.flag.set()


def test_late_peer_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = NeverLands(monkeypatch)
    result = cuda_paths.check_cuda_late_peer(CPU, peer)
    assert result.status == PASS and result.name == "cuda[late-peer]", result
    assert result.measured.startswith(f"step {cuda_paths.LATE_STEPS // 2}: in flight"), result
    assert peer.flag is not None and peer.flag.is_set()


def test_late_peer_fails_when_a_late_landing_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    def stops(self: ReducedVector, timeout: float) -> None:
        wait_landed(self._landed, timeout, f"the vector of step {self._step}")  # not in flight

    monkeypatch.setattr(ReducedVector, "_wait_landed", stops)
    result = cuda_paths.check_cuda_late_peer(CPU, NeverLands(monkeypatch))
    assert result.status == FAIL, result
    assert "not in flight" in result.measured and "0 stops" not in result.measured, result


def test_late_peer_skips_without_cuda() -> None:
    from gradwatch.doctor.cuda import cuda_checks

    checks = dict(cuda_checks(CPU))
    assert checks["cuda[late-peer]"]().status == "SKIP"
