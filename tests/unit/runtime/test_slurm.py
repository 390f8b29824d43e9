"""The SLURM pieces compose: the sbatch example's rlbatch-train command under a SLURM job's
environment, and the hydra/launcher=slurm group (hydra-submitit-launcher, the `slurm` extra)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from conftest import REPO
from rlbatch.cli.common import compose
from rlbatch.cli.serve import server_config
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


SERVERS_SBATCH = REPO / "examples" / "slurm" / "grpo_qwen2_5_7b_servers.sbatch"
FAKE_SRUN = """#!/bin/bash
# srun's options dropped; the command run once, here, with the step's SLURM_NODEID
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
RECORD = """#!/bin/bash
printf '%s\\n' "$@" > "{out}/$(basename "$0").$$"
"""


def _stand_ins(tmp_path, bin_dir):
    """srun running its command locally, scontrol naming 6 hosts, curl answering /health,
    rlbatch-serve and rlbatch-train recording their arguments (one file per call)."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu%03d\\n" 17 18 19 20 21 22\n'
        f'[ "$1" = requeue ] && echo "$@" > {tmp_path}/scontrol.txt\nexit 0\n'
    )
    (bin_dir / "curl").write_text(f'#!/bin/bash\necho "${{@: -1}}" >> {tmp_path}/health.txt\n')
    for tool in ("rlbatch-serve", "rlbatch-train"):
        (bin_dir / tool).write_text(RECORD.format(out=tmp_path))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


def _recorded(tmp_path, tool):
    return [p.read_text().splitlines() for p in sorted(tmp_path.glob(f"{tool}.*"))]


def test_servers_sbatch_example_starts_a_server_per_gpu_and_trains_on_all_of_them(
    tmp_path, monkeypatch
):
    """The trainer-plus-rollout-nodes example run under bash with stand-ins for SLURM's tools:
    16 servers (2 rollout nodes x 8 GPUs, a port per GPU) are started, each URL is waited for
    on /health before training starts, and rlbatch-train gets exactly those URLs. Both commands
    then compose with Hydra into one model: the servers' config is the trainers' minus the
    server keys, and the trainers' passes rlbatch's validation (4 trainer nodes)."""
    assert subprocess.run(["bash", "-n", str(SERVERS_SBATCH)]).returncode == 0
    text = SERVERS_SBATCH.read_text().replace("/shared/rlbatch-weights", str(tmp_path / "w"))
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    _stand_ins(tmp_path, tmp_path / "bin")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "81234",
           "SLURM_JOB_NUM_NODES": "6", "SLURM_JOB_NODELIST": "gpu[017-022]"}  # fmt: skip
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "scontrol.txt").exists()  # no requeue after a success
    serves = _recorded(tmp_path, "rlbatch-serve")
    (train,) = _recorded(tmp_path, "rlbatch-train")
    assert len(serves) == 8  # the rollout nodes' step, run once here (one node's 8 GPUs)
    ports = sorted(int(a.split("=")[1]) for s in serves for a in s if "servers.port=" in a)
    assert ports == list(range(8000, 8008))
    urls = next(a for a in train if a.startswith("rollout.servers.urls=")).split("=", 1)[1]
    expected = [f"http://gpu{n:03d}:{8000 + g}" for n in (21, 22) for g in range(8)]
    assert urls == "[" + ",".join(expected) + "]"
    health = (tmp_path / "health.txt").read_text().split()
    assert health == [f"{u}/health" for u in expected]

    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')

    def site(args):  # the site paths: the recipe's preset has the same architecture
        return [
            f"data.path={data}" if a.startswith("data.path=") else a
            for a in args
            if not a.startswith("model.hf_path=")
        ]

    job = {**NODE_2_OF_4, "SLURM_JOB_NUM_NODES": "6", "SLURM_JOB_NODELIST": "gpu[017-022]"}
    for var, value in {**job, "SLURM_NODEID": "4", "SLURM_STEP_NUM_NODES": "2"}.items():
        monkeypatch.setenv(var, value)  # a rollout node's step
    served = server_config(site(serves[0]))
    for var, value in {**job, "SLURM_STEP_NUM_NODES": "4"}.items():
        monkeypatch.setenv(var, value)  # a trainer node's step
    trained = compose(site(train), "test")
    assert served.model == trained.model
    assert trained.parallel.nnodes == 4 and trained.rollout.servers.urls == expected
    assert served.rollout.servers.devices == ["0"] and served.rollout.servers.host == "0.0.0.0"
