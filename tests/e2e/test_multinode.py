"""Two rlbatch-train launchers on this machine as node 0 and node 1 of one run: they meet at
the rendezvous, share the run directory outputs/<run_id>, and train exactly like one node with
the same two data-parallel ranks.

Node 0 gets its keys on the command line (parallel.node_rank, rdzv_endpoint, run_id); node 1
runs the same command without them, inside a SLURM-like environment (SLURM_JOB_ID, SLURM_NODEID,
SLURM_JOB_NODELIST), from which the launcher derives the same run id and rendezvous."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

pytestmark = pytest.mark.e2e

# One thread per worker in both layouts: the two-node run has one worker per "node", and CPU
# kernels may sum in another order with another thread count.
COMMON = ["+recipe=grpo_qwen", "trainer.max_steps=3", "parallel.dp=2", "trainer.num_threads=1"]


def _is_timing(key):
    return key.endswith(("_s", "_seconds", "seconds", "memory_gb")) or "per_s" in key


def _stable_metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not _is_timing(k)} for line in lines]


def _slurm_job_with_free_port() -> tuple[int, int]:
    """A job id whose rendezvous port (29500 + id % 1000) is free here."""
    for job_id in range(7000, 8000):
        port = 29500 + job_id % 1000
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job_id, port
    pytest.fail("no free port in 29500..30499")


def _start(bin_dir, env, cwd, overrides):
    return subprocess.Popen(
        [str(bin_dir / "rlbatch-train"), *COMMON, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
    )


def test_two_nodes_train_like_one(bin_dir, subprocess_env, tmp_path):
    job_id, port = _slurm_job_with_free_port()
    run_id = f"slurm-{job_id}"
    two_node = ["parallel.nnodes=2", "parallel.nproc_per_node=1"]
    node0 = _start(
        bin_dir,
        subprocess_env,
        tmp_path,
        [*two_node, "parallel.node_rank=0", f"parallel.rdzv_endpoint=127.0.0.1:{port}"]
        + [f"parallel.run_id={run_id}"],
    )
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "127.0.0.1"}
    node1 = _start(bin_dir, {**subprocess_env, **slurm}, tmp_path, two_node)
    try:
        outputs = [node.communicate(timeout=400)[0] for node in (node0, node1)]
    finally:
        for node in (node0, node1):
            node.kill()  # a node left waiting at the rendezvous; its workers die with it
    for node, out in zip((node0, node1), outputs, strict=True):
        assert node.returncode == 0, out[-3000:]

    single = tmp_path / "single"
    ref = _start(bin_dir, subprocess_env, tmp_path, [f"hydra.run.dir={single}"])
    out = ref.communicate(timeout=400)[0]
    assert ref.returncode == 0, out[-3000:]

    run_dir = tmp_path / "outputs" / run_id
    assert _stable_metrics(run_dir) == _stable_metrics(single)
    assert (run_dir / "resolved.yaml").is_file() and (run_dir / "resolved.node1.yaml").is_file()
    assert any((run_dir / "checkpoints").iterdir()), "no checkpoint in the shared run directory"
    # global rank 0 (progress, summary, metrics, checkpoint commits) is on node 0
    assert "run summary" in outputs[0] and "run summary" not in outputs[1]
