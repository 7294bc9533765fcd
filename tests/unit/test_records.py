"""``fast_init`` builds the same frozen record as the dataclass's own ``__init__``."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from gradwatch.analysis.summary import CollectedStep
from gradwatch.norms.gradients import LocalGradients
from gradwatch.records import fast_init
from gradwatch.reduce.reduced import ReducedStats
from gradwatch.step.collector import Collected
from gradwatch.step.localpass import Acted, Acting


@dataclass(frozen=True)
class Plain:
    a: int
    b: float = 1.5
    c: tuple[int, ...] = ()


@fast_init
@dataclass(frozen=True)
class Fast:
    a: int
    b: float = 1.5
    c: tuple[int, ...] = ()


def as_plain(record: Fast) -> Plain:
    return Plain(**vars(record))


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1,), {}), ((1, 2.0), {}), ((1,), {"c": (3,)}), ((), {"a": 4, "b": 0.5, "c": (1, 2)})],
)
def test_the_same_fields_as_the_dataclass_init(args: tuple, kwargs: dict) -> None:
    fast, plain = Fast(*args, **kwargs), Plain(*args, **kwargs)
    assert vars(fast) == vars(plain)
    assert list(vars(fast)) == [f.name for f in dataclasses.fields(Fast)]  # in field order
    assert as_plain(fast) == plain
    assert fast == Fast(*args, **kwargs) and hash(fast) == hash(Fast(*args, **kwargs))
    assert pickle.loads(pickle.dumps(fast)) == fast
    assert dataclasses.replace(fast, b=9.0) == Fast(fast.a, 9.0, fast.c)


def test_still_frozen_and_the_same_signature() -> None:
    fast = Fast(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 2  # type: ignore[misc]
    assert inspect.signature(Fast) == inspect.signature(Plain)
    with pytest.raises(TypeError, match="missing"):
        Fast()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected"):
        Fast(1, d=2)  # type: ignore[call-arg]


def test_refuses_what_it_would_not_reproduce() -> None:
    with pytest.raises(TypeError, match="not a frozen dataclass"):
        fast_init(dataclass(type("Open", (), {"__annotations__": {"a": "int"}})))

    @dataclass(frozen=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="default factory"):
        fast_init(Factory)

    @dataclass(frozen=True)
    class Post:
        a: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="__post_init__"):
        fast_init(Post)


@pytest.mark.parametrize(
    "record", [CollectedStep, Collected, Acted, Acting, LocalGradients, ReducedStats]
)
def test_the_per_collect_records_use_it(record: type) -> None:
    names = record.__init__.__code__.co_names  # the fast one stores into the instance dict
    assert "__dict__" in names and "__setattr__" not in names
    assert record.__init__.__qualname__ == f"{record.__qualname__}.__init__"
    params = list(inspect.signature(record).parameters)
    assert params == [f.name for f in dataclasses.fields(record)]
