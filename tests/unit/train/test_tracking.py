"""Tracking sinks: wandb (offline mode) and MLflow (local file store) receive the per-step
metrics of metrics.jsonl and the resolved config; missing packages are config errors (wandb,
MLflow) or a warning (TensorBoard).

The wandb and MLflow tests need the optional extras (both in the dev extra); they skip, saying
so, when the package is missing.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import time

import pytest
import yaml
from rich.console import Console

from rlbatch.config.schema import LoggingConfig, MlflowConfig, RunConfig, WandbConfig, WandbMode
from rlbatch.config.validate import validate
from rlbatch.grpo.preflight import tracking_warnings
from rlbatch.train.metrics import REQUIRED_KEYS, MetricsLogger, read_jsonl

RESOLVED = {"data": {"reward": "math", "path": "/data/gsm8k.jsonl"}, "trainer": {"seed": 7}}


def _records():
    out = []
    for step in (1, 2):
        rec = {k: 0.5 * step for k in REQUIRED_KEYS}
        rec.update(step=step, tokens=100 * step)
        rec["reward/math_mean"] = 0.25 * step
        out.append(rec)
    return out


def _log_run(run_dir, cfg):
    (run_dir / "resolved.yaml").write_text(yaml.safe_dump(RESOLVED))
    log = MetricsLogger(run_dir, cfg, rank=0, max_steps=2, console=Console(file=io.StringIO()))
    for rec in _records():
        log.log(rec)
    log.close()
    return read_jsonl(run_dir / "metrics.jsonl")


def _wandb_records(path):
    """Protobuf records of a .wandb file: a 7-byte ':W&B' header, then LevelDB log blocks
    (32 KiB; each chunk: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def _finished_records(path, timeout_s=30.0):
    """The run's records once its exit record is on disk (wandb's service writes the file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


@pytest.mark.optional_extra
def test_wandb_offline_gets_every_step_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="optional extra 'wandb' not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(
        tensorboard=False,
        wandb=WandbConfig(enabled=True, mode=WandbMode.offline, tags=["ci", "tiny"], name="t"),
    )
    expected = _log_run(tmp_path, cfg)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = _finished_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, list(run.tags)) == ("rlbatch", "t", ["ci", "tiny"])
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["data"] == RESOLVED["data"] and config["trainer"] == RESOLVED["trainer"]
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2]
    for got, want in zip(history, expected, strict=True):
        for key in ("reward_mean", "loss", "tokens", "reward/math_mean"):
            assert got[key] == pytest.approx(want[key])


@pytest.mark.optional_extra
def test_mlflow_local_store_gets_every_step_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="optional extra 'mlflow' not installed")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = LoggingConfig(tensorboard=False, mlflow=MlflowConfig(enabled=True, experiment="e1"))
    expected = _log_run(tmp_path, cfg)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e1").experiment_id])
    assert run.info.run_name == tmp_path.name
    assert run.data.params["data.path"] == "/data/gsm8k.jsonl"
    assert run.data.params["trainer.seed"] == "7"
    for key in ("reward_mean", "tokens", "reward/math_mean"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["step"], r[key]) for r in expected]


def test_enabled_sink_without_its_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = RunConfig()
    cfg.logging.wandb.enabled = cfg.logging.mlflow.enabled = True
    text = [str(e) for e in validate(cfg)]
    assert "logging.wandb.enabled=true: needs the wandb package: pip install 'rlbatch[wandb]'" in (
        "\n".join(text)
    )
    assert any(t.startswith("logging.mlflow.enabled=true: needs the mlflow package") for t in text)


def test_tensorboard_missing_is_a_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    cfg = RunConfig()
    assert cfg.logging.tensorboard is None  # auto: a default run warns about nothing
    assert tracking_warnings(cfg) == []
    cfg.logging.tensorboard = True
    (warning,) = tracking_warnings(cfg)
    assert "tensorboard is not installed" in warning and "logging.tensorboard=false" in warning
    cfg.logging.tensorboard = False
    assert tracking_warnings(cfg) == []


@pytest.mark.optional_extra
def test_mlflow_gets_the_eval_metrics_under_names_it_accepts(tmp_path, monkeypatch):
    """MLflow refuses '@' in a name: eval/pass@4 is logged as eval/pass_at_4, at its step."""
    pytest.importorskip("mlflow", reason="optional extra 'mlflow' not installed")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = LoggingConfig(tensorboard=False, mlflow=MlflowConfig(enabled=True, experiment="e2"))
    log = MetricsLogger(tmp_path, cfg, rank=0, max_steps=2, console=Console(file=io.StringIO()))
    log.log({"step": 0, "eval/pass@4": 0.25})  # the step-0 baseline: eval keys only
    log.log({**_records()[1], "eval/pass@4": 0.75})
    log.close()
    assert [r.get("eval/pass@4") for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.25, 0.75]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e2").experiment_id])
    history = client.get_metric_history(run.info.run_id, "eval/pass_at_4")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (2, 0.75)]
