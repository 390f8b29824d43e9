"""The GPU path, run on a CUDA machine with one command:

    pip install -e '.[dev,gpu]' && python -m pytest tests/gpu -m gpu -v

Skipped without CUDA. What it checks:
- Transformer Engine layer spec, fp32 and bf16 parameters, packed micro-batches as THD through
  TE attention: losses, gradients, an optimizer step and logprobs against the CPU fp32 path
  on the same weights (fp32: rel 1e-3, TF32 matmuls; bf16: rel 3e-2);
- NCCL with the distributed optimizer and sequence parallelism: the engine's tp2+SP and
  dp2+distributed-optimizer cases equal the single-GPU run (>= 2 GPUs);
- distributed-optimizer checkpoints resharded from tp2 x pp2 to dp2 and dp1 (>= 4 GPUs);
- the grpo_qwen2_5_7b shape twin at bf16 with resume (>= 8 GPUs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HERE = Path(__file__).parent
REPO = HERE.parents[1]


def _gpus(n: int):
    return pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < n, reason=f"needs {n} GPUs"
    )


def _run(args: list[str], *, cpu: bool = False, timeout: int = 900) -> None:
    env = dict(os.environ)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    _run([str(HERE / "parity_case.py"), str(root / "hf"), str(root / "cpu.pt"), "fp32", "--export"],
         cpu=True)  # fmt: skip
    return root, torch.load(root / "cpu.pt", weights_only=False)


def _rel(a, b) -> float:
    a, b = a.double().cpu().reshape(-1), b.double().cpu().reshape(-1)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(("dtype", "tol"), [("fp32", 1e-3), ("bf16", 3e-2)])
def test_te_spec_matches_cpu_fp32(dtype, tol, request):
    from rlbatch.engine.model import have_transformer_engine

    if not have_transformer_engine():
        pytest.skip(
            "Transformer Engine is not installed (pip install -e '.[gpu]'); the local layer "
            "spec's GPU parity is test_qwen_shape.py's"
        )
    root, ref = request.getfixturevalue("cpu_reference")
    out = root / f"gpu_{dtype}.pt"
    _run([str(HERE / "parity_case.py"), str(root / "hf"), str(out), dtype])
    got = torch.load(out, weights_only=False)
    assert got["te"], "Transformer Engine is not importable: pip install -e '.[gpu]'"
    assert _rel(torch.tensor(got["losses"]), torch.tensor(ref["losses"])) <= tol
    for key in ("grads", "params_after_step"):
        keys = sorted(ref[key])
        flat = [
            torch.cat([d[k].double().cpu().reshape(-1) for k in keys]) for d in (got[key], ref[key])
        ]
        assert _rel(*flat) <= tol, key
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        assert _rel(a, b) <= tol


@_gpus(2)
def test_nccl_engine_layouts():
    """tests/dist's engine cases (tp2 + sequence parallel, dp2 + distributed optimizer, ...)
    on NCCL against the single-device run."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "tests/dist/test_engine_parallel.py"],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]


@_gpus(4)
def test_distributed_optimizer_checkpoint_reshards_on_nccl():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "tests/dist/test_checkpoint_reshard.py"],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]


@_gpus(8)
def test_shape_twins_on_gpu():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-s", "tests/e2e/test_shape_twins.py"],
        cwd=REPO, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
