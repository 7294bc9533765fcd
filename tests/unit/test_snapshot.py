"""Snapshot and GroupStats: immutability, derived properties, dict/JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from types import MappingProxyType

import pytest

from gradwatch import GroupStats, Snapshot
from gradwatch.snapshot import snapshot_of


def make() -> Snapshot:
    return Snapshot(
        step=12,
        global_norm=5.0,
        groups={
            "host": GroupStats(norm=3.0, numel=10, tensors=2, vanishing=1, exploding=0),
            "seed": GroupStats(norm=4.0, numel=6, tensors=1, vanishing=0, exploding=2, nonfinite=1),
        },
        param_norms={"a": 3.0, "b": 4.0},
        nonfinite_params=["b"],  # type: ignore[arg-type]
        ratios={"seed/host": 1.25},
        raw_ratios={"seed/host": 4 / 3},
        health=0.5,
        isolation_violated={"host": True},
        world_size=2,
        parallelism="ddp2",
        clip_coef=0.5,
        timestamp=123.5,
    )


def test_defaults() -> None:
    snap = Snapshot(step=3)
    assert snap.global_norm == 0.0 and snap.health == 1.0
    assert dict(snap.groups) == {} and snap.nonfinite_params == ()
    assert snap.is_finite and snap.exploding == 0 and snap.vanishing == 0
    assert GroupStats() == GroupStats(0.0, 0, 0, 0, 0, 0)


def test_immutable() -> None:
    snap = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.groups["x"] = GroupStats()  # type: ignore[index]
    with pytest.raises(TypeError):
        snap.param_norms["a"] = 0.0  # type: ignore[index]
    assert isinstance(snap.nonfinite_params, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.groups["host"].norm = 1.0  # type: ignore[misc]


def test_mutating_the_source_dict_does_not_change_the_snapshot() -> None:
    source = {"a": 1.0}
    snap = Snapshot(step=0, param_norms=source)
    source["a"] = 2.0
    assert snap.param_norms["a"] == 1.0


def test_derived_properties() -> None:
    snap = make()
    assert snap.exploding == 2 and snap.vanishing == 1
    assert not snap.is_finite  # a non-finite parameter even with a finite global norm
    assert not Snapshot(step=0, global_norm=math.nan).is_finite
    assert not Snapshot(step=0, global_norm=math.inf).is_finite


def test_replace() -> None:
    snap = make()
    other = snap.replace(amp_skipped=True, clip_coef=None)
    assert other.amp_skipped and other.clip_coef is None
    assert not snap.amp_skipped and snap.clip_coef == 0.5
    assert other.groups == snap.groups


def test_dict_round_trip_and_json() -> None:
    snap = make()
    data = snap.to_dict()
    assert data["groups"]["seed"] == {
        "norm": 4.0,
        "numel": 6,
        "tensors": 1,
        "vanishing": 0,
        "exploding": 2,
        "nonfinite": 1,
        "weight_norm": None,  # update_stats off: not measured
        "update_norm": None,
        "update_ratio": None,
        "stalled_fraction": None,
    }
    assert data["nonfinite_params"] == ["b"]
    text = json.dumps(data)
    back = Snapshot.from_dict(json.loads(text))
    assert back == snap
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_json_with_nonfinite_values() -> None:
    snap = Snapshot(step=1, global_norm=math.nan, param_norms={"x": math.inf}, health=0.0)
    back = Snapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    assert math.isnan(back.global_norm) and back.param_norms["x"] == math.inf


def test_from_dict_ignores_unknown_keys() -> None:
    data = make().to_dict()
    data["future_field"] = 1
    assert Snapshot.from_dict(data) == make()


def test_of_builds_what_the_constructor_builds() -> None:
    """The warm path's constructor: every field, frozen mappings and tuples, equal to the
    dataclass constructor's snapshot; the source dicts stay the caller's."""
    base = make()
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    values["groups"] = dict(base.groups)
    values["nonfinite_params"] = ["b"]
    built = snapshot_of(**values)
    assert built == base and built.__dict__ == base.__dict__
    assert isinstance(built.nonfinite_params, tuple)
    with pytest.raises(TypeError):
        built.groups["x"] = GroupStats()  # type: ignore[index]
    values["groups"]["x"] = GroupStats()
    assert "x" not in built.groups
    minimal = snapshot_of(step=3)
    assert minimal == Snapshot(step=3) and minimal.__dict__ == Snapshot(step=3).__dict__
    assert pickle.loads(pickle.dumps(minimal)) == minimal


def test_of_refuses_unknown_and_missing_fields() -> None:
    with pytest.raises(TypeError, match="bogus"):
        snapshot_of(step=1, bogus=2)
    with pytest.raises(TypeError, match="step"):
        snapshot_of(global_norm=1.0)


def test_of_takes_a_read_only_proxy_as_given() -> None:
    """A proxy is handed over (the warm path builds its per-parameter mapping once); a plain
    dict is copied."""
    owned = MappingProxyType({"a": 1.0})
    plain = {"a": 1.0}
    snap = snapshot_of(step=1, param_norms=owned, ratios=plain)
    assert snap.param_norms is owned
    plain["b"] = 2.0
    assert dict(snap.ratios) == {"a": 1.0}


def test_amend_fresh_is_replace_without_the_copy() -> None:
    """A snapshot amended in place holds what ``replace`` gives, field for field, its
    mappings and tuples frozen alike; unknown fields raise as in ``replace``."""
    from gradwatch.snapshot import amend_fresh

    changes = {"clip_coef": 0.25, "spike_scores": {"host": 1.5}, "spiking_groups": ["host"],
               "amp_skipped": True}
    want = make().replace(**changes)
    fresh = make()
    got = amend_fresh(fresh, changes)
    assert got is fresh
    assert repr(got) == repr(want)
    assert isinstance(got.spike_scores, MappingProxyType) and got.spiking_groups == ("host",)
    changes["spike_scores"]["host"] = 9.0  # the caller's dict: copied, as replace copies it
    assert got.spike_scores["host"] == 1.5
    with pytest.raises(TypeError, match="no field"):
        amend_fresh(make(), {"no_such_field": 1})
