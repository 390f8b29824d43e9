"""One real rlbatch-train run for a benchmark: its metrics records, or why it did not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional


def train_run(args: list[str], run_dir: Path) -> tuple[Optional[list[dict]], str]:
    """(metrics records, '') of ``rlbatch-train ARGS hydra.run.dir=run_dir``, or (None, the
    configuration errors or the output's last lines)."""
    train = Path(sys.executable).parent / "rlbatch-train"
    command = [str(train) if train.exists() else "rlbatch-train", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=run_dir.parent)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        errors = [ln.strip() for ln in lines if ln.strip().startswith("- ")]
        return None, " ".join(errors or lines[-2:])[:300]
    return [json.loads(line) for line in metrics.read_text().splitlines()], ""


def cell(value: Any) -> str:
    """A benchmark table's cell: n/a for a figure not measured, floats to three places."""
    return "n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
