"""rlbatch-train run for real by end-to-end tests: any command line (:func:`run_train`) or the
default recipe without plot, TensorBoard, HF export or progress bar (:func:`train_recipe`),
and the metrics.jsonl records they read."""

from __future__ import annotations

import json
import subprocess


def run_train(bin_dir, env, run_dir, *args, check=True, timeout=600):
    """``rlbatch-train ARGS hydra.run.dir=run_dir`` from run_dir's parent; with ``check``, a
    non-zero exit fails the test showing the output's tails."""
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *args, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=timeout,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics(run_dir):
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_recipe(bin_dir, env, run_dir, *overrides, cwd=None):
    """``rlbatch-train +recipe=grpo_qwen`` into ``run_dir``; its metrics.jsonl records."""
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={run_dir}",
         "logging.plot=false", "logging.tensorboard=false", "trainer.checkpoint.export_hf=false",
         "logging.progress=false", *overrides],
        capture_output=True, text=True, env=env, cwd=cwd or run_dir.parent, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def stable(record):
    """A metrics record without its timings (what equal runs share exactly)."""
    timing = ("_s", "_seconds", "seconds")
    return {
        k: v
        for k, v in record.items()
        if not k.endswith(timing) and "per_s" not in k and k != "peak_memory_gb"
    }
