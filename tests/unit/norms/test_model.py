"""Unit tests of model resolution (gradwatch.norms.model): names, groups, parallelism labels."""

from __future__ import annotations

import pytest
from torch import nn

from gradwatch.config import OTHER_GROUP
from gradwatch.errors import GradWatchError
from gradwatch.norms.model import (
    WRAPPER_SEGMENTS,
    clean_name,
    describe_parallelism,
    find_ddp,
    group_membership,
    group_of,
    named_parameters,
    wrapping_ddp,
)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


def fake_ddp(inner: nn.Module) -> nn.parallel.DistributedDataParallel:
    """A DistributedDataParallel instance without a process group (never run)."""
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = inner
    ddp.process_group = object()
    return ddp


def test_named_parameters_are_clean_and_ordered() -> None:
    inner = net()
    wrapper = nn.Module()
    wrapper.module = inner
    names, params = named_parameters(wrapper)
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert params == list(inner.parameters())
    assert all(seg not in n.split(".") for n in names for seg in WRAPPER_SEGMENTS)
    assert clean_name("module._orig_mod.layer.0.weight") == "layer.0.weight"


def test_duplicate_clean_names_refused() -> None:
    model = nn.Module()
    model.module = nn.Linear(2, 2)
    model.add_module("_orig_mod", nn.Linear(2, 2))
    with pytest.raises(GradWatchError, match="duplicate parameter names after unwrapping"):
        named_parameters(model)


def test_group_membership_first_match_and_other() -> None:
    groups = {"host": ["backbone.*"], "both": ["backbone.0.*", "seed.*"]}
    assert group_of("backbone.0.weight", groups) == "host"  # first group in order wins
    assert group_of("seed.bias", groups) == "both"
    assert group_of("Seed.bias", groups) == OTHER_GROUP  # case-sensitive
    groups_of, order = group_membership(["backbone.1.w", "seed.b", "head.w"], groups)
    assert groups_of == ["host", "both", OTHER_GROUP]
    assert order == ["host", "both", OTHER_GROUP]
    assert group_membership(["seed.b"], groups) == (["both"], ["host", "both"])


def test_parallelism_single_and_replicated() -> None:
    model = net()
    params = list(model.parameters())
    assert describe_parallelism(model, params, 1, None) == "single"
    assert describe_parallelism(model, params, 3, None) == "replicated3"


def test_ddp_found_inside_or_wrapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face Trainer and Lightning hand callbacks the unwrapped module while a DDP
    wrapper trains it: the label is ddp{n} either way, like for plain DDP."""
    import gradwatch.norms.model as model_mod

    monkeypatch.setattr(model_mod.dist, "get_world_size", lambda group=None: 2)
    inner = net()
    params = list(inner.parameters())
    assert wrapping_ddp(inner) is None
    ddp = fake_ddp(inner)
    assert find_ddp(ddp) is ddp and find_ddp(inner) is None
    assert wrapping_ddp(inner) is ddp
    assert describe_parallelism(ddp, params, 2, None) == "ddp2"
    assert describe_parallelism(inner, params, 2, None) == "ddp2"
    # A framework's own wrapper in between (Lightning wraps the module before DDP does).
    middle = nn.Module()
    middle.inner = inner
    outer = fake_ddp(middle)
    del ddp
    assert wrapping_ddp(inner) is outer
    assert describe_parallelism(inner, params, 2, None) == "ddp2"
    assert wrapping_ddp(net()) is None  # another model: not wrapped


def test_a_group_matching_no_parameter_is_warned_about_at_construction(caplog) -> None:
    import logging

    from torch import nn

    from gradwatch import GradWatch, WatchConfig

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    cfg = WatchConfig(groups={"host": ["0.*"], "seed": ["nomatch.*"]})
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        GradWatch(model, cfg).close()
    warned = [r.getMessage() for r in caplog.records if "matches no parameter" in r.getMessage()]
    assert len(warned) == 1 and "'seed'" in warned[0] and "nomatch.*" in warned[0], warned
    assert "'host'" not in warned[0]
