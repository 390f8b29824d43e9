"""Plan-driven execution on one process: packed == unpacked, lazy iterator, fillers."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import pytest
import torch
from engine_helpers import filler_mb, make_plan, packed_mb, padded_mb, tiny_cfg  # noqa: F401

from rlbatch.engine import model as engine_model
from rlbatch.engine import schedule

LENGTHS = [5, 11, 3, 8, 13, 1]


def _sequences(vocab: int = 264) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _logits(chunk, inputs):
    with torch.no_grad():
        return schedule.model_forward(chunk, inputs)


def test_packed_logits_equal_unpacked(tiny_cfg):
    chunk = engine_model.build_model(tiny_cfg, wrap_ddp=False)[0].eval()
    seqs = _sequences()
    for r in (1, 4):
        packed = schedule.make_inputs(seqs, packed_mb(range(6), LENGTHS, r), round_to=r)
        out_packed = _logits(chunk, packed)  # [1, T, V]
        for seg, ids in zip(packed.segments, seqs, strict=True):
            single = schedule.make_inputs([ids], padded_mb([0], [len(ids)], 1))
            ref = _logits(chunk, single)[0, : len(ids)]
            got = out_packed[0, seg.start : seg.start + seg.length]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert packed.packed_seq_params is not None  # THD on CPU too: no block mask
        block_masked = schedule.make_inputs(seqs, packed_mb(range(6), LENGTHS, r), round_to=r)
        lay = schedule.layout(packed_mb(range(6), LENGTHS, r), r, thd=False)
        block_masked.attention_mask, block_masked.packed_seq_params = lay.attention_mask, None
        torch.testing.assert_close(_logits(chunk, block_masked), out_packed, rtol=1e-5, atol=1e-5)
        padded = schedule.make_inputs(seqs, padded_mb(range(6), LENGTHS, r))
        out_padded = _logits(chunk, padded)
        for j, seg in enumerate(packed.segments):
            torch.testing.assert_close(
                out_padded[j, : seg.length],
                out_packed[0, seg.start : seg.start + seg.length],
                rtol=1e-5,
                atol=1e-5,
            )


def test_infer_round_and_ambiguity():
    assert schedule.infer_round(packed_mb([0, 1], [4, 8], 4)) in (1, 2, 4)
    with pytest.raises(ValueError, match="round_to"):
        schedule.segments(packed_mb([0, 1], [3, 5], 4))  # r=4 and r=6 give 12 slots


def _grads(chunks):
    return torch.cat([p.main_grad.reshape(-1).clone() for c in chunks for p in c.parameters()])


def test_run_pass_lazy_and_layouts_agree(tiny_cfg):
    chunks = engine_model.build_model(tiny_cfg)
    seqs = _sequences()
    plans = {
        "padded": [padded_mb([0, 1, 2], LENGTHS[:3]), padded_mb([3, 4, 5], LENGTHS[3:])],
        "packed": [packed_mb([0, 1, 2], LENGTHS[:3]), packed_mb([3, 4, 5], LENGTHS[3:])],
        "mixed+filler": [
            padded_mb([0, 1], LENGTHS[:2]),
            packed_mb([2, 3, 4, 5], LENGTHS[2:]),
            filler_mb(8),
        ],
    }
    results = {}
    for name, mbs in plans.items():
        plan = make_plan([mbs])
        calls = []

        def batch_fn(mb, calls=calls):
            calls.append(mb)
            return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=4)

        out = schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
        assert calls == list(mbs)  # once per micro-batch, in plan order
        total = sum(float(m["loss_sum"]) for m in out)
        results[name] = (total, _grads(chunks) * len(mbs))  # undo megatron's 1/M
    ref_loss, ref_grad = results["padded"]
    for name, (loss, grad) in results.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert ((grad - ref_grad).norm() / ref_grad.norm()).item() < 1e-5, name


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_activation_recompute_matches_none(tiny_cfg, recompute):
    from dataclasses import replace

    from rlbatch.config.schema import Recompute
    from rlbatch.engine import parallel

    seqs = _sequences()
    mbs = [padded_mb([0, 1, 2], LENGTHS[:3]), packed_mb([3, 4, 5], LENGTHS[3:])]
    plan = make_plan([mbs])
    grads = []
    for mode in (Recompute.none, Recompute(recompute)):
        cfg = replace(tiny_cfg, model=replace(tiny_cfg.model, recompute=mode))
        parallel.seed(cfg.trainer.seed)
        chunks = engine_model.build_model(cfg)

        def batch_fn(mb):
            return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=4)

        schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
        grads.append(_grads(chunks))
    assert ((grads[1] - grads[0]).norm() / grads[0].norm()).item() < 1e-6


def test_a_loss_term_without_gradient_is_not_attached_silently():
    """A pipeline chunk's extra loss term (an MoE load-balancing share) computed from tensors
    without autograd (full recompute's first forward) would train nothing: refused loudly."""
    output = torch.ones(3, requires_grad=True)
    term = torch.tensor(2.0, requires_grad=True)
    attached = schedule.attach_loss(output * 1.0, term * 1.0)
    attached.sum().backward()
    assert term.grad == pytest.approx(1.0)  # the term is back-propagated with gradient 1
    with pytest.raises(RuntimeError, match="no gradient"):
        schedule.attach_loss(output * 1.0, torch.tensor(2.0))
    with torch.no_grad():  # a forward-only pass attaches nothing
        assert schedule.attach_loss(output, torch.tensor(2.0)) is output
