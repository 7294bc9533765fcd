"""The doctor's ``cuda[rank-timing]`` check: listed among the CUDA checks and a SKIP without
CUDA (the clock's logic is tested on the CPU with a fake event: tests/unit/step/
test_ranktimer.py; on a CUDA machine ``gradwatch doctor --device cuda`` runs it)."""

from __future__ import annotations

import torch

from gradwatch.doctor.cuda import cuda_checks
from gradwatch.doctor.options import SKIP
from gradwatch.step.ranktimer import cuda_clock


def test_rank_timing_skips_without_cuda() -> None:
    checks = dict(cuda_checks(torch.device("cpu")))
    result = checks["cuda[rank-timing]"]()
    assert result.status == SKIP and result.name == "cuda[rank-timing]"


def test_host_parameters_get_the_host_clock() -> None:
    assert cuda_clock([torch.nn.Parameter(torch.zeros(2))]) is None

