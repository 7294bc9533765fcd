"""The step agreement: whether the ranks collected the same step in one all-reduce, told by
every rank alike from the reduced vector alone.

Each rank adds, next to its step, its step's residue ``q = step mod 2^STEP_RESIDUE_BITS`` and
``q^2`` to the packed vector (:attr:`gradwatch.reduce.sections.Sections.residues`); the sums
satisfy ``world * sum(q^2) == sum(q)^2`` exactly when every rank's ``q`` is the same
(Cauchy-Schwarz), a test whose inputs are the reduced sums only: the same answer on every
rank, on the host (:func:`steps_differ`) or on the device (:func:`device_step`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Steps enter the agreement check modulo ``2^20``: ``world * sum(q^2)`` stays an exact float64
#: integer (below ``2^53``) up to 8192 ranks. Ranks whose steps differ by a multiple of
#: ``2^20`` at one collect pass the check; their step slot still tells each rank its own step
#: disagrees.
STEP_RESIDUE_BITS = 20


def step_residues(step: int) -> tuple[float, float]:
    """What a rank adds to the residue slots for ``step``: ``q`` and ``q^2``."""
    q = float(step % (1 << STEP_RESIDUE_BITS))
    return q, q * q


def steps_differ(ranks: int, residues: float, squares: float) -> bool:
    """Did the ``ranks`` ranks whose residues were summed collect different steps? Equal
    steps give ``ranks * sum(q^2) == sum(q)^2`` exactly (Cauchy-Schwarz: only then); the same
    answer on every rank, from the reduced sums alone. False for non-finite sums (a stand-in:
    the step was not measured for another reason)."""
    if not (math.isfinite(residues) and math.isfinite(squares)):
        return False
    return ranks * squares != residues * residues


#: Per (device, ranks): the device test's weights ``(1, 0)`` and ``(0, -ranks)``, made on the
#: device by fills once (no host copy).
_WEIGHTS: dict[tuple[torch.device, int], tuple[Tensor, Tensor]] = {}


def device_step(step: Tensor, residues: Tensor, ranks: int) -> Tensor:
    """The reduced step slot ``step``, NaN where the ``ranks`` ranks collected different steps,
    from the two reduced ``residues`` (``r = (sum q, sum q^2)``): ``r . (r * (1, 0) - (0,
    ranks)) = (sum q)^2 - ranks * sum q^2``, zero exactly when they agree. Five small device
    ops, no host read; the same bits on every rank."""
    weights = _WEIGHTS.get((residues.device, ranks))
    if weights is None:
        pick = torch.zeros(2, dtype=torch.float64, device=residues.device)
        pick.narrow(0, 0, 1).fill_(1.0)
        minus_ranks = torch.zeros(2, dtype=torch.float64, device=residues.device)
        minus_ranks.narrow(0, 1, 1).fill_(-float(ranks))
        weights = _WEIGHTS[(residues.device, ranks)] = (pick, minus_ranks)
    gap = torch.dot(residues, torch.addcmul(weights[1], residues, weights[0]))
    return torch.where(gap != 0, torch.nan, step)
