"""The CUDA path's agreement promises. The landing of device data (``result()`` woken when it
lands, never a poll, never ``Event.query()``) runs here on fake events; the rest needs a GPU
(``cuda``-marked, skipped where there is none; ``gradwatch doctor --checks cuda`` runs the same
checks on a cluster)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradwatch.doctor import cuda as doctor_cuda
from gradwatch.reduce import collective


class _Event:
    """A CUDA event stand-in: ``synchronize()`` returns when the test lets the data land;
    ``query()`` must never be called (a query from another thread can break a user's capture)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def synchronize(self) -> None:
        self.gate.wait(10.0)

    def query(self) -> bool:
        raise AssertionError("an event was polled")


def test_a_waiter_is_woken_when_the_data_lands() -> None:
    event = _Event()
    flag = collective.landed(event)
    waiter_done = threading.Event()

    def waiter() -> None:
        collective.wait_landed(flag, 10.0, "the vector")
        waiter_done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not waiter_done.wait(0.05)  # not landed: still waiting
    event.gate.set()  # the data lands
    assert waiter_done.wait(5.0)
    thread.join()


def test_landings_are_watched_in_record_order_and_time_out() -> None:
    first, second = _Event(), _Event()
    flags = [collective.landed(first), collective.landed(second)]
    second.gate.set()
    with pytest.raises(collective.GradWatchTimeoutError, match="did not reach the host"):
        collective.wait_landed(flags[1], 0.05, "the vector")  # behind the first one
    first.gate.set()
    collective.wait_landed(flags[1], 5.0, "the vector")
    assert flags[0].is_set()


class _CountingEvent(_Event):
    """A stand-in event that counts its waits (the landing thread's only CUDA call)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.gate.set()

    def synchronize(self) -> None:
        self.waits += 1
        super().synchronize()


def test_no_event_is_waited_on_inside_a_capture_window() -> None:
    landing = collective._Landing()
    event = _CountingEvent()
    with landing.window(5.0):
        flag = landing.watch(event)
        assert not flag.wait(0.1)  # recorded, not waited on while the window is open
        assert event.waits == 0
        with landing.window(5.0):  # windows nest
            pass
        assert not flag.wait(0.05) and event.waits == 0
    assert flag.wait(5.0) and event.waits == 1  # the window closed: the wait runs


def test_opening_a_window_waits_for_a_wait_in_progress(caplog: pytest.LogCaptureFixture) -> None:
    landing = collective._Landing()
    busy = _Event()  # a wait in progress until its gate opens
    landing.watch(busy)
    deadline = time.monotonic() + 5.0
    while not landing._in_wait and time.monotonic() < deadline:
        time.sleep(0.001)
    threading.Timer(0.1, busy.gate.set).start()
    t0 = time.monotonic()
    with landing.window(5.0):
        assert busy.gate.is_set()  # opened only once the wait in progress returned
    assert time.monotonic() - t0 >= 0.05
    stuck = _Event()
    landing.watch(stuck)
    while not landing._in_wait and time.monotonic() < deadline:
        time.sleep(0.001)
    with caplog.at_level("WARNING", logger="gradwatch"), landing.window(0.05):
        pass  # bounded: opens anyway, says so
    assert "capture_window()" in caplog.text
    stuck.gate.set()


def test_collect_and_clip_inside_a_capture_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwatch import GradWatch, GradWatchError, WatchConfig

    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    with GradWatch(model, WatchConfig(port=None)) as watch:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        with pytest.raises(GradWatchError, match="CUDA graph capture"):
            watch.collect(0)
        with pytest.raises(GradWatchError, match="CUDA graph capture"):
            watch.clip_grad_norm_(1e-3, step=0)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
        monkeypatch.undo()
        assert watch.collect(1).result().step == 1  # refused, never counted as a failure


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_global_capture_inside_a_window_with_results_in_flight() -> None:
    """A result whose data is still on its way while the user captures in global mode: the
    capture succeeds and the result lands after the window."""
    import gradwatch
    from gradwatch import GradWatch, WatchConfig

    model = torch.nn.Linear(64, 64).cuda()
    static = torch.randn(8, 64, device="cuda")
    model(static).sum().backward()
    with GradWatch(model, WatchConfig(port=None)) as watch:
        pending = watch.collect(0)
        graph = torch.cuda.CUDAGraph()
        with gradwatch.capture_window(), torch.cuda.graph(graph):
            out = model(static) * 2
        graph.replay()
        torch.cuda.synchronize()
        assert pending.result().step == 0 and out.shape == (8, 64)


def test_outside_cuda_nothing_is_capturing() -> None:
    assert collective.capturing() is False




def _passes(check: doctor_cuda.Check) -> None:
    assert check.status == "PASS", (check.name, check.measured, check.detail)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_collect_clip_result_never_synchronize() -> None:
    _passes(doctor_cuda.check_cuda_syncs(torch.device("cuda")))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reducer_follows_model_cuda() -> None:
    _passes(doctor_cuda.check_cuda_follow(torch.device("cuda")))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clip_norms_are_bitwise_equal_across_replicas() -> None:
    _passes(doctor_cuda.check_cuda_bitwise(torch.device("cuda")))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_is_refused() -> None:
    _passes(doctor_cuda.check_cuda_capture(torch.device("cuda")))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_failure_path_makes_no_blocking_copy() -> None:
    """The stand-in of a failed pass writes its marker by fill_ (a kernel argument)."""
    from gradwatch import GradWatch, WatchConfig

    model = torch.nn.Linear(8, 4).cuda()
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    with GradWatch(model, WatchConfig(port=None)) as watch:
        watch.collect(0).result()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            watch._reducer.reduce_failed(1)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_audit_reads_no_device_tensor_when_judging() -> None:
    from gradwatch.analysis.audit import HostCopy, NormAuditor  # noqa: F401

    value = torch.tensor(3.0, device="cuda")
    copy = HostCopy.of(value)
    assert isinstance(copy, HostCopy) and copy.host is not None and copy.host.is_pinned()
