"""The chunked output projection (model.logits_chunk_tokens) against float64 math and against the
unchunked path: log-probs, entropies, the GRPO loss of every loss_agg_mode, and the gradients to
the hidden states and the output weight; the train pass through megatron's schedule (padded,
packed and filler micro-batches, tied and untied embeddings), the logprob pass scoring response
positions only, and generation's last-position prefill."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import filler_mb, make_plan, packed_mb, padded_mb, tiny_cfg  # noqa: F401

from rlbatch.config.schema import LossAggMode
from rlbatch.engine import hf, lm_head, logprobs, schedule
from rlbatch.engine import model as engine_model
from rlbatch.grpo.loss import GRPOBatch, LossSettings, grpo_loss

R, S, H, V = 3, 11, 16, 40


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _random_head(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (R, S), generator=g)
    mask = torch.rand(R, S, generator=g) > 0.3
    mask[:, :3] = False  # "prompt" positions: never scored
    return hidden, weight, labels, mask


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_logprobs_match_float64_softmax(tiny_cfg, chunk):
    hidden, weight, labels, mask = _random_head()
    h = hidden[mask].requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    y = labels[mask]
    logps, ents = lm_head.chunked_logprobs(h, w, y, chunk=chunk, temperature=0.7, entropy=True)
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    logp_all = torch.log_softmax(h64 @ w64.t() / 0.7, -1)
    ref = logp_all.gather(-1, y[:, None])[:, 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    assert logps.dtype == torch.float32 and ents is not None and not ents.requires_grad
    assert _rel(logps, ref) < 1e-6 and _rel(ents, ref_ent) < 1e-6
    g = torch.randn(len(y), generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((logps * g).sum(), [h, w])
    ref_grads = torch.autograd.grad((ref * g.double()).sum(), [h64, w64])
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-6


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_entropy_gradient_matches_float64(tiny_cfg, chunk):
    """The entropy bonus (grpo.entropy_coef) through the chunked projection: the gradient of
    a * logp + b * entropy to the hidden states and the weight equals float64 autograd."""
    hidden, weight, labels, mask = _random_head(seed=5)
    h = hidden[mask].requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    y = labels[mask]
    logps, ents = lm_head.chunked_logprobs(
        h, w, y, chunk=chunk, temperature=0.7, entropy=True, entropy_grad=True
    )
    assert ents is not None and ents.requires_grad
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    logp_all = torch.log_softmax(h64 @ w64.t() / 0.7, -1)
    ref = logp_all.gather(-1, y[:, None])[:, 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(len(y), generator=gen), torch.randn(len(y), generator=gen)
    grads = torch.autograd.grad((logps * a + ents * b).sum(), [h, w])
    ref_grads = torch.autograd.grad((ref * a.double() + ref_ent * b.double()).sum(), [h64, w64])
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 1e-6


@pytest.mark.parametrize("entropy_coef", [0.0, 0.03])
@pytest.mark.parametrize("mode", list(LossAggMode))
def test_grpo_loss_chunked_equals_unchunked(tiny_cfg, mode, entropy_coef):
    """Every loss_agg_mode, with temperature, the KL term, stale old logps and the entropy
    bonus: numerator, count, metric sums and the gradients to hidden states and weight agree."""
    hidden, weight, labels, mask = _random_head(2)
    g = torch.Generator().manual_seed(3)
    seq_index = torch.arange(R)[:, None].expand(R, S) * mask
    batch = GRPOBatch(
        labels=labels,
        loss_mask=mask,
        seq_index=seq_index.contiguous(),
        old_logps=-3.7 + 0.1 * torch.randn(R, S, generator=g),
        advantages=torch.randn(R, generator=g),
        behaviour_logps=-3.7 + 0.1 * torch.randn(R, S, generator=g),
        ref_logps=-3.7 + 0.1 * torch.randn(R, S, generator=g),
    )
    settings = LossSettings(
        loss_agg_mode=mode,
        beta=0.05,
        temperature=0.8,
        max_response_len=S,
        entropy_coef=entropy_coef,
    )
    results = []
    for chunk in (0, 3):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        if chunk == 0:
            output = lm_head.LMOutput(logits=h @ w.t())
        else:
            output = lm_head.LMOutput.from_hidden(h, w, chunk)
        terms = grpo_loss(output, batch, settings)
        grads = torch.autograd.grad(terms.numerator, [h, w])
        results.append((terms, grads))
    (full, full_grads), (chunked, chunked_grads) = results
    assert _rel(chunked.numerator.detach(), full.numerator.detach()) < 1e-6
    assert torch.equal(chunked.count, full.count)
    torch.testing.assert_close(chunked.stats, full.stats, rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked_grads, full_grads, strict=True):
        assert _rel(got, want) < 1e-6
    assert chunked_grads[0][~mask].abs().max() == 0  # unscored positions get no gradient


LENGTHS = [5, 13, 9, 2, 17, 7, 11, 3]
MICRO_BATCHES = [
    padded_mb([0, 1, 2], [5, 13, 9]),
    packed_mb([3, 4, 5], [2, 17, 7]),
    filler_mb(8),
    padded_mb([6, 7], [11, 3]),
]


@pytest.mark.parametrize("tied", [True, False])
def test_train_pass_chunked_equals_unchunked(tiny_cfg, tied):
    """Megatron's schedule with DDP: the loss of every micro-batch and every gradient (the
    output weight / tied embedding included) equal with chunking on and off."""
    cfg = tiny_cfg
    cfg.model = replace(cfg.model, tie_word_embeddings=tied)
    chunks = engine_model.build_model(cfg)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    plan = make_plan([MICRO_BATCHES])

    def batch_fn(mb):
        return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=4)

    runs = {}
    for chunk in (0, 4):
        lm_head.set_logits_chunk_tokens(chunks, chunk)
        out = schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
        runs[chunk] = ([m["loss_sum"] for m in out], hf.gather_full(chunks, cfg.model, grads=True))
    (loss0, grads0), (loss4, grads4) = runs[0], runs[4]
    assert _rel(torch.stack(loss4), torch.stack(loss0)) < 1e-6
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert grads0[head].abs().sum() > 0
    for name, want in grads0.items():
        assert _rel(grads4[name], want) < 1e-6, name


def test_logprob_pass_scores_response_positions(tiny_cfg):
    """score_from skips the prompt: the values equal the tail of the full pass, chunked or not."""
    chunks = engine_model.build_model(tiny_cfg, wrap_ddp=False)
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 264, (n,), generator=g).tolist() for n in LENGTHS]
    plan = make_plan([[mb for mb in MICRO_BATCHES if not mb.filler]])
    starts = [min(4, n - 1) for n in LENGTHS]
    lm_head.set_logits_chunk_tokens(chunks, 0)
    full, full_ent = logprobs.compute_logprobs(chunks, seqs, plan, round_to=4, entropy=True)
    lm_head.set_logits_chunk_tokens(chunks, 3)
    got, ents = logprobs.compute_logprobs(
        chunks, seqs, plan, round_to=4, entropy=True, score_from=starts
    )
    for i, n in enumerate(LENGTHS):
        assert got[i].shape == (n - 1 - starts[i],)
        torch.testing.assert_close(got[i], full[i][starts[i] :], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ents[i], full_ent[i][starts[i] :], rtol=1e-6, atol=1e-6)
    # score_mask (a multi-turn loss mask): masked positions are not projected and hold 0.0 (a
    # projected log-prob is < 0), the others equal the full pass
    masks = [[(i + k) % 3 != 0 for k in range(n - 1 - starts[i])] for i, n in enumerate(LENGTHS)]
    got, ents = logprobs.compute_logprobs(
        chunks, seqs, plan, round_to=4, entropy=True, score_from=starts, score_mask=masks
    )
    for i, n in enumerate(LENGTHS):
        keep = torch.tensor(masks[i], dtype=torch.bool)
        assert got[i].shape == (n - 1 - starts[i],)
        assert got[i][~keep].abs().sum() == 0 and ents[i][~keep].abs().sum() == 0
        want = full[i][starts[i] :][keep]
        torch.testing.assert_close(got[i][keep], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            ents[i][keep], full_ent[i][starts[i] :][keep], rtol=1e-6, atol=1e-6
        )


def test_last_position_output_equals_full_logits(tiny_cfg):
    """Generation's prefill projects one position: the same logits as the full projection's
    last row."""
    chunks = engine_model.build_model(tiny_cfg, wrap_ddp=False)
    tokens = torch.randint(0, 264, (2, 9), generator=torch.Generator().manual_seed(7))
    args = (tokens, torch.arange(9)[None].expand(2, 9), schedule.causal_mask(9)[None, None])
    with torch.no_grad():
        full = chunks[0](*args)  # [2, 9, V]
        with lm_head.output_layer_mode(chunks, "last"):
            last = chunks[0](*args)
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-6, atol=1e-6)
