"""Frozen records built on every collect, constructed at the cost of a plain class.

A frozen dataclass's generated ``__init__`` stores each field through ``object.__setattr__``
(its own ``__setattr__`` raises): a global lookup and a call per field, one to two
microseconds for a record of ten fields, and a collect builds several such records on the
training thread. :func:`fast_init` gives the class an ``__init__`` that stores the fields in
the instance dict directly: the same signature (fields in order, their defaults), the same
values stored, the record as frozen as before (assigning a field still raises
``FrozenInstanceError``). A leaf: any module may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["fast_init"]

_Record = TypeVar("_Record", bound=type)


def fast_init(cls: _Record) -> _Record:
    """Decorate a frozen dataclass (applied above ``@dataclass(frozen=True)``) with the fast
    ``__init__`` of the module docs. Refused (``TypeError``) for what that ``__init__`` would
    not reproduce: a class that is no frozen dataclass, has ``__slots__`` or a
    ``__post_init__``, or a field with a default factory or left out of ``__init__``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"fast_init: {cls.__name__} is not a frozen dataclass")
    if "__slots__" in vars(cls) or hasattr(cls, "__post_init__"):
        raise TypeError(f"fast_init: {cls.__name__} has __slots__ or a __post_init__")
    fields = dataclasses.fields(cls)
    defaults: dict[str, Any] = {}
    signature: list[str] = []
    for f in fields:
        if f.default_factory is not dataclasses.MISSING or not f.init:
            raise TypeError(
                f"fast_init: field {cls.__name__}.{f.name} has a default factory or init=False"
            )
        if f.default is dataclasses.MISSING:
            signature.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            signature.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"    fields[{f.name!r}] = {f.name}\n" for f in fields)
    source = f"def __init__(self, {', '.join(signature)}):\n    fields = self.__dict__\n{body}"
    namespace: dict[str, Any] = {}
    exec(source, defaults, namespace)  # built from the field names only (identifiers)
    init = namespace["__init__"]
    init.__annotations__ = dict(cls.__init__.__annotations__)  # the dataclass's: its signature
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init
    return cls
