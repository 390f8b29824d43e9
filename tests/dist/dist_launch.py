"""Launch a tests/dist/scripts/ script under torchrun (gloo, CPU) from a test.

A plain module, not a conftest.py: a second ``conftest`` module would shadow tests/conftest.py
for the tests that ``from conftest import REPO``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def torchrun_env() -> dict[str, str]:
    """One thread per worker; scripts/ importable (shared case modules)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    env["PYTHONPATH"] = str(SCRIPTS) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return env


def run_torchrun(script: str, nproc: int, args: list[str], timeout: int = 300) -> None:
    """Run tests/dist/scripts/``script`` on ``nproc`` local workers (torchrun --standalone);
    fail the test with the tail of stderr when a worker fails."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), str(SCRIPTS / script), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {script} {args} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
