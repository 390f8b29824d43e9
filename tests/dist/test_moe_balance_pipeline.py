"""An MoE policy's load-balancing loss (model.moe_aux_loss_coeff) with pipeline stages is the
one of pp = 1: one GRPO step on gloo at pp 2 (stage 0 holds MoE layer 0 and the dense layer 1,
stage 1 MoE layers 2 and 3) and at pp 2 x vpp 2 (a chunk per layer: a chunk without an MoE
layer, and an earlier stage's chunk on the loss's rank), against the same step in one process:
the step's loss, moe/aux_loss and gradient norm, and every gradient, the routers' included
(rel 1e-5), under token-mean with eager normalization and seq-mean-token-mean with deferred
normalization and megatron's per-token loss. The coefficient moves the first stage's router
gradient well beyond that tolerance, so a stage whose share were lost would fail.

Full activation recompute (model.recompute=full: each layer's first forward runs without
autograd, the routers' included) gives the same step at pp 1, pp 2 and pp 2 x vpp 2: the
load-balancing gradient reaches every router through its recomputed forward. Without it the
routers' gradients would be the coefficient-0 ones (the control)."""

from __future__ import annotations

import sys
from pathlib import Path

import megatron.core  # noqa: F401
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dist_launch import run_torchrun  # noqa: E402
from moe_balance_case import CASES, make_cfg, run_step  # noqa: E402

from hf_reference import save_tiny_qwen3_moe  # noqa: E402

pytestmark = pytest.mark.dist
LAYOUTS = ["pp2", "pp2_vpp2", "pp2_full", "pp2_vpp2_full"]
ROUTERS = [f"model.layers.{i}.mlp.gate.weight" for i in (0, 2, 3)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_balance") / "hf"
    save_tiny_qwen3_moe(path)
    return path


@pytest.fixture(scope="module")
def references(hf_dir):
    """pp = 1 in this process: each case, and the token case without the coefficient."""
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        parallel.initialize(make_cfg(str(hf_dir), "token"))
    out = {case: run_step(make_cfg(str(hf_dir), case), case) for case in CASES}
    out["no_coeff"] = run_step(make_cfg(str(hf_dir), "token", coeff=0.0), "token")
    for case in CASES:  # the same step under full activation recompute
        out[f"{case}_full"] = run_step(make_cfg(str(hf_dir), case, recompute="full"), case)
    return out


@pytest.fixture(scope="module")
def pipelined(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_balance_runs")
    run_torchrun("moe_balance_worker.py", 2, [str(hf_dir), str(out)], timeout=600)
    return {
        (layout, case): torch.load(out / f"{layout}_{case}.pt", weights_only=False)
        for layout in LAYOUTS
        for case in CASES
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _assert_same_step(got: dict, want: dict, rel: float) -> None:
    assert got["metrics"]["num_micro_batches"] >= 4  # the step is cut into several
    for key in ("loss", "moe/aux_loss", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=rel), key
    assert set(got["grads"]) == set(want["grads"])
    for name in ROUTERS:
        assert _rel(got["grads"][name], want["grads"][name]) <= rel, name
    flat = [
        torch.cat([g[k].double().reshape(-1) for k in sorted(g)])
        for g in (got["grads"], want["grads"])
    ]
    assert _rel(*flat) <= rel


def test_the_coefficient_moves_every_router_gradient(references):
    """The control: without the coefficient the routers' gradients differ beyond the
    tolerance below (so equality at pp 2 needs every stage's share), and the metric is the
    same (it is logged either way)."""
    with_, without = references["token"], references["no_coeff"]
    for name in ROUTERS:
        assert _rel(without["grads"][name], with_["grads"][name]) > 1e-2, name
    aux = with_["metrics"]["moe/aux_loss"]
    assert 1.0 <= aux <= 2.0  # 1 = balanced, E / k = 2 at worst
    assert without["metrics"]["moe/aux_loss"] == pytest.approx(aux, rel=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_full_recompute_trains_the_routers_as_without_it(references, case):
    """One process: the same loss, metric and gradients, the routers' included (bit-equal
    here: the recomputed forward is the first one, and its routers' gradients get exactly what
    the loss back-propagated into the first forward's logits)."""
    _assert_same_step(references[f"{case}_full"], references[case], rel=1e-6)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipelined_step_equals_one_stage(pipelined, references, layout, case):
    _assert_same_step(pipelined[(layout, case)], references[case], rel=1e-5)
