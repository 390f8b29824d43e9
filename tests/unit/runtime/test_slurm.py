"""The SLURM pieces compose: the sbatch example's rlbatch-train command under a SLURM job's
environment, and the hydra/launcher=slurm group (hydra-submitit-launcher, the `slurm` extra)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from conftest import REPO
from rlbatch.cli.common import compose
from rlbatch.config.store import conf_dir, register_configs

SBATCH = REPO / "examples" / "slurm" / "grpo_qwen2_5_7b.sbatch"
NODE_2_OF_4 = {
    "SLURM_JOB_ID": "81234",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_JOB_NODELIST": "gpu[017-020]",
}


def _sbatch_overrides() -> list[str]:
    text = SBATCH.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    words = shlex.split(line.split("||")[0])
    return words[words.index("rlbatch-train") + 1 :]


def test_sbatch_example_derives_the_multi_node_keys_from_slurm(tmp_path, monkeypatch):
    for var, value in NODE_2_OF_4.items():
        monkeypatch.setenv(var, value)
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    overrides = []
    for word in _sbatch_overrides():
        key, _, value = word.partition("=")
        if key == "model.hf_path":
            continue  # a site path; the recipe's preset has the same architecture
        value = value.replace("$SLURM_JOB_NUM_NODES", NODE_2_OF_4["SLURM_JOB_NUM_NODES"])
        overrides.append(f"{key}=" + (str(data) if key == "data.path" else value))
    p = compose(overrides, "test").parallel
    assert (p.nnodes, p.node_rank, p.run_id) == (4, 2, "slurm-81234.0")
    assert p.rdzv_endpoint == "gpu017:29734"


@pytest.mark.parametrize("code,requeued", [(75, True), (0, False), (1, False)])
def test_sbatch_example_requeues_a_preempted_job(tmp_path, code, requeued):
    """The script under bash with stand-in srun / scontrol: exit 75 (saved on SIGUSR1 or
    SIGTERM) requeues the job; success or a failure does not; the exit code passes through."""
    text = SBATCH.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=USR1@" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexit {code}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.txt\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "81234", "SLURM_JOB_NUM_NODES": "4"}
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True)
    assert proc.returncode == code, proc.stderr
    called = (tmp_path / "scontrol.txt").read_text().split() if requeued else None
    assert called == (["requeue", "81234"] if requeued else None)
    assert (tmp_path / "scontrol.txt").exists() == requeued


@pytest.mark.optional_extra
def test_slurm_launcher_group_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    register_configs()
    overrides = [
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "parallel.nnodes=2",
        "parallel.dp=2",
    ]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["partition"]) == (2, 1, "gpu")
    assert type(instantiate(cfg.hydra.launcher)).__name__ == "SlurmLauncher"
