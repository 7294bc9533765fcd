"""The demo's one options object and its messages (:mod:`gradwatch.cli.demo`), without torchrun.

* every flag of ``gradwatch demo`` is the :class:`DemoOptions` field of the same name, with the
  same default (nothing restates an option by hand);
* the options reach the job whole through the work directory and come back equal; a malformed
  ``options.json`` is an error naming the field, also from the job's own entry point;
* the checks of the options name the flag; the messages round-trip, NaN included.

The runs themselves (flags, output, exit statuses) are ``tests/e2e/test_cli_demo.py``'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from pathlib import Path

import pytest

from gradwatch.cli.demo import demo, job_command
from gradwatch.cli.demo_protocol import (
    DemoOptionError,
    DemoOptions,
    HealthMin,
    JobError,
    LastStep,
    Ready,
    Summary,
    Workdir,
)
from gradwatch.cli.step_events import StepEvents

FULL = DemoOptions(
    nproc=3, steps=30, port=0, bind="127.0.0.1", nan_at=5, explode_at=9, spike_at=11,
    seed_at=10, blend_at=20, step_sleep=0.02, linger=3.5, nan_rank=2, guard=True,
)  # fmt: skip


def test_every_demo_flag_is_an_options_field_with_its_default() -> None:
    params = inspect.signature(demo).parameters
    fields = {f.name: f.default for f in dataclasses.fields(DemoOptions)}
    assert sorted(params) == sorted(fields)
    assert {name: p.default for name, p in params.items()} == fields


def test_options_reach_the_job_whole(tmp_path: Path) -> None:
    work = Workdir(tmp_path)
    assert work.read_options() == DemoOptions()  # a job started by hand: the defaults
    work.write(FULL)
    assert work.read_options() == FULL
    assert DemoOptions.from_json(FULL.to_json()) == FULL
    # the job's command line carries no option: only where to read them and whom to watch
    argv = job_command(FULL, tmp_path)
    assert argv[argv.index("gradwatch.cli.demo_job") :] == [
        "gradwatch.cli.demo_job", "--workdir", str(tmp_path), "--parent-pid", str(os.getpid())
    ]  # fmt: skip
    assert argv[argv.index("--nproc_per_node") + 1] == "3"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"steps": "30"}', "steps"),  # strict: no silent conversion
        ('{"guard": 1}', "guard"),
        ('{"nan_at": 2.5}', "nan_at"),
        ('{"nan_att": 3}', "nan_att"),  # a misspelt field is not ignored
        ('{"steps": 10, "nan_at": 10}', "--nan-at"),
        ('{"nproc": 65}', "--nproc"),
        ('{"step_sleep": -1}', "--step-sleep"),
        ('{"linger": Infinity}', "--step-sleep/--linger"),
    ],
)
def test_a_malformed_options_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    (tmp_path / Workdir.OPTIONS).write_text(text)
    with pytest.raises(ValueError, match=field):
        Workdir(tmp_path).read_options()


def test_the_job_refuses_a_malformed_options_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradwatch.cli import demo_job

    (tmp_path / Workdir.OPTIONS).write_text('{"steps": 0}')
    assert demo_job.main(["--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert Workdir.OPTIONS in err and "--steps" in err, err
    assert not (tmp_path / Workdir.READY).exists()


@pytest.mark.parametrize(
    ("kwargs", "flag", "words"),
    [
        ({"steps": 30, "nan_at": 30}, "--nan-at", "[0, 30) (--steps)"),
        ({"steps": 30, "spike_at": -1}, "--spike-at", "[0, 30)"),
        ({"steps": 30, "seed_at": 31}, "--seed-at", "[0, 30]"),
        ({"seed_at": 20, "blend_at": 10}, "--blend-at", "before --seed-at"),
        ({"nan_rank": 1}, "--nan-rank", "needs --nan-at"),
        ({"nan_at": 3, "nan_rank": 2}, "--nan-rank", "[0, 2) (--nproc)"),
        ({"step_sleep": math.nan}, "--step-sleep/--linger", "finite"),
    ],
)
def test_inconsistent_options_name_the_flag(
    kwargs: dict[str, object], flag: str, words: str
) -> None:
    with pytest.raises(DemoOptionError) as raised:
        DemoOptions(**kwargs)  # type: ignore[arg-type]
    assert raised.value.flag == flag and words in raised.value.problem, raised.value


def test_phases() -> None:
    opts = DemoOptions(steps=30)
    assert opts.phases == (7, 19)  # a quarter, then midway to the end
    assert [opts.phase(s) for s in (0, 6, 7, 18, 19, 29)] == [
        "host", "host", "seed", "seed", "blend", "blend"
    ]  # fmt: skip
    assert DemoOptions(steps=30, seed_at=10, blend_at=10).phases == (10, 10)
    assert DemoOptions(steps=30, seed_at=25).phases == (25, 28)


def test_messages_round_trip(tmp_path: Path) -> None:
    work = Workdir(tmp_path)
    assert work.read(Ready) is None and work.read(Summary) is None and not work.acked()
    ready = Ready(metrics_url="http://127.0.0.1:1/metrics")
    work.write(ready)
    assert work.read(Ready) == ready
    error = JobError(kind="port_in_use", message="taken")
    work.write(error)
    assert work.has_error() and work.read(JobError) == error
    summary = Summary(
        steps_run=9, world_size=2, parallelism="ddp2",
        last=LastStep(step=8, global_norm=1.5, groups={"host": math.inf}, ratios={}, health=1.0),
        events=StepEvents(nonfinite=[3], amp_skipped=[], exploding=[3, 4], skipped=[3]),
        isolation_violation_steps={"stem": []}, health_min=HealthMin(value=0.0, step=3),
        nonfinite_origins={3: [1]},
    )  # fmt: skip
    work.write(summary)
    assert work.read(Summary) == summary
    work.write(Summary(health_min=HealthMin(value=math.nan, step=0)))
    read = work.read(Summary)
    assert read is not None and read.health_min is not None and math.isnan(read.health_min.value)
    (tmp_path / Workdir.READY).write_text('{"metrics_url": 1}')  # a malformed message
    assert work.read(Ready) is None
    work.ack()
    assert work.acked()
