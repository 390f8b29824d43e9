"""rlbatch-train saves on a clock (trainer.checkpoint.every_minutes) and keeps only the last
trainer.checkpoint.keep_last checkpoints."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.e2e


def test_every_minutes_saves_and_keep_last_prunes(bin_dir, subprocess_env, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            str(bin_dir / "rlbatch-train"),
            "+recipe=grpo_qwen",
            "trainer.max_steps=4",
            "trainer.checkpoint.every_steps=0",
            "trainer.checkpoint.every_minutes=0.0001",  # 6 ms: overdue after every step
            "trainer.checkpoint.keep_last=3",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_00000002", "step_00000003", "step_00000004"]
