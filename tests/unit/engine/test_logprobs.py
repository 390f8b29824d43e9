"""Chunked logprob pass == a plain full forward per sample (fp32), in original sample order."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import torch
from engine_helpers import make_plan, packed_mb, padded_mb, tiny_cfg  # noqa: F401

from rlbatch.config.schema import BatchingMode, BatchingPassConfig
from rlbatch.engine import logprobs, schedule
from rlbatch.engine import model as engine_model

LENGTHS = [9, 2, 17, 5, 12, 7, 3]


def _reference(chunk, seq):
    n = len(seq)
    tokens = torch.tensor([seq])
    with torch.no_grad():
        logits = logprobs.forward_logits(
            chunk, tokens, torch.arange(n)[None], schedule.causal_mask(n)[None, None]
        )[0].double()
    logp = torch.log_softmax(logits, -1)
    token_lp = logp[:-1].gather(1, tokens[0, 1:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)[:-1]
    return token_lp, ent


def test_logprobs_match_full_forward_in_order(tiny_cfg):
    chunks = engine_model.build_model(tiny_cfg, wrap_ddp=False)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 264, (n,), generator=g).tolist() for n in LENGTHS]
    plan = make_plan(
        [[packed_mb([4, 1, 6], [12, 2, 3]), padded_mb([2, 0], [17, 9]), padded_mb([5, 3], [7, 5])]]
    )
    got, ents = logprobs.compute_logprobs(chunks, seqs, plan, round_to=4, entropy=True)
    for i, seq in enumerate(seqs):
        ref_lp, ref_ent = _reference(chunks[0], seq)
        assert got[i].shape == (len(seq) - 1,)
        torch.testing.assert_close(got[i].double(), ref_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(ents[i].double(), ref_ent, rtol=0, atol=2e-5)


def test_logprobs_with_the_planner(tiny_cfg):
    from rlbatch.batching import plan_pass

    chunks = engine_model.build_model(tiny_cfg, wrap_ddp=False)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 264, (n,), generator=g).tolist() for n in LENGTHS * 3]
    base = logprobs.compute_logprobs(chunks, seqs, make_plan([[padded_mb(range(21), LENGTHS * 3)]]))
    for mode in (BatchingMode.dynamic, BatchingMode.packed, BatchingMode.fixed):
        cfg = BatchingPassConfig(
            mode=mode, max_tokens=40, micro_batch_size=3, sequence_length_round=4
        )
        plan = plan_pass([len(s) for s in seqs], cfg, dp=1)
        assert plan.num_micro_batches > 1
        got = logprobs.compute_logprobs(chunks, seqs, plan, round_to=4)
        for a, b in zip(got, base, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
