"""The logging group of the schema (``logging.*``): rank 0's console, the run directory's metric
files, and the optional Weights & Biases and MLflow sinks. Pure Python like
:mod:`rlbatch.config.schema`, which re-exports these classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlbatch.config.enums import WandbMode


@dataclass
class WandbConfig:
    enabled: bool = False
    """Log every step's metrics and the resolved config to Weights & Biases (pip install wandb)."""
    project: str = "rlbatch"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team or user); null = the account's default."""
    name: Optional[str] = None
    """Run name; null = the run directory's name."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""
    mode: WandbMode = WandbMode.online
    """online | offline (files under <run_dir>/wandb, ``wandb sync`` later) | disabled."""


@dataclass
class MlflowConfig:
    enabled: bool = False
    """Log every step's metrics and the resolved config to MLflow (pip install mlflow)."""
    tracking_uri: Optional[str] = None
    """MLflow tracking URI (http://host:5000, file:///path); null = <run_dir>/mlruns."""
    experiment: str = "rlbatch"
    """Experiment name (created when missing)."""
    run_name: Optional[str] = None
    """Run name; null = the run directory's name."""


@dataclass
class LoggingConfig:
    level: str = "INFO"
    """Log level of rank 0 (other ranks log warnings only)."""
    progress: bool = True
    """Rich progress bar over optimizer steps."""
    jsonl: bool = True
    """Write <run_dir>/metrics.jsonl."""
    tensorboard: Optional[bool] = None
    """Write TensorBoard events to <run_dir>/tb. null (auto) = when the tensorboard package is
    installed (pip install 'rlbatch[tensorboard]'), silently otherwise; true = warn when it
    is missing; false = off."""
    plot: bool = True
    """Write <run_dir>/metrics.png at the end."""
    plans: bool = False
    """Write each step's train-pass plan (rlbatch-plan's JSON) and the mini-batch's lengths to
    <run_dir>/plans/step_NNNNN.json."""
    samples: bool = False
    """Write every trained sample of each step to <run_dir>/samples/step_NNNNN.jsonl: prompt text
    and answer, token ids, loss mask, turns (role, text), reward and its parts, advantage, why
    the episode ended."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases sink (optional extra ``wandb``)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow sink (optional extra ``mlflow``)."""
