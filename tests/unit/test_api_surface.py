"""The public API a training script touches: its names and signatures are contracts.

The watcher a script holds is a ``GradWatch`` or, with monitoring off, a ``NoOpWatch``; the same
script must run with either, so the no-op watcher has every public method and property of the
real one, with the same parameters.
"""

from __future__ import annotations

import inspect

import gradwatch
from gradwatch import GradWatch, NoOpWatch, PendingSnapshot

#: What ``import gradwatch`` exports (the names the README and the docs use).
EXPORTED = {
    "GradWatch",
    "WatchConfig",
    "total_norm",
    "watch",
    "Snapshot",
    "GroupStats",
    "NoOpWatch",
    "PendingSnapshot",
    "ddp_comm_hook",
    "Sink",
    "GradWatchError",
    "GradWatchTimeoutError",
    "LayoutMismatchError",
    "PortInUseError",
    "UnsupportedParallelismError",
    "capture_window",
}

#: GradWatch's public methods and their parameters (``self`` left out).
METHODS = {
    "collect": ["step", "scaler", "optimizer", "batch_size"],
    "clip_grad_norm_": ["max_norm", "norm_type", "error_if_nonfinite", "step", "scaler"],
    "audit_norm": ["reported", "step", "source"],
    "attach": ["optimizer", "scaler"],
    "set_isolated": ["groups"],
    "add_sink": ["sink"],
    "guard": ["optimizer", "scaler"],
    "flush": ["timeout"],
    "close": [],
}
PROPERTIES = {"metrics_url", "last", "isolated", "parameter_names"}


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def _parameters(fn: object) -> list[str]:
    params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    return [p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def test_the_package_exports_its_names() -> None:
    missing = [n for n in EXPORTED if n not in gradwatch.__all__]
    assert not missing, missing
    for name in EXPORTED:
        assert getattr(gradwatch, name) is not None


def test_gradwatch_keeps_its_methods_and_their_parameters() -> None:
    for name, params in METHODS.items():
        assert _parameters(getattr(GradWatch, name)) == params, name
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(GradWatch, name), property), name
    assert _parameters(GradWatch.__init__) == [
        "model", "config", "process_group", "stage_group"
    ]  # fmt: skip
    assert _parameters(gradwatch.watch) == ["model", "process_group", "stage_group"]


def test_the_no_op_watcher_has_everything_the_watcher_has() -> None:
    """A script written against GradWatch runs unchanged on the NoOpWatch ``watch()`` or a
    disabled configuration gives: every public name, and each method takes what
    GradWatch's takes (a method may accept more, as ``**kwargs``)."""
    missing = sorted(_public(GradWatch) - _public(NoOpWatch) - {"rank", "world_size"})
    assert not missing, f"NoOpWatch lacks {missing}"
    for name in _public(GradWatch):
        real = inspect.getattr_static(GradWatch, name)
        if not callable(real) or isinstance(real, property):
            continue
        noop = getattr(NoOpWatch, name)
        accepts_any = any(
            p.kind is p.VAR_KEYWORD for p in inspect.signature(noop).parameters.values()
        )
        for param in _parameters(real):
            assert accepts_any or param in _parameters(noop), (name, param)


def test_a_pending_result_reads_like_before() -> None:
    assert {"done", "result", "step"} <= set(dir(PendingSnapshot(0)))
