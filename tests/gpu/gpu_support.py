"""Helpers of tests/gpu (imported by its modules and conftest).

``RLBATCH_GPU_DRYRUN=1`` runs the tests that support it on this machine's CPU at a tiny model
shape, to develop the checks before a GPU is at hand; it proves the harness, not the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRYRUN = os.environ.get("RLBATCH_GPU_DRYRUN") == "1"


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_cli(
    args: list[str], *, cwd: Path, cpu: bool = False, timeout: int = 900
) -> subprocess.CompletedProcess:
    """An rlbatch console script (``args[0]``) of this interpreter's environment; ``cpu`` hides
    the GPU (CUDA_VISIBLE_DEVICES=""), which is how the CPU reference runs beside it."""
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    script = Path(sys.executable).parent / args[0]
    proc = subprocess.run(
        [str(script), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc
