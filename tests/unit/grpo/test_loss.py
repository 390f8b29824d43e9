"""GRPO loss vs an independent float64 reference (plain Python math, one token at a time)."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from rlbatch.config.schema import LossAggMode, RunConfig
from rlbatch.engine.logprobs import token_entropy, token_logprobs
from rlbatch.grpo.loss import (
    STAT_INDEX,
    GRPOBatch,
    LossSettings,
    divisor_count,
    grpo_loss,
    loss_from_logps,
    summarize_stats,
)

ALL_MODES = list(LossAggMode)


def _random_sequences(rng: random.Random, num_seqs: int, stale: bool, with_ref: bool):
    """Per sample: response length, advantage, and per-token (logp, old, behaviour, ref)."""
    seqs = []
    for _ in range(num_seqs):
        n = rng.randint(1, 7)
        toks = []
        for _ in range(n):
            old = -rng.uniform(0.1, 3.0)
            logp = old + rng.uniform(-0.7, 0.7)  # ratios in [0.5, 2]: both clip sides hit
            beh = old + rng.uniform(-1.0, 1.0) if stale else None
            ref = old + rng.uniform(-0.3, 0.3) if with_ref else None
            toks.append((logp, old, beh, ref))
        seqs.append({"adv": rng.uniform(-2, 2), "toks": toks})
    return seqs


def _padded_batch(seqs, prompt_len: int = 3):
    """Padded layout: one row per sample; response token k is predicted at position
    prompt_len - 1 + k. Returns the batch and the flat current logps in mask order."""
    rows, width = len(seqs), prompt_len + max(len(s["toks"]) for s in seqs) + 2
    f64 = torch.float64
    mask = torch.zeros(rows, width, dtype=torch.bool)
    old, beh, ref, dense = (torch.zeros(rows, width, dtype=f64) for _ in range(4))
    cur = torch.zeros(rows, width, dtype=f64)
    for i, s in enumerate(seqs):
        for k, (lp, o, b, r) in enumerate(s["toks"]):
            p = prompt_len - 1 + k
            mask[i, p] = True
            cur[i, p], old[i, p] = lp, o
            beh[i, p] = b if b is not None else 0.0
            ref[i, p] = r if r is not None else 0.0
            dense[i, p] = s["dense"][k] if "dense" in s else 0.0
    seq_index = torch.arange(rows).unsqueeze(1).expand(rows, width).clone()
    batch = GRPOBatch(
        labels=torch.zeros(rows, width, dtype=torch.long),
        loss_mask=mask,
        seq_index=seq_index,
        old_logps=old,
        advantages=torch.tensor([s["adv"] for s in seqs], dtype=f64),
        behaviour_logps=beh if seqs[0]["toks"][0][2] is not None else None,
        ref_logps=ref if seqs[0]["toks"][0][3] is not None else None,
        token_advantages=dense if "dense" in seqs[0] else None,
    )
    return batch, cur[mask].clone().requires_grad_(True)


def _packed_batch(seqs, round_to: int = 4, prompt_len: int = 2):
    """Packed layout: one row, samples side by side at rounded offsets."""
    lens = [prompt_len + len(s["toks"]) for s in seqs]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + -(-n // round_to) * round_to)
    width = offsets[-1]
    f64 = torch.float64
    mask = torch.zeros(1, width, dtype=torch.bool)
    seq_index = torch.zeros(1, width, dtype=torch.long)
    old, beh, ref, cur, dense = (torch.zeros(1, width, dtype=f64) for _ in range(5))
    for i, s in enumerate(seqs):
        for k, (lp, o, b, r) in enumerate(s["toks"]):
            p = offsets[i] + prompt_len - 1 + k
            mask[0, p], seq_index[0, p] = True, i
            cur[0, p], old[0, p] = lp, o
            beh[0, p] = b if b is not None else 0.0
            ref[0, p] = r if r is not None else 0.0
            dense[0, p] = s["dense"][k] if "dense" in s else 0.0
    batch = GRPOBatch(
        labels=torch.zeros(1, width, dtype=torch.long),
        loss_mask=mask,
        seq_index=seq_index,
        old_logps=old,
        advantages=torch.tensor([s["adv"] for s in seqs], dtype=f64),
        behaviour_logps=beh if seqs[0]["toks"][0][2] is not None else None,
        ref_logps=ref if seqs[0]["toks"][0][3] is not None else None,
        token_advantages=dense if "dense" in seqs[0] else None,
    )
    return batch, cur[mask].clone().requires_grad_(True)


def _reference(seqs, st: LossSettings):
    """float64 reference: numerator, count, d numerator / d logp per token (mask order)."""
    num, grads, tokens, clipped = 0.0, [], 0, 0
    lo, hi = 1 - st.epsilon_low, 1 + st.epsilon_high
    for s in seqs:
        a, n = s["adv"], len(s["toks"])
        if st.loss_agg_mode == LossAggMode.token_mean:
            weight = 1.0
        elif st.loss_agg_mode == LossAggMode.seq_mean_token_mean:
            weight = 1.0 / n
        elif st.loss_agg_mode == LossAggMode.seq_mean_token_sum:
            weight = 1.0
        else:
            weight = 1.0 / st.max_response_len
        for lp, old, beh, ref in s["toks"]:
            r = math.exp(lp - old)
            w = 1.0 if beh is None else min(math.exp(old - beh), st.rollout_correction_cap)
            unclipped, clip_term = -a * r, -a * min(max(r, lo), hi)
            pg = max(unclipped, clip_term)
            g = -w * a * r if unclipped >= clip_term else 0.0
            clipped += clip_term > unclipped
            term = w * pg
            if st.beta:
                term += st.beta * (math.exp(ref - lp) - (ref - lp) - 1)
                g += st.beta * (1 - math.exp(ref - lp))
            num += weight * term
            grads.append(weight * g)
            tokens += 1
    count = tokens if st.loss_agg_mode == LossAggMode.token_mean else len(seqs)
    return num, count, grads, clipped


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("stale,beta", [(False, 0.0), (True, 0.0), (True, 0.05)])
def test_loss_matches_float64_reference(mode, layout, stale, beta):
    rng = random.Random(zlib.crc32(f"{mode.value}{layout}{stale}{beta}".encode()))
    seqs = _random_sequences(rng, 8, stale=stale, with_ref=beta > 0)
    st = LossSettings(
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=beta,
        loss_agg_mode=mode,
        rollout_correction_cap=1.5,
        max_response_len=9,
    )
    batch, cur = _padded_batch(seqs) if layout == "padded" else _packed_batch(seqs)
    terms = loss_from_logps(cur, batch, st)
    terms.numerator.backward()
    num, count, grads, clipped = _reference(seqs, st)
    assert terms.numerator.item() == pytest.approx(num, rel=1e-13, abs=1e-13)
    assert terms.count.item() == count == divisor_count(batch, st).item()
    torch.testing.assert_close(
        cur.grad, torch.tensor(grads, dtype=torch.float64), rtol=1e-12, atol=1e-13
    )
    assert terms.stats[STAT_INDEX["clipped"]].item() == clipped
    assert 0 < clipped < sum(len(s["toks"]) for s in seqs)  # both branches exercised


def test_stale_weight_truncated_at_cap():
    seqs = [{"adv": 1.0, "toks": [(-1.0, -1.0, -3.0, None), (-1.0, -1.0, -1.2, None)]}]
    st = LossSettings(rollout_correction_cap=2.0)
    batch, cur = _padded_batch(seqs)
    terms = loss_from_logps(cur, batch, st)
    # ratio 1: pg = -A = -1 per token; weights min(e^2, 2) = 2 and e^0.2
    assert terms.numerator.item() == pytest.approx(-(2.0 + math.exp(0.2)), rel=1e-14)
    assert terms.stats[STAT_INDEX["is_capped"]].item() == 1


def test_beta_without_ref_is_an_error():
    seqs = [{"adv": 1.0, "toks": [(-1.0, -1.0, None, None)]}]
    batch, cur = _padded_batch(seqs)
    with pytest.raises(ValueError, match="ref_logps"):
        loss_from_logps(cur, batch, LossSettings(beta=0.1))


def test_logits_path_logps_and_entropy_float64():
    """grpo_loss from logits: logps and entropy equal a per-position Python computation."""
    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 2, 5, 11
    logits = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (rows, width), generator=g)
    lp = token_logprobs(logits, labels)
    ent = token_entropy(logits)
    for i in range(rows):
        for t in range(width):
            z = logits[i, t].tolist()
            m = max(z)
            lse = m + math.log(sum(math.exp(v - m) for v in z))
            assert lp[i, t].item() == pytest.approx(z[labels[i, t]] - lse, rel=1e-13)
            h = -sum(math.exp(v - lse) * (v - lse) for v in z)
            assert ent[i, t].item() == pytest.approx(h, rel=1e-12)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[0, 1:4] = True
    mask[1, 2] = True
    batch = GRPOBatch(
        labels=labels,
        loss_mask=mask,
        seq_index=torch.arange(rows).unsqueeze(1).expand(rows, width).clone(),
        old_logps=lp.detach() - 0.05,
        advantages=torch.tensor([0.5, -1.0], dtype=torch.float64),
    )
    terms = grpo_loss(logits, batch, LossSettings())
    assert terms.stats[STAT_INDEX["entropy"]].item() == pytest.approx(ent[mask].sum().item())
    ratio = math.exp(0.05)
    expected = -0.5 * ratio * 3 - (-1.0) * ratio
    assert terms.numerator.item() == pytest.approx(expected, rel=1e-12)


def test_summary_and_settings_from_config():
    cfg = RunConfig()
    cfg.grpo.loss_agg_mode = LossAggMode.seq_mean_token_sum_norm
    cfg.rollout.max_new_tokens = 17
    st = LossSettings.from_config(cfg)
    assert st.max_response_len == 17 and not st.token_level
    stats = torch.zeros(len(STAT_INDEX), dtype=torch.float64)
    stats[STAT_INDEX["tokens"]] = 4
    stats[STAT_INDEX["ratio"]] = 4.4
    stats[STAT_INDEX["ratio_sq"]] = 1.0 + 1.0 + 1.44 + 1.44
    stats[STAT_INDEX["clipped"]] = 1
    m = summarize_stats(stats, loss_numerator=3.0, divisor=2.0)
    assert m["loss"] == 1.5 and m["clip_fraction"] == 0.25
    assert m["ratio_mean"] == pytest.approx(1.1) and m["ratio_std"] == pytest.approx(0.1)


def _sample(p_len, r_len, *, version=0, truncated=False, seed=0):
    from rlbatch.grpo.types import Prompt, Sample

    rng = random.Random(seed)
    beh = [-rng.uniform(1, 3) for _ in range(r_len)]
    return Sample(
        prompt=Prompt(0, tuple(range(1, p_len + 1)), ""),
        group_id=0,
        response_ids=list(range(100, 100 + r_len)),
        behaviour_logps=beh,
        truncated=truncated,
        policy_version=version,
        advantage=0.5,
        old_logps=[b + 0.1 for b in beh],
    )


def test_build_grpo_batch_layouts_truncation_staleness_filler():
    from rlbatch.batching.plan import MicroBatch
    from rlbatch.grpo.loss import build_grpo_batch

    a, b = _sample(3, 4, version=2), _sample(2, 5, version=1, seed=1)
    # packed, round 4: a at columns 0..6 (slots 8), b truncated by the planner to 5 tokens
    mb = MicroBatch((0, 1), (7, 5), padded_len=16, computed_tokens=16, real_tokens=12, packed=True)
    a.old_logps = None  # a: no old pass (on-policy): its weight is exactly 1
    batch, tokens = build_grpo_batch([a, b], mb, round_to=4)
    assert tokens[0, :7].tolist() == [1, 2, 3, 100, 101, 102, 103]
    assert tokens[0, 8:13].tolist() == [1, 2, 100, 101, 102]
    assert batch.labels[0, 2].item() == 100 and batch.labels[0, 9].item() == 100
    assert batch.loss_mask[0].nonzero().flatten().tolist() == [2, 3, 4, 5, 9, 10, 11]
    assert batch.seq_index[0, 9].item() == 1
    # a has no old pass: behaviour == old; b has one: its own behaviour logps (3 kept)
    assert torch.equal(batch.behaviour_logps[0, 2:6], batch.old_logps[0, 2:6])
    assert batch.behaviour_logps[0, 9:12].tolist() == pytest.approx(b.behaviour_logps[:3])
    settings = LossSettings(loss_agg_mode=LossAggMode.seq_mean_token_sum)
    assert divisor_count(batch, settings).item() == 2
    # mask_truncated_completions drops a truncated sample from loss and divisor
    c = _sample(2, 3, truncated=True)
    mb2 = MicroBatch((0, 1), (7, 5), padded_len=8, computed_tokens=16, real_tokens=12)
    batch2, _ = build_grpo_batch([a, c], mb2, round_to=4, mask_truncated=True)
    assert batch2.num_truncated_masked == 1 and batch2.behaviour_logps is None
    assert batch2.loss_mask[1].sum().item() == 0 and divisor_count(batch2, settings).item() == 1
    # a filler micro-batch carries no loss but stays in the autograd graph
    filler = MicroBatch((), (), padded_len=8, computed_tokens=8, real_tokens=0, filler=True)
    batch3, tokens3 = build_grpo_batch([], filler, round_to=4)
    assert tokens3.shape == (1, 8)
    logits = torch.randn(1, 8, 300, dtype=torch.float64, requires_grad=True)
    for mode in LossAggMode:
        terms = grpo_loss(logits, batch3, LossSettings(loss_agg_mode=mode))
        terms.numerator.backward()
        assert terms.numerator.item() == 0 and terms.count.item() == 0


@pytest.mark.parametrize("mode", ALL_MODES)
def test_observation_tokens_carry_no_loss_and_no_gradient(mode):
    """A multi-turn sample's observation tokens (loss_mask 0) are inputs only: they count in
    no divisor, and changing the logits at their positions changes neither loss nor gradient."""
    from rlbatch.batching.plan import MicroBatch
    from rlbatch.grpo.loss import build_grpo_batch

    a = _sample(3, 6, seed=3)
    a.loss_mask = [1, 1, 0, 0, 0, 1]  # assistant, observation x3, assistant
    b = _sample(2, 4, seed=4)
    mb = MicroBatch((0, 1), (9, 6), padded_len=9, computed_tokens=18, real_tokens=15)
    batch, _ = build_grpo_batch([a, b], mb, round_to=1, dtype=torch.float64)
    # positions predicting a's response tokens 0..5 are 2..7; the observations are 4, 5, 6
    assert batch.loss_mask[0].nonzero().flatten().tolist() == [2, 3, 7]
    settings = LossSettings(loss_agg_mode=mode)
    if mode is LossAggMode.token_mean:
        assert divisor_count(batch, settings).item() == 3 + 4

    torch.manual_seed(0)
    base = torch.randn(2, 9, 150, dtype=torch.float64)
    grads, losses = [], []
    for shift in (0.0, 5.0):
        logits = base.clone()
        logits[0, 4:7] += shift * torch.randn(3, 150, dtype=torch.float64)
        logits.requires_grad_(True)
        terms = grpo_loss(logits, batch, settings)
        terms.numerator.backward()
        losses.append(terms.numerator.item())
        grads.append(logits.grad)
    assert losses[0] == losses[1]
    assert torch.equal(grads[0], grads[1])
    assert grads[0][0, 4:7].abs().max().item() == 0.0
