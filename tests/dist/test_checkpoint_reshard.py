"""A checkpoint saved at tp2 x pp2 (distributed optimizer, megatron distributed checkpointing)
resumes at tp1 x pp1 x dp2 and at a single rank: the step after the resume gives the same
losses, grad norm and weights as the uninterrupted tp2 x pp2 run (fp32 reordering tolerance).
The Adam moments are carried over: a second step would differ visibly without them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dist_launch import run_torchrun  # noqa: E402
from engine_case import make_cfg  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Initial HF weights (single process), then the tp2 x pp2 run: step 1, save, step 2."""
    from rlbatch.engine import hf, parallel
    from rlbatch.engine import model as engine_model

    root = tmp_path_factory.mktemp("reshard")
    cfg = make_cfg()
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(5)
    hf.export_hf(engine_model.build_model(cfg, wrap_ddp=False), cfg.model, root / "hf")
    (root / "save").mkdir()
    run_torchrun(
        "reshard_worker.py", 4, ["save", str(root / "hf"), str(root / "ckpt"), str(root / "save")]
    )
    return root, torch.load(root / "save" / "rank0.pt", weights_only=False)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(("mode", "nproc"), [("dp2", 2), ("dp1", 1)])
def test_resume_at_another_layout_continues(saved, mode, nproc):
    root, reference = saved
    out = root / mode
    out.mkdir()
    run_torchrun("reshard_worker.py", nproc, [mode, str(root / "hf"), str(root / "ckpt"), str(out)])
    got = torch.load(out / "rank0.pt", weights_only=False)
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    flat = [
        torch.cat([d[k].double().reshape(-1) for k in sorted(d)])
        for d in (got["params"], reference["params"])
    ]
    assert _rel(*flat) <= 1e-5
