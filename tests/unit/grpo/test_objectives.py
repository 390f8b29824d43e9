"""Every policy loss, KL estimator, rollout correction and the entropy bonus against a float64
reference written here in plain Python (one token at a time, the papers' formulas), under every
loss_agg_mode and both layouts. Values are compared exactly to 1e-12; gradients against central
finite differences (five-point stencil) of the reference objective (the losses whose weight carries a stop-gradient,
CISPO, against their analytic gradient)."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from test_loss import _packed_batch, _padded_batch, _random_sequences

from rlbatch.config.schema import (
    KLEstimator,
    LossAggMode,
    PolicyLoss,
    RolloutCorrection,
)
from rlbatch.grpo.loss import STAT_INDEX, LossSettings, loss_from_logps, summarize_stats

ALL_MODES = list(LossAggMode)
FD_STEP = 1e-4

# the largest differences seen, per objective (printed by test_report_max_differences)
MAX_DIFF: dict[str, list[float]] = {}


def _record(name: str, got: list[float], want: list[float]) -> None:
    abs_d = max((abs(g - w) for g, w in zip(got, want, strict=True)), default=0.0)
    rel_d = max(
        (abs(g - w) / max(abs(w), 1e-300) for g, w in zip(got, want, strict=True) if w),
        default=0.0,
    )
    prev = MAX_DIFF.setdefault(name, [0.0, 0.0])
    prev[0], prev[1] = max(prev[0], abs_d), max(prev[1], rel_d)


def _agg_weight(mode: LossAggMode, n: int, max_len: int) -> float:
    return {
        LossAggMode.token_mean: 1.0,
        LossAggMode.seq_mean_token_mean: 1.0 / n,
        LossAggMode.seq_mean_token_sum: 1.0,
        LossAggMode.seq_mean_token_sum_norm: 1.0 / max_len,
    }[mode]


def _policy_term(st: LossSettings, lp: float, old: float, log_s: float, a: float) -> float:
    lo, hi = 1 - st.epsilon_low, 1 + st.epsilon_high
    r = math.exp(lp - old)
    if st.policy_loss == PolicyLoss.clip:
        return max(-a * r, -a * min(max(r, lo), hi))
    if st.policy_loss in (PolicyLoss.gspo, PolicyLoss.gspo_token):
        s = math.exp(log_s)
        return max(-a * s, -a * min(max(s, lo), hi))
    if st.policy_loss == PolicyLoss.cispo:
        return -a * min(max(r, lo), hi) * lp
    tau = st.sapo_tau_pos if a > 0 else st.sapo_tau_neg
    return -a * 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))


def _weight(st: LossSettings, w_tok: float, w_seq: float) -> float:
    mode, cap, lower = st.rollout_correction, st.rollout_correction_cap, st.rollout_correction_lower
    if mode == RolloutCorrection.none:
        return 1.0
    w = w_seq if mode in (RolloutCorrection.seq_tis, RolloutCorrection.seq_mask) else w_tok
    if mode in (RolloutCorrection.token_tis, RolloutCorrection.seq_tis):
        return min(w, cap)
    return w if lower <= w <= cap else 0.0


def _kl(st: LossSettings, lp: float, ref: float, old: float) -> float:
    x = ref - lp
    k = {KLEstimator.k1: -x, KLEstimator.k2: 0.5 * x * x, KLEstimator.k3: math.exp(x) - x - 1}
    value = k[st.kl_estimator]
    return value * math.exp(lp - old) if st.kl_bias_correction else value


def _token_adv(st: LossSettings, s: dict, k: int) -> float:
    """Token k's advantage: the sample's, or reward_coef * it + the token's dense (teacher)
    advantage when the sample has per-token advantages."""
    if "dense" not in s:
        return s["adv"]
    return st.reward_coef * s["adv"] + s["dense"][k]


def reference_objective(seqs, lps, st: LossSettings, entropy=None) -> float:
    """The numerator: sum over sequences of agg-weight x sum over tokens of
    w * pg + beta * kl - entropy_coef * H, for current logps ``lps`` (one list per sequence)."""
    total, flat = 0.0, 0
    for s, cur in zip(seqs, lps, strict=True):
        toks, n = s["toks"], len(s["toks"])
        weight = _agg_weight(st.loss_agg_mode, n, st.max_response_len)
        log_s = sum(c - t[1] for c, t in zip(cur, toks, strict=True)) / n
        stale = toks[0][2] is not None
        w_seq = math.exp(sum(t[1] - t[2] for t in toks)) if stale else 1.0
        for k, (lp, (_, old, beh, ref)) in enumerate(zip(cur, toks, strict=True)):
            a = _token_adv(st, s, k)
            w = _weight(st, math.exp(old - beh), w_seq) if stale else 1.0
            term = w * _policy_term(st, lp, old, log_s, a)
            if st.beta:
                term += st.beta * _kl(st, lp, ref, old)
            if entropy is not None:
                term -= st.entropy_coef * entropy[flat]
            total += weight * term
            flat += 1
    return total


def reference_grad(seqs, st: LossSettings) -> list[float]:
    """d numerator / d logp per token (mask order): central differences of the reference, or
    the analytic gradient where the paper puts a stop-gradient in the term: CISPO (-A clip(r)
    per token) and GSPO-token (s_i's value with the token's own gradient: -A s_i where the
    unclipped branch is active)."""
    lps = [[t[0] for t in s["toks"]] for s in seqs]
    grads = []
    lo, hi = 1 - st.epsilon_low, 1 + st.epsilon_high
    for i, s in enumerate(seqs):
        toks = s["toks"]
        weight = _agg_weight(st.loss_agg_mode, len(toks), st.max_response_len)
        stale = toks[0][2] is not None
        w_seq = math.exp(sum(t[1] - t[2] for t in toks)) if stale else 1.0
        s_i = math.exp(sum(t[0] - t[1] for t in toks) / len(toks))
        for k, (lp, old, beh, _) in enumerate(toks):
            a = _token_adv(st, s, k)
            w = _weight(st, math.exp(old - beh), w_seq) if stale else 1.0
            if st.policy_loss == PolicyLoss.cispo:
                g = -a * min(max(math.exp(lp - old), lo), hi)
            elif st.policy_loss == PolicyLoss.gspo_token:
                g = -a * s_i if -a * s_i >= -a * min(max(s_i, lo), hi) else 0.0
            else:
                grads.append(_fd(seqs, lps, i, k, st))
                continue
            g *= w * weight
            if st.beta:
                g += _fd(seqs, lps, i, k, st, kl_only=True)
            grads.append(g)
    return grads


def _fd(seqs, lps, i, k, st, kl_only=False) -> float:
    def f(delta: float) -> float:
        moved = [list(x) for x in lps]
        moved[i][k] += delta
        if kl_only:
            no_pg = [{"adv": 0.0, "toks": s["toks"]} for s in seqs]  # no "dense": 0
            return reference_objective(no_pg, moved, st)
        return reference_objective(seqs, moved, st)

    h = FD_STEP  # five-point stencil: truncation O(h^4), rounding ~1e-16 / h
    return (8 * (f(h) - f(-h)) - (f(2 * h) - f(-2 * h))) / (12 * h)


def _settings(**kw) -> LossSettings:
    base = dict(
        epsilon_low=0.2,
        epsilon_high=0.28,
        max_response_len=9,
        rollout_correction_cap=1.5,
        rollout_correction_lower=0.6,
    )
    return LossSettings(**{**base, **kw})


def _check(name, seqs, st, layout="padded", entropy=None):
    batch, cur = _padded_batch(seqs) if layout == "padded" else _packed_batch(seqs)
    terms = loss_from_logps(cur, batch, st, entropy=entropy)
    terms.numerator.backward()
    lps = [[t[0] for t in s["toks"]] for s in seqs]
    ent_list = entropy.detach().tolist() if entropy is not None else None
    want = reference_objective(seqs, lps, st, ent_list)
    assert terms.numerator.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    grads = reference_grad(seqs, st)
    torch.testing.assert_close(
        cur.grad, torch.tensor(grads, dtype=torch.float64), rtol=1e-9, atol=1e-10
    )
    _record(f"{name} (value)", [terms.numerator.item()], [want])
    _record(f"{name} (gradient)", cur.grad.tolist(), grads)
    return terms, batch


def _seqs(key: str, stale: bool, with_ref: bool, n: int = 8):
    return _random_sequences(random.Random(zlib.crc32(key.encode())), n, stale, with_ref)


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("loss", list(PolicyLoss), ids=lambda p: p.value)
def test_policy_losses_match_float64_reference(loss, layout, mode):
    seqs = _seqs(f"{loss.value}{layout}{mode.value}", stale=True, with_ref=False)
    st = _settings(policy_loss=loss, loss_agg_mode=mode)
    terms, _ = _check(f"policy_loss={loss.value}", seqs, st, layout)
    if loss in (PolicyLoss.clip, PolicyLoss.cispo):  # both sides of the clip are exercised
        assert 0 < terms.stats[STAT_INDEX["clipped"]].item() < terms.stats[0].item()


def test_gspo_token_equals_gspo_with_per_sequence_advantages():
    """With one advantage and one weight per sample the token-level form has GSPO's value and
    gradient (per-token correction weights make them differ: the reference test covers it)."""
    seqs = _seqs("gspo-eq", stale=False, with_ref=False)
    out = []
    for loss in (PolicyLoss.gspo, PolicyLoss.gspo_token):
        batch, cur = _padded_batch(seqs)
        terms = loss_from_logps(cur, batch, _settings(policy_loss=loss))
        terms.numerator.backward()
        out.append((terms.numerator.item(), cur.grad))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-14)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("estimator", list(KLEstimator), ids=lambda k: k.value)
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("mode", [LossAggMode.token_mean, LossAggMode.seq_mean_token_mean])
def test_kl_estimators_match_float64_reference(estimator, bias_correction, mode):
    seqs = _seqs(f"kl{estimator.value}{bias_correction}{mode.value}", stale=False, with_ref=True)
    st = _settings(
        beta=0.3, kl_estimator=estimator, kl_bias_correction=bias_correction, loss_agg_mode=mode
    )
    terms, _ = _check(f"kl_estimator={estimator.value} bias_correction={bias_correction}", seqs, st)
    lps = [t[0] for s in seqs for t in s["toks"]]
    refs = [t[3] for s in seqs for t in s["toks"]]
    k = {
        KLEstimator.k1: [lp - r for lp, r in zip(lps, refs, strict=True)],
        KLEstimator.k2: [0.5 * (lp - r) ** 2 for lp, r in zip(lps, refs, strict=True)],
        KLEstimator.k3: [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(lps, refs, strict=True)],
    }[estimator]
    assert terms.stats[STAT_INDEX["kl"]].item() == pytest.approx(math.fsum(k), rel=1e-12)


@pytest.mark.parametrize("correction", list(RolloutCorrection), ids=lambda c: c.value)
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_rollout_corrections_match_float64_reference(correction, mode):
    seqs = _seqs(f"corr{correction.value}{mode.value}", stale=True, with_ref=True, n=10)
    st = _settings(rollout_correction=correction, loss_agg_mode=mode, beta=0.05)
    terms, _ = _check(f"rollout_correction={correction.value}", seqs, st, "packed")
    raw = [math.exp(t[1] - t[2]) for s in seqs for t in s["toks"]]
    seq_raw = [math.exp(sum(t[1] - t[2] for t in s["toks"])) for s in seqs for _ in s["toks"]]
    w = seq_raw if correction in (RolloutCorrection.seq_tis, RolloutCorrection.seq_mask) else raw
    hit = {
        RolloutCorrection.none: 0,
        RolloutCorrection.token_tis: sum(x > 1.5 for x in w),
        RolloutCorrection.seq_tis: sum(x > 1.5 for x in w),
        RolloutCorrection.token_mask: sum(not 0.6 <= x <= 1.5 for x in w),
        RolloutCorrection.seq_mask: sum(not 0.6 <= x <= 1.5 for x in w),
    }[correction]
    masking = correction in (RolloutCorrection.token_mask, RolloutCorrection.seq_mask)
    got = terms.stats[STAT_INDEX["is_masked" if masking else "is_capped"]].item()
    assert got == hit
    if correction != RolloutCorrection.none:
        assert 0 < hit < len(raw)  # both sides of the bound exercised


def test_mismatch_diagnostics_float64():
    """k1 / k3 of KL(rollout || trainer), the log-perplexity gap, the ESS of the raw weights,
    from the behaviour (rollout) and old (trainer) logps, whatever the correction mode."""
    seqs = _seqs("diag", stale=True, with_ref=False, n=6)
    for correction in (RolloutCorrection.none, RolloutCorrection.seq_mask):
        batch, cur = _padded_batch(seqs)
        terms = loss_from_logps(cur, batch, _settings(rollout_correction=correction))
        m = summarize_stats(terms.stats, 0.0, 1.0)
        d = [t[1] - t[2] for s in seqs for t in s["toks"]]  # log(trainer / rollout)
        n = len(d)
        assert m["mismatch_kl_k1"] == pytest.approx(math.fsum(-x for x in d) / n, rel=1e-12)
        k3 = math.fsum(math.exp(x) - 1 - x for x in d) / n
        assert m["mismatch_kl_k3"] == pytest.approx(k3, rel=1e-12)
        gaps = [-math.fsum(t[1] - t[2] for t in s["toks"]) / len(s["toks"]) for s in seqs]
        assert m["mismatch_log_ppl_gap"] == pytest.approx(math.fsum(gaps) / len(seqs), rel=1e-12)
        w = [math.exp(x) for x in d]
        ess = math.fsum(w) ** 2 / (n * math.fsum(x * x for x in w))
        assert m["mismatch_ess"] == pytest.approx(ess, rel=1e-12)
        assert 0 < ess < 1


def test_on_policy_diagnostics_compare_this_forward_with_the_rollout():
    """Without behaviour logps (old = the rollout's logps), the mismatch is this forward's
    logps against them, and the applied weight is exactly 1."""
    seqs = _seqs("diag-on", stale=False, with_ref=False, n=4)
    batch, cur = _padded_batch(seqs)
    terms = loss_from_logps(cur, batch, _settings())
    m = summarize_stats(terms.stats, 0.0, 1.0)
    d = [t[0] - t[1] for s in seqs for t in s["toks"]]
    assert m["mismatch_kl_k1"] == pytest.approx(math.fsum(-x for x in d) / len(d), rel=1e-12)
    assert m["is_weight_mean"] == 1.0 and terms.weight_max is None


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_entropy_bonus_float64(mode):
    """-entropy_coef * H per token, aggregated like the other terms; its gradient reaches H."""
    seqs = _seqs(f"ent{mode.value}", stale=False, with_ref=False)
    n = sum(len(s["toks"]) for s in seqs)
    rng = random.Random(7)
    entropy = torch.tensor([rng.uniform(0.1, 3.0) for _ in range(n)], dtype=torch.float64)
    entropy.requires_grad_(True)
    st = _settings(entropy_coef=0.01, loss_agg_mode=mode)
    _check("entropy_coef", seqs, st, entropy=entropy)
    expected = []
    for s in seqs:
        weight = _agg_weight(mode, len(s["toks"]), st.max_response_len)
        expected += [-0.01 * weight] * len(s["toks"])
    torch.testing.assert_close(entropy.grad, torch.tensor(expected, dtype=torch.float64))


def test_entropy_gradient_from_logits_float64():
    """token_entropy is differentiable when grad is on: its gradient equals the analytic
    dH/dz = -p (log p + H) of a softmax."""
    from rlbatch.engine.logprobs import token_entropy

    g = torch.Generator().manual_seed(3)
    z = (torch.randn(4, 9, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    token_entropy(z, temperature=0.7).sum().backward()
    x = z.detach() / 0.7
    p = torch.softmax(x, -1)
    h = -(p * torch.log(p)).sum(-1, keepdim=True)
    torch.testing.assert_close(z.grad, -p * (torch.log(p) + h) / 0.7, rtol=1e-12, atol=1e-14)


def test_report_max_differences(capsys):
    """Prints the largest difference to the float64 reference per objective (run last)."""
    with capsys.disabled():
        for name, (abs_d, rel_d) in sorted(MAX_DIFF.items()):
            print(f"\n  {name:45s} max abs {abs_d:.2e}  max rel {rel_d:.2e}", end="")
        print()
