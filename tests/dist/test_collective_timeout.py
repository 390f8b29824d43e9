"""A timed-out collective is told from a user error by its type and where it was raised, not by
its words: real gloo timeouts (torch's all_reduce, rlbatch's all_gather_object) are collective
timeouts; a RuntimeError from user code and an environment's EnvCallError that mention a
timeout are not (the run shows them as they are, not as a hang of another rank)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_launch import SCRIPTS, torchrun_env

pytestmark = pytest.mark.dist


def test_only_backend_timeouts_are_collective_timeouts():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPTS / "collective_timeout.py")]  # fmt: skip
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT ") :]) == {
        "all_reduce": True,
        "all_gather_object": True,
        "user_runtime_error": False,
        "environment_timeout": False,
    }


def test_ranks_meet_past_the_collective_timeout():
    """rlbatch.distributed.meet lets a rank wait for a peer longer than the collectives' timeout
    (a dp rank done with its harness round waits for a peer whose episodes run to their
    deadlines), and names the rank that never came once its own bound runs out."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPTS / "meet_peers.py")]  # fmt: skip
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["sum"] == 2.0 and out["waited_s"] >= 5.5
    assert out["kept"] == [False, False]  # a long run does not fill the store
    assert "waited 2 s at round-3 for ranks [1]" in out["alone"], out["alone"]
