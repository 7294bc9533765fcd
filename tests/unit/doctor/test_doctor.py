"""``gradwatch doctor``: the real console script on the CPU (table and JSON: every check present
and passing), its bad input (exit 2, one line), and the checks' own verdicts: a check that
cannot fail proves nothing, so each failure mode is shown to be detected."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from gradwatch.cli.main import app
from gradwatch.doctor import checks as doctor
from gradwatch.doctor import options as doctor_options

TIMEOUT = 240  # a loaded shared CPU; the doctor's own budget is 60 s
#: Every check the CPU run reports (the distributed one is SKIP outside torchrun).
CPU_CHECKS = [
    "environment",
    *[f"environment.foreach_norm_fp64[{d}]" for d in ("float32", "bfloat16", "float16", "float64")],
    "exactness[float32 elements of 1e20]",
    "exactness[float32 elements of 1e-25]",
    "exactness[bfloat16 constants over 2^24 elements]",
    "exactness[float16 near its max]",
    "exactness[float64 elements of 1e160]",
    "exactness[float64 elements of 1e-160]",
    *[f"exactness[NaN/Inf positions, {d}]" for d in ("float32", "bfloat16", "float16", "float64")],
    "syncs",
    "memory",
    "cost[float32, collect()+result() vs get_total_norm]",
    "cost[float32, clip_grad_norm_ vs torch's]",
    "cost[bfloat16, collect()+result() vs _foreach_norm(dtype=f32)]",
    "cost[bfloat16, clip_grad_norm_ vs torch's]",
    "threading",
    "kernels",
    "endpoint",
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "gradwatch.cli.main", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _passed(name: str, status: str | None) -> bool:
    """PASS; a cost check may also be INCONCLUSIVE, the doctor's own verdict when the machine
    was too busy to judge speed (median/best spread above its bound; a FAIL still fails)."""
    return status == "PASS" or (name.startswith("cost[") and status == "INCONCLUSIVE")


def _rows(table: str) -> dict[str, str]:
    """check name -> status, from the printed table (a row starts with its status)."""
    rows = {}
    for line in table.splitlines():
        status, _, name = line.partition(" ")
        if status in doctor_options.STATUSES and name.strip():
            rows[name.strip()] = status
    return rows


def test_doctor_cpu_table_every_check_passes() -> None:
    result = run("--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _rows(result.stdout)
    for name in CPU_CHECKS:
        assert _passed(name, rows.get(name)), (name, result.stdout)
    assert rows["distributed"] == "SKIP"  # not under torchrun: tests/distributed runs it


def test_doctor_cpu_json_every_check_passes() -> None:
    result = run("--device", "cpu", "--json", "--quick")
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    status = {c["name"]: c["status"] for c in doc["checks"]}
    for name in CPU_CHECKS:
        assert _passed(name, status.get(name)), (name, doc)
    assert status["distributed"] == "SKIP"
    cuda = [name for name in status if name.startswith("cuda[")]
    assert len(cuda) == 11 and all(status[name] == "SKIP" for name in cuda), status
    assert doc["ok"] is True and doc["failed"] == []
    assert doc["environment"]["torch"] == torch.__version__
    assert all(c["measured"] and c["threshold"] for c in doc["checks"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: see the next test")
def test_device_cuda_without_cuda_exits_2_one_line() -> None:
    result = run("--device", "cuda")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "CUDA is not available" in result.stderr
    assert result.stdout == ""


def test_device_cuda_without_cuda_exits_2_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["doctor", "--device", "cuda"])
    assert result.exit_code == 2
    assert "--device cuda: CUDA is not available" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_device_index_out_of_range_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = CliRunner().invoke(app, ["doctor", "--device", "cuda:2"])
    assert result.exit_code == 2
    assert "cuda:2: device index out of range (2 CUDA device(s): cuda:0..cuda:1)" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert doctor_options.resolve_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "--device tpu: expected auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:x"], "--device cuda:x"),
        (["--dtype", "int8"], "--dtype int8: expected a comma list of"),
        (["--checks", "speed"], "--checks speed: expected a comma list of environment"),
        (["--timeout", "0"], "--timeout"),
    ],
)
def test_bad_input_exits_2(
    monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = CliRunner().invoke(app, ["doctor", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_a_failing_check_exits_1_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = doctor_options.Check("syncs", doctor_options.FAIL, "1 blocking host copies", "0")
    good = doctor_options.Check("memory", doctor_options.PASS, "1 MiB", "< 2 MiB")
    monkeypatch.setattr(doctor, "run_checks", lambda options: [good, bad])
    result = CliRunner().invoke(app, ["doctor", "--device", "cpu"])
    assert result.exit_code == 1
    assert "gradwatch doctor: FAILED: syncs" in result.output


def test_reference_norm_is_exact_over_float64s_range() -> None:
    import math

    for value in (1e300, 1e-300, 3.0):
        t = torch.full((3000,), value, dtype=torch.float64)
        assert doctor.reference_norm([t]) == pytest.approx(value * math.sqrt(3000), rel=1e-14)
    assert math.isnan(doctor.reference_norm([torch.tensor([1.0, math.nan, math.inf])]))
    assert doctor.reference_norm([torch.tensor([1.0, -math.inf])]) == math.inf


def test_exactness_check_fails_on_a_wrong_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactness check compares against its own reference: a 1e-5 error is a FAIL."""
    real = doctor.reference_norm
    monkeypatch.setattr(doctor, "reference_norm", lambda ts: real(ts) * (1 + 1e-5))
    checks = doctor.check_exactness(torch.device("cpu"), (torch.float64,))
    assert [c.status for c in checks if c.name.startswith("exactness[float64")] == ["FAIL"] * 2


