"""Reading back what the tracker sinks wrote, with each tracker's own offline storage, and the
float64 reference the rows are checked against.

* TensorBoard: ``EventAccumulator`` over the run directory (the tensorboard package's reader);
* W&B: the ``run-<id>.wandb`` file of an offline run: a LevelDB-style log (7-byte header
  ``:W&B`` + magic + version, 32 KiB blocks of CRC-checked records) of ``Record`` protobufs,
  parsed with wandb's own protobuf classes;
* MLflow: ``MlflowClient.get_metric_history`` over a file store.

Each returns ``{tag: {step: value}}``.
"""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

Rows = dict[str, dict[int, float]]

#: The reference job: two groups and one ratio; step NAN_STEP has a NaN gradient in "first".
GROUPS = {"first": ["0.*"], "second": ["1.*"]}
RATIOS = [["second", "first"]]
STEPS = 6
NAN_STEP = 3


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def set_grads(net: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * (step + 1)
    if step == NAN_STEP:
        net[0].weight.grad[0, 0] = math.nan


def reference_rows() -> Rows:
    """Per tag and step, the values computed in float64 from the exact gradients."""
    net = model()
    rows: Rows = {}
    nonfinite_steps = 0
    for step in range(STEPS):
        set_grads(net, step)
        values = {
            g: [float(x) for p in layer.parameters() for x in p.grad.double().flatten()]
            for g, layer in (("first", net[0]), ("second", net[1]))
        }
        norms = {g: math.sqrt(math.fsum(x * x for x in v)) for g, v in values.items()}
        every = values["first"] + values["second"]
        finite = all(math.isfinite(x) for x in every)
        nonfinite_steps += 0 if finite else 1
        n, d = norms["second"], norms["first"]
        nn, dn = len(values["second"]), len(values["first"])
        ratio = (n / math.sqrt(nn)) / (d / math.sqrt(dn) + 1e-8) if math.isfinite(d) else math.nan
        row = {
            "gradwatch/global_grad_norm": math.sqrt(math.fsum(x * x for x in every)),
            "gradwatch/grad_norm/first": norms["first"],
            "gradwatch/grad_norm/second": norms["second"],
            "gradwatch/grad_norm_ratio/second/first": ratio,
            "gradwatch/health_score": 1.0 if finite else 0.0,
            "gradwatch/nonfinite_tensors/first": 0.0 if finite else 1.0,
            "gradwatch/nonfinite_tensors/second": 0.0,
            "gradwatch/nonfinite_steps_total": float(nonfinite_steps),
            "gradwatch/amp_skipped_steps_total": 0.0,
            "gradwatch/collections_total": float(step + 1),
        }
        for tag, value in row.items():
            rows.setdefault(tag, {})[step] = value
    return rows


def same(a: float, b: float, rel: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def assert_rows_match(got: Rows, expected: Rows, rel: float) -> None:
    """Every reference tag is there at every step with its value (NaN equals NaN)."""
    for tag, by_step in expected.items():
        assert tag in got, f"{tag} missing; got {sorted(got)}"
        assert sorted(got[tag]) == sorted(by_step), (tag, sorted(got[tag]))
        for step, value in by_step.items():
            assert same(got[tag][step], value, rel), (tag, step, got[tag][step], value)


# -- TensorBoard ---------------------------------------------------------------------------


def tensorboard_rows(log_dir: Path) -> Rows:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: {e.step: float(e.value) for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]
    }


# -- W&B ------------------------------------------------------------------------------------

_BLOCK = 32 * 1024
_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_RECORD = struct.Struct("<IHB")  # crc32 of type + data, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a ``.wandb`` file, CRC-checked and reassembled across blocks."""
    data = path.read_bytes()
    ident, magic, version = _HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = _HEADER.size, b""
    while pos + _RECORD.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD.size:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad CRC at {pos}"
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            yield pending
            pending = b""


def wandb_rows(run_dir: Path, keys: Sequence[str] | None = None, timeout: float = 30.0) -> Rows:
    """``{key: {_step: value}}`` of the history records of the offline run in ``run_dir``.

    Waits (at most ``timeout`` s) for the run's ``exit`` record: ``run.finish()`` called from
    another thread than the main one (gradwatch closes its sinks in a daemon thread) returns
    before W&B's service has written the run out."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = []
        for raw in wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout:g} s"
        time.sleep(0.1)
    rows: Rows = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items: Mapping[str, object] = {
            (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item
        }
        step = int(record.history.step.num)
        for key, value in items.items():
            if key.startswith("_") or (keys is not None and key not in keys):
                continue
            rows.setdefault(key, {})[step] = float(value)  # type: ignore[arg-type]
    return rows


# -- MLflow ---------------------------------------------------------------------------------


def mlflow_rows(tracking_uri: str, run_id: str) -> Rows:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    keys = client.get_run(run_id).data.metrics
    return {
        key: {m.step: float(m.value) for m in client.get_metric_history(run_id, key)}
        for key in keys
    }
