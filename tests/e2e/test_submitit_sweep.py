"""A Hydra sweep through hydra-submitit-launcher (the `slurm` extra) runs its jobs: the local
executor pickles the sweep the way the SLURM one does, and each job trains in its own
directory of the sweep."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.e2e


def test_submitit_sweep_runs_a_training_job(bin_dir, subprocess_env, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra")
    proc = subprocess.run(
        [
            str(bin_dir / "rlbatch-train"),
            "-m",
            "hydra/launcher=submitit_local",
            "+recipe=grpo_qwen",
            "trainer.max_steps=1",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env,
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps  # the job found the directory its sweep was given
    assert len((sweeps[0] / "0" / "metrics.jsonl").read_text().splitlines()) == 1