def test_kernels_check_fails_on_a_wrong_bf16_row_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels check holds the bf16 row-norm kernel to 1e-6: a 1e-5 error is a FAIL."""
    from gradwatch.doctor.kernels import check_kernels
    from gradwatch.norms import fused

    real = fused.row_norms_kernel

    def wrong(rows: list[torch.Tensor]) -> torch.Tensor:
        return real(rows) * (1 + 1e-5)

    monkeypatch.setattr(fused, "row_norms_kernel", wrong)
    check = check_kernels(torch.device("cpu"))
    assert check.status == "FAIL" and "bf16 rows 1e-05" in check.measured, check


def test_sync_check_fails_on_a_python_built_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step tail built by torch.tensor(list), as it once was, is caught."""
    from gradwatch.reduce import packing as reduce

    original = reduce.Reducer._stage_tail

    def python_tail(self, has_grad, step):  # type: ignore[no-untyped-def]
        original(self, has_grad, step)
        self._staged_step.copy_(torch.tensor([float(step)], dtype=torch.float64))

    monkeypatch.setattr(reduce.Reducer, "_stage_tail", python_tail)
    check = doctor.check_syncs(torch.device("cpu"))
    assert check.status == "FAIL"
    assert "1 Python-built tensors, 1 blocking host copies" in check.measured


def test_memory_check_fails_on_a_gradient_sized_temporary(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradwatch.norms import stats

    original = stats.NormEngine.squared_norms_and_plan

    def wasteful(self, tensors, out_device):  # type: ignore[no-untyped-def]
        torch.cat([t.reshape(-1).double() for t in tensors if t is not None])
        return original(self, tensors, out_device)

    monkeypatch.setattr(stats.NormEngine, "squared_norms_and_plan", wasteful)
    assert doctor.check_memory(torch.device("cpu"), quick=True).status == "FAIL"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_doctor_cuda_every_check_passes() -> None:
    result = run("--device", "cuda", "--json")
    doc = json.loads(result.stdout)
    failed = [c for c in doc["checks"] if c["status"] == "FAIL"]
    assert result.returncode == 0 and not failed, failed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "family",
    ["environment", "exactness", "syncs", "memory", "cost", "threading", "endpoint", "cuda"],
)
def test_cuda_check_family_passes(family: str) -> None:
    """Each family on the GPU, as its own test (a failure names the family)."""
    options = doctor_options.DoctorOptions(
        device=doctor_options.resolve_device("cuda"), only=(family,), quick=True
    )
    checks = doctor.run_checks(options)
    assert checks, family
    assert all(c.status == "PASS" for c in checks), checks


