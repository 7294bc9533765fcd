"""The demo's training phases, shared by the job and the terminal view (no torch import, so
``gradwatch demo`` starts fast and only the job's processes load torch)."""

from __future__ import annotations

__all__ = ["default_phases", "phase_of"]


def phase_of(step: int, seed_at: int, blend_at: int) -> str:
    """``"host"``, ``"seed"`` (host frozen) or ``"blend"`` for ``step``."""
    if step < seed_at:
        return "host"
    return "seed" if step < blend_at else "blend"


def default_phases(steps: int, seed_at: int | None, blend_at: int | None) -> tuple[int, int]:
    """Phase boundaries: the seed grows at a quarter of the run, blending starts midway
    between that and the end, unless given."""
    seed = steps // 4 if seed_at is None else seed_at
    blend = (seed + steps + 1) // 2 if blend_at is None else blend_at
    return seed, max(blend, seed)
