"""A collect's update section: the meter's per-piece figures summed per group.

:class:`gradwatch.norms.updates.UpdateMeter` keeps ``4 x P`` float64 figures per piece
(weight squares, update squares, stalled and moving elements); a collect sums those of the
pieces this rank counts per group, then appends two flags (a step could not be measured; no
previous collect): ``4G + 2`` values (:func:`gradwatch.norms.updates.section_width`).

**Two routes, the same figures.** A CPU meter of at most :data:`HOST_SECTION_PIECES` pieces
whose packed vector is packed on the host (:class:`gradwatch.reduce.packing.HostPacking`)
sums them as Python floats: one read of a CPU tensor (no device, no dispatched scalar read),
then four additions a piece, in position order from 0.0. The tensor route (any device, or
more pieces) takes a ``where`` over the counted pieces and an ``index_add_`` per group row,
or one compiled call (:func:`gradwatch.norms.fused_updates.update_section`) once it is ready.
On the CPU ``index_add_`` adds in index order too, and a piece left out adds the ``where``'s
0.0 (which changes no sum of non-negative figures): the host route's sums are the eager
tensor route's, bit for bit (tested). The compiled section sums in its own order (last bits
may differ).

Sync behaviour: none on either route (the host route reads a CPU tensor only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradwatch.norms.fused_updates import FusedUpdates

#: Pieces up to which a CPU meter sums its collect's section as Python floats; above,
#: tensor ops cost less than four additions a piece.
HOST_SECTION_PIECES = 64

#: A collect's update section: a tensor on the meter's device, or (the host route) its
#: float64 values as Python floats.
Section = Tensor | list[float]


class SectionSums:
    """The per-group sums of a meter's figures (module docstring).

    Args:
        group_index: per piece, its group's position in the section.
        groups: the number of groups.
        contributes: per piece, does this rank count it (the layout's contributor).
        device: the figures' device.
        fused: the meter's compiled kernels (the compiled section).
        host: may the section be given as floats (the packed vector is packed on the host)?
            Taken on a CPU meter of at most :data:`HOST_SECTION_PIECES` pieces.
    """

    def __init__(self, group_index: Sequence[int], groups: int, contributes: Sequence[bool],
                 device: torch.device, fused: FusedUpdates, host: bool) -> None:
        index = list(group_index)
        self._groups = groups
        self._device = device
        self._fused = fused
        self.group = torch.tensor(index, dtype=torch.long, device=device)
        self.mask = torch.tensor(list(contributes), dtype=torch.bool, device=device)
        self.all = torch.ones_like(self.mask)
        # the compiled section's tail argument per (unmeasured, no previous collect): read
        # only, built once each
        self._tails: dict[tuple[bool, bool], Tensor] = {}
        #: the host route's (piece, group) pairs in position order, when every piece counts
        #: and when only those this rank contributes do; None: the tensor route
        self.host_pairs: dict[bool, list[tuple[int, int]]] | None = None
        if host and device.type == "cpu" and len(index) <= HOST_SECTION_PIECES:
            self.host_pairs = {
                True: list(enumerate(index)),
                False: [(i, g) for i, (g, c) in enumerate(zip(index, contributes, strict=True))
                        if c],
            }

    def of(self, figures: Tensor, count_all: bool, flags: tuple[bool, bool]) -> Section:
        """The section of ``figures`` (``4 x P``) over the pieces counted (every piece when
        ``count_all``), then ``flags`` as 1.0 or 0.0."""
        if self.host_pairs is not None:
            return self._host(figures, self.host_pairs[count_all], flags)
        return self._tensors(figures, count_all, flags)

    def _host(self, figures: Tensor, pairs: list[tuple[int, int]], flags: tuple[bool, bool]
              ) -> list[float]:
        weights, updates, stalled, moving = figures.tolist()
        g = self._groups
        sums = [0.0] * (4 * g)
        for i, k in pairs:
            sums[k] += weights[i]
            sums[g + k] += updates[i]
            sums[2 * g + k] += stalled[i]
            sums[3 * g + k] += moving[i]
        sums += (float(flags[0]), float(flags[1]))
        return sums

    def _tensors(self, figures: Tensor, count_all: bool, flags: tuple[bool, bool]) -> Tensor:
        counted = self.all if count_all else self.mask
        out = None
        if self._fused.cache.mode != "off":
            tail = self._tails.get(flags)
            if tail is None:
                tail = self._tails[flags] = torch.tensor(
                    [0.0] * self._groups + [float(f) for f in flags], dtype=torch.float64)
            out = self._fused.section(figures, self.group, counted, tail)
        if out is None:
            local = torch.where(counted, figures, 0.0)
            sums = torch.zeros(4, self._groups, dtype=torch.float64, device=self._device)
            sums.index_add_(1, self.group, local)
            tail = torch.zeros(2, dtype=torch.float64, device=self._device)
            tail[0].fill_(float(flags[0]))
            tail[1].fill_(float(flags[1]))
            out = torch.cat([sums.reshape(-1), tail])
        return out
