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
routers' gradients would be the coefficient-0 ones (the control).

Routing replay under full recompute: the same step replaying a recorded routing (r3 as the
rollout's, r2 as the old-logprob pass's; recorded by transformers with the routers perturbed, so
40-50% of the tokens' expert sets differ from the trainer's own) gives at pp 1, pp 2 and pp 2 x
vpp 2 under full recompute the gradients of pp 1 without it: the recomputed forward of each
micro-batch replays that micro-batch's routing, although later micro-batches' forwards set
their own before its backward (with the re-arming removed, the pipelined cases fail).

Tensor parallelism (tp 2, with the sequence parallelism an MoE model trains with there): each
rank's routers see half of every micro-batch's positions, and each sample's expert counts and
probability sums are summed over the two ranks before the loss, so the step (loss,
moe/aux_loss, every gradient, the routers' included) is the one of a single rank, without and
with full recompute; with each rank's own half-statistics instead, the loss is 54-68% off and
the routers' gradients 53-66%."""

from __future__ import annotations

import sys
from pathlib import Path

import megatron.core  # noqa: F401
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from dist_launch import run_torchrun  # noqa: E402
from moe_balance_case import (  # noqa: E402
    CASES,
    REPLAY_CASES,
    make_cfg,
    perturbed_routing,
    record_old_routing,
    run_step,
)

from hf_reference import save_tiny_qwen3_moe  # noqa: E402

pytestmark = pytest.mark.dist
LAYOUTS = ["pp2", "pp2_vpp2", "pp2_full", "pp2_vpp2_full"]
SEQUENCE_PARALLEL = ["tp2", "tp2_full"]
REPLAYED = ["pp2_full", "pp2_vpp2_full"]
ROUTERS = [f"model.layers.{i}.mlp.gate.weight" for i in (0, 2, 3)]
ALL_CASES = [*CASES, *REPLAY_CASES]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_balance") / "hf"
    save_tiny_qwen3_moe(path)
    return path


@pytest.fixture(scope="module")
def routing(hf_dir):
    return perturbed_routing(str(hf_dir))


@pytest.fixture(scope="module")
def references(hf_dir, routing):
    """pp = 1 in this process: each case, and the token case without the coefficient."""
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        parallel.initialize(make_cfg(str(hf_dir), "token"))
    out = {case: run_step(make_cfg(str(hf_dir), case), case, routing) for case in ALL_CASES}
    out["no_coeff"] = run_step(make_cfg(str(hf_dir), "token", coeff=0.0), "token")
    for case in ALL_CASES:  # the same step under full activation recompute
        cfg = make_cfg(str(hf_dir), case, recompute="full")
        out[f"{case}_full"] = run_step(cfg, case, routing)
    out["record"] = record_old_routing(make_cfg(str(hf_dir), "token"))
    return out


@pytest.fixture(scope="module")
def pipelined(hf_dir, routing, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_balance_runs")
    torch.save(routing, out / "routing.pt")
    run_torchrun("moe_balance_worker.py", 2, [str(hf_dir), str(out)], timeout=600)
    runs = [(layout, case) for layout in LAYOUTS + SEQUENCE_PARALLEL for case in CASES]
    runs += [(layout, case) for layout in REPLAYED for case in REPLAY_CASES]
    loaded = {run: torch.load(out / f"{run[0]}_{run[1]}.pt", weights_only=False) for run in runs}
    for rank in (0, 1):
        loaded[("tp2_record", rank)] = torch.load(
            out / f"tp2_record_rank{rank}.pt", weights_only=False
        )
    return loaded


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


def test_the_replayed_routing_moves_the_step(references):
    """The control of the replay cases: the routers would route 30-60% of the tokens to
    another expert set than the one replayed, and the replay moves every sparse layer's expert
    gradients by more than 5e-2, so a recomputed forward that routed otherwise fails below."""
    known, moved = references["r3"]["mismatch"]
    assert (known > 100).all() and (0.3 < moved / known).all() and (moved / known < 0.6).all()
    for case, (free, _) in REPLAY_CASES.items():
        got, want = references[case]["grads"], references[free]["grads"]
        for layer in (0, 2, 3):
            experts = [k for k in got if k.startswith(f"model.layers.{layer}.mlp.experts.")]
            flat = [torch.cat([g[k].reshape(-1) for k in experts]) for g in (got, want)]
            assert _rel(*flat) > 5e-2, (case, layer)


@pytest.mark.parametrize("case", ALL_CASES)
def test_full_recompute_trains_the_routers_as_without_it(references, case):
    """One process: the same loss, metric and gradients, the routers' included (bit-equal
    here: the recomputed forward is the first one, and its routers' gradients get exactly what
    the loss back-propagated into the first forward's logits), replayed routing included."""
    _assert_same_step(references[f"{case}_full"], references[case], rel=1e-6)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipelined_step_equals_one_stage(pipelined, references, layout, case):
    _assert_same_step(pipelined[(layout, case)], references[case], rel=1e-5)


@pytest.mark.parametrize("case", list(REPLAY_CASES))
@pytest.mark.parametrize("layout", REPLAYED)
def test_pipelined_replay_under_full_recompute_equals_one_stage(
    pipelined, references, layout, case
):
    """Pipelined (1F1B and interleaved): each chunk's recomputed forward replays its own
    micro-batch's routing (set again when its backward starts), as pp = 1 without recompute."""
    _assert_same_step(pipelined[(layout, case)], references[case], rel=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", SEQUENCE_PARALLEL)
def test_sequence_parallel_step_equals_one_rank(pipelined, references, layout, case):
    _assert_same_step(pipelined[(layout, case)], references[case], rel=1e-5)


def test_the_old_pass_records_whole_samples_at_tp2(pipelined, references):
    """r2's record at tp 2: each rank's routers route half of every micro-batch's tokens, and
    the old-logprob pass gathers the halves, so both ranks hold every token's experts at every
    sparse layer (what the training forward then replays, each rank its own half), the ones
    one process records."""
    want = references["record"]
    for rank in (0, 1):
        got = pipelined[("tp2_record", rank)]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.shape[1:] == (3, 2) and (g >= 0).all()
            assert (np.sort(g, -1) == np.sort(w, -1)).all()
