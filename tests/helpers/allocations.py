"""What ops allocate: a dispatch mode recording every new tensor (the "no gradient-sized
temporary" checks)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _storages(obj) -> set[int]:  # type: ignore[no-untyped-def]
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()} if obj.layout == torch.strided else set()
    if isinstance(obj, list | tuple):
        return set().union(*(_storages(o) for o in obj)) if obj else set()
    if isinstance(obj, dict):
        return _storages(list(obj.values()))
    return set()


class OutputRecorder(TorchDispatchMode):
    """Records (op, numel, dtype) of every tensor an op allocates (outputs that alias an
    input's storage, i.e. views and in-place results, are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _storages(list(args)) | _storages(kwargs)
        items = out if isinstance(out, list | tuple) else [out]
        for o in items:
            if isinstance(o, torch.Tensor) and (
                o.layout != torch.strided or o.untyped_storage().data_ptr() not in inputs
            ):
                self.outputs.append((str(func.overloadpacket), o.numel(), o.dtype))
        return out
