"""What the framework callbacks add to the frameworks' own logs."""

from __future__ import annotations

from gradwatch.snapshot import Snapshot

PREFIX = "gradwatch/"


def log_figures(snap: Snapshot) -> dict[str, float]:
    """Flat ``{name: float}`` for a framework's logger: global and group norms, ratios, health,
    and with ``update_stats`` the measured update figures (whole model and per group; an
    unmeasured figure is left out, never logged as 0)."""
    out = {
        f"{PREFIX}global_grad_norm": snap.global_norm,
        f"{PREFIX}health": snap.health,
        f"{PREFIX}nonfinite_tensors": float(len(snap.nonfinite_params)),
        f"{PREFIX}exploding_tensors": float(snap.exploding),
    }
    for name, group in snap.groups.items():
        out[f"{PREFIX}grad_norm/{name}"] = group.norm
    for key, value in snap.ratios.items():
        out[f"{PREFIX}ratio/{key}"] = value
    if snap.clip_coef is not None:
        out[f"{PREFIX}clip_coef"] = snap.clip_coef
    out.update(_update_figures(snap))
    return out


#: The update figures of ``update_stats`` (:class:`~gradwatch.snapshot.GroupStats` fields).
UPDATE_FIGURES = ("weight_norm", "update_norm", "update_ratio", "stalled_fraction")


def _update_figures(snap: Snapshot) -> dict[str, float]:
    out: dict[str, float] = {}
    for field in UPDATE_FIGURES:
        value = getattr(snap, field)
        if value is not None:
            out[f"{PREFIX}{field}"] = value
        for name, group in snap.groups.items():
            value = getattr(group, field)
            if value is not None:
                out[f"{PREFIX}{field}/{name}"] = value
    return out