def test_cpu_cost_is_measured_on_one_thread_like_the_benchmarks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU cost check times every method with one intra-op thread, as benchmarks/run.py
    does for single-process cases (so its figures compare with docs/performance.md's), and
    gives the job's thread count back afterwards, even when the measurement raises."""
    seen: list[int] = []

    def fake_best(fns, rounds, device, budget):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return {k: 1e-3 for k in fns}, 1.0

    monkeypatch.setattr(doctor, "_best_times", fake_best)
    monkeypatch.setattr(doctor, "_mixed", lambda dtype, device, big: [torch.ones(10)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        checks = doctor.check_cost(torch.device("cpu"), torch.float32, quick=True)
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
        assert all(c.status == "PASS" for c in checks) and "1 thread" in checks[0].detail

        def broken(fns, rounds, device, budget):  # type: ignore[no-untyped-def]
            raise RuntimeError("measurement failed")

        monkeypatch.setattr(doctor, "_best_times", broken)
        with pytest.raises(RuntimeError):
            doctor.check_cost(torch.device("cpu"), torch.float32, quick=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cuda_driver_version_from_the_driver_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment row's driver version comes from ``cuDriverGetVersion`` (torch reports
    only its build's CUDA version); no driver library, or a failing call, gives None."""
    import ctypes

    class Driver:
        def __init__(self, status: int) -> None:
            self.status = status

        def cuDriverGetVersion(self, ref) -> int:  # type: ignore[no-untyped-def]
            ref._obj.value = 12040
            return self.status

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver(0))
    assert doctor_options.cuda_driver_version() == "12.4"
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver(100))  # CUDA_ERROR_NO_DEVICE
    assert doctor_options.cuda_driver_version() is None
    monkeypatch.undo()
    assert doctor_options.cuda_driver_version("libgradwatch-no-such-driver.so") is None


def test_checks_ignore_the_jobs_gradwatch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's GRADWATCH_* settings cannot change what a check measures: with
    GRADWATCH_EVERY_N_STEPS the measured collect would be skipped (a vacuous PASS), with
    GRADWATCH_PORT every check would serve an endpoint. The checks' configuration is defaults
    and their own settings only, so the sync check reads the same with and without them."""
    cpu = torch.device("cpu")
    clean = doctor.check_syncs(cpu)
    monkeypatch.setenv("GRADWATCH_EVERY_N_STEPS", "7")
    monkeypatch.setenv("GRADWATCH_PORT", "1")
    config = doctor._config(collective_timeout_seconds=5.0)
    assert config.every_n_steps == 1 and config.port is None
    assert config.collective_timeout_seconds == 5.0
    assert doctor.check_syncs(cpu) == clean


def test_endpoint_check_binds_the_configured_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """With GRADWATCH_PORT (and GRADWATCH_BIND_ADDRESS) set, the endpoint check serves and
    scrapes on that port; a port already taken is a FAIL naming it, not a silent fallback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        monkeypatch.setenv("GRADWATCH_BIND_ADDRESS", "127.0.0.1")
        monkeypatch.setenv("GRADWATCH_PORT", str(free))
        check = doctor.check_endpoint(torch.device("cpu"))
        assert check.status == "PASS", check
        assert f"127.0.0.1:{free}/metrics" in check.measured, check
        monkeypatch.setenv("GRADWATCH_PORT", str(busy))
        options = doctor_options.DoctorOptions(device=torch.device("cpu"), only=("endpoint",))
        (failed,) = doctor.run_checks(options)
    assert failed.status == "FAIL" and str(busy) in failed.measured, failed


# -- the output: verdicts that match their details, 100 columns, rank 0 alone, no noise ------


@pytest.mark.parametrize(
    ("ratio_ms", "spread", "want"),
    [(1.0, 8.11, "INCONCLUSIVE"), (9.0, 8.11, "INCONCLUSIVE"), (1.0, 1.2, "PASS"),
     (9.0, 1.2, "FAIL")],
)  # fmt: skip
def test_a_cost_verdict_never_contradicts_its_detail(
    monkeypatch: pytest.MonkeyPatch, ratio_ms: float, spread: float, want: str
) -> None:
    """A spread the detail calls too wide for a verdict gives INCONCLUSIVE, even when the
    ratio lies within the bound (a PASS next to "a verdict needs <= 1.5" contradicts it)."""

    def fake_best(fns, rounds, device, budget):  # type: ignore[no-untyped-def]
        return {k: (ratio_ms if k in ("gradwatch", "gradwatch_clip") else 1.0) for k in fns}, spread

    monkeypatch.setattr(doctor, "_best_times", fake_best)
    monkeypatch.setattr(doctor, "_mixed", lambda dtype, device, big: [torch.ones(10)])
    checks = doctor.check_cost(torch.device("cpu"), torch.float32, quick=True)
    assert [c.status for c in checks] == [want, want]
    for c in checks:
        assert f"spread {spread:.3g} (a verdict needs <= {doctor.NOISE_BOUND:g})" in (
            c.detail
        )


LONG = [
    doctor_options.Check(
        "cost[bfloat16, collect()+result() vs _foreach_norm(dtype=f32)]", "INCONCLUSIVE",
        "0.163x (97.3 vs 595 ms best of rounds)", "<= 2x",
        "248 tensors, 96.8 MiB, 1 thread; gradwatch reads at 1.04 GB/s, a plain one-pass read "
        "at 4.93 GB/s (4.73x the read); median/best spread 1.93 (a verdict needs <= 1.5)",
    ),
    doctor_options.Check(
        "endpoint", "PASS",
        "29 metric families parsed from http://127.0.0.1:44403/metrics (bound "
        "127.0.0.1:ephemeral)", "binds the configured port, parses, serves the global norm",
    ),
    doctor_options.Check("syncs", "FAIL", "1 blocking host copies", "0 blocking copies"),
]  # fmt: skip


def test_the_table_fits_100_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(doctor, "run_checks", lambda options: LONG)
    result = CliRunner().invoke(app, ["doctor", "--device", "cpu"])
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert "gradwatch doctor: FAILED: syncs" in result.stderr
    assert _rows(result.stdout) == {c.name: c.status for c in LONG}
    assert "0.163x (97.3 vs 595 ms best of rounds) (threshold: <= 2x)" in result.stdout


def test_under_torchrun_only_rank_0_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 prints the table; another rank prints nothing when its checks passed and only
    its failing checks (and the FAILED line naming its rank) when one failed."""
    good = [c for c in LONG if c.status != "FAIL"]
    monkeypatch.setattr(doctor, "run_checks", lambda options: good)
    monkeypatch.setenv("RANK", "1")
    quiet = CliRunner().invoke(app, ["doctor", "--device", "cpu"])
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""
    monkeypatch.setattr(doctor, "run_checks", lambda options: LONG)
    failing = CliRunner().invoke(app, ["doctor", "--device", "cpu", "--json"])
    assert failing.exit_code == 1
    assert "gradwatch doctor (rank 1): FAILED: syncs" in failing.stderr
    doc = json.loads(failing.stdout)
    assert [c["name"] for c in doc["checks"]] == ["syncs"] and doc["failed"] == ["syncs"]
    table = CliRunner().invoke(app, ["doctor", "--device", "cpu"])
    assert table.exit_code == 1 and _rows(table.stdout) == {"syncs": "FAIL"}
    monkeypatch.setenv("RANK", "0")
    table = CliRunner().invoke(app, ["doctor", "--device", "cpu"])
    assert table.exit_code == 1 and _rows(table.stdout) == {c.name: c.status for c in LONG}


def test_no_torch_warning_and_no_profiler_banner(capfd: pytest.CaptureFixture[str]) -> None:
    """The memory check runs torch's profiler, whose native library writes banner lines to the
    process's stderr; the doctor's output carries none of them, nor a torch FutureWarning."""
    import warnings

    from gradwatch.cli.doctor import _no_third_party_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _no_third_party_warnings():
            check = doctor.check_memory(torch.device("cpu"), quick=True)
            warnings.warn_explicit("internal", FutureWarning, "x.py", 1, module="torch.x")
    assert check.status == "PASS"
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], seen
    err = capfd.readouterr().err
    assert "USDT" not in err and "STAGE:" not in err, err


def test_the_handshake_gathers_without_a_deprecated_call() -> None:
    """One all-gather, through torch's current API: no FutureWarning."""
    import warnings

    import torch.distributed as dist

    from gradwatch.reduce import handshake

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        out = torch.zeros(3, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            handshake._all_gather_single(out, torch.tensor([1, 2, 3], dtype=torch.uint8), None)
        assert out.tolist() == [1, 2, 3]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["mixed", "zero_fp16"])
def test_cuda_path_checks_run_their_arithmetic_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The checks' own code (model, warm-up, figure against float64) run on the CPU with the
    CUDA-only calls stood in for: a PASS with its figure. On a GPU they also prove the
    synchronizations (the sync debug mode raises)."""
    from gradwatch.doctor import cuda_paths

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    check = getattr(cuda_paths, f"check_cuda_{name}")(torch.device("cpu"))
    assert check.status == "PASS", check
    assert "0 synchronizations, rel err" in check.measured
