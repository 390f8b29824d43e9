"""Experiment trackers fed by rank 0's MetricsLogger: TensorBoard, Weights & Biases, MLflow.

Each sink gets the same per-step records as metrics.jsonl (numbers only; ``step`` is the x
axis) and, at start, the resolved config (<run_dir>/resolved.yaml, flattened to dotted keys for
MLflow). The packages are optional extras; the driver refuses an enabled sink whose package is
missing (TensorBoard: a warning), so a missing package here is an internal error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("rlbatch.train")

RESOLVED = "resolved.yaml"


class Sink(Protocol):
    def log(self, record: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers (not ``step``, not bools, not null)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def resolved_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config as a dict ({} when the driver wrote none, e.g. in tests)."""
    path = run_dir / RESOLVED
    if not path.exists():
        return {}
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"data": {"reward": "math"}} -> {"data.reward": "math"}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step or None)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        for key, value in numeric(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """wandb.init with logging.wandb.*; the run id derives from the run directory, so a resume
    into the same directory continues the same wandb run."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        import wandb

        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.name,
            tags=list(cfg.tags) or None,
            mode=getattr(cfg.mode, "value", cfg.mode),
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=resolved_config(run_dir),
        )

    def log(self, record: Mapping[str, Any], step: int) -> None:
        self.run.log(numeric(record), step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_tracking_uri(cfg: Any, run_dir: Path) -> str:
    """logging.mlflow.tracking_uri, else $MLFLOW_TRACKING_URI, else a file store in the run
    directory (MLflow 3 keeps file stores behind MLFLOW_ALLOW_FILE_STORE; set here for it)."""
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (run_dir / "mlruns").resolve().as_uri()


class MlflowSink:
    """An MLflow run in logging.mlflow.experiment (see :func:`mlflow_tracking_uri`)."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(mlflow_tracking_uri(cfg, run_dir))
        mlflow.set_experiment(cfg.experiment)
        self.run = mlflow.start_run(run_name=cfg.run_name or run_dir.name)
        params = {k: str(v)[:500] for k, v in flatten(resolved_config(run_dir)).items()}
        if params:
            mlflow.log_params(params)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        # MLflow names allow letters, digits and _-. /: eval/pass@4 becomes eval/pass_at_4
        metrics = {k.replace("@", "_at_"): v for k, v in numeric(record).items()}
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_sinks(logging_cfg: Any, run_dir: Path, resumed_step: int) -> list[Sink]:
    """The enabled trackers of ``logging_cfg`` (rank 0 only); ``resumed_step``: the last step
    already done (0: a fresh run), so TensorBoard purges events from step resumed_step + 1."""
    sinks: list[Sink] = []
    if logging_cfg.tensorboard is not False:
        if importlib.util.find_spec("tensorboard") is None:
            if logging_cfg.tensorboard:
                log.warning(
                    "logging.tensorboard=true but tensorboard is not installed: no events written"
                )
        else:
            sinks.append(TensorBoardSink(run_dir / "tb", resumed_step + 1))
    wandb_cfg = getattr(logging_cfg, "wandb", None)
    if wandb_cfg is not None and wandb_cfg.enabled:
        sinks.append(WandbSink(wandb_cfg, run_dir))
    mlflow_cfg = getattr(logging_cfg, "mlflow", None)
    if mlflow_cfg is not None and mlflow_cfg.enabled:
        sinks.append(MlflowSink(mlflow_cfg, run_dir))
    return sinks
