"""Normalization modes on one process in float64: every split of the same data gives the
gradient of an independently written global objective (eager, deferred), per_micro_batch
equals it only for uniform micro-batches, and the lazy modes prepare one micro-batch per yield.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlbatch.batching.plan import MicroBatch
from rlbatch.config.schema import LossAggMode, NormalizationMode, RunConfig
from rlbatch.grpo.loss import LossSettings, build_grpo_batch, grpo_loss
from rlbatch.grpo.normalization import (
    MegatronScaling,
    Normalizer,
    build_normalizer,
    default_constant,
    micro_batch_bias,
    scale_gradients,
)
from rlbatch.grpo.types import Prompt, Sample

VOCAB, HIDDEN, ROUND = 13, 6, 4
F64 = torch.float64


class TinyLM(torch.nn.Module):
    """Per-token model (no attention): enough to test how losses are weighted."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=F64))
        self.out = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g, dtype=F64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb[tokens]) @ self.out  # [R, S, V]


def make_samples(n: int, seed: int, uniform: bool = False) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p_len = 3 if uniform else rng.randint(2, 5)
        r_len = 4 if uniform else rng.randint(1, 9)
        prompt = Prompt(
            index=i, prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(p_len)), answer=""
        )
        resp = [rng.randrange(VOCAB) for _ in range(r_len)]
        beh = [-rng.uniform(1.5, 3.5) for _ in range(r_len)]
        out.append(
            Sample(
                prompt=prompt,
                group_id=i // 4,
                response_ids=resp,
                behaviour_logps=beh,
                truncated=(i % 5 == 4),
                policy_version=0,
                advantage=rng.uniform(-1.5, 1.5),
                old_logps=[b + rng.uniform(-0.3, 0.3) for b in beh],
                ref_logps=[b + rng.uniform(-0.3, 0.3) for b in beh],
            )
        )
    return out


def padded_mb(samples: list[Sample], idx: list[int], packed: bool = False) -> MicroBatch:
    lengths = tuple(samples[i].length for i in idx)
    rounded = [-(-n // ROUND) * ROUND for n in lengths]
    width = sum(rounded) if packed else max(rounded)
    rows = 1 if packed else len(idx)
    return MicroBatch(
        samples=tuple(idx),
        lengths=lengths,
        padded_len=width,
        computed_tokens=rows * width,
        real_tokens=sum(lengths),
        packed=packed,
    )


def split(n: int, sizes: list[int]) -> list[list[int]]:
    assert sum(sizes) == n
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out


def reference_grads(
    model: TinyLM,
    samples: list[Sample],
    st: LossSettings,
    mask_trunc: bool,
    scored=lambda s: range(len(s.response_ids)),
):
    """The global objective written directly: per sample, per scored response token (``scored``:
    the positions of the terms; default every response token), float64."""
    per_seq, n_tok = [], 0
    for s in samples:
        if mask_trunc and s.truncated:
            continue
        ids = torch.tensor(s.input_ids)
        logp_all = torch.log_softmax(model(ids.unsqueeze(0))[0], dim=-1)
        p = len(s.prompt.prompt_ids)
        terms = []
        for k in scored(s):
            lp = logp_all[p - 1 + k, s.response_ids[k]]
            r = torch.exp(lp - s.old_logps[k])
            a = s.advantage
            pg = torch.maximum(-a * r, -a * r.clamp(1 - st.epsilon_low, 1 + st.epsilon_high))
            # the old pass ran: the truncated weight pi_old / pi_behaviour multiplies the surrogate
            w = min(math.exp(s.old_logps[k] - s.behaviour_logps[k]), st.rollout_correction_cap)
            pg = w * pg
            d = s.ref_logps[k] - lp
            terms.append(pg + st.beta * (torch.exp(d) - d - 1))
        per_seq.append(torch.stack(terms))
        n_tok += len(terms)
    mode = st.loss_agg_mode
    if mode == LossAggMode.token_mean:
        loss = sum(t.sum() for t in per_seq) / n_tok
    elif mode == LossAggMode.seq_mean_token_mean:
        loss = sum(t.mean() for t in per_seq) / len(per_seq)
    elif mode == LossAggMode.seq_mean_token_sum:
        loss = sum(t.sum() for t in per_seq) / len(per_seq)
    else:
        loss = sum(t.sum() / st.max_response_len for t in per_seq) / len(per_seq)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.item(), torch.cat([g.flatten() for g in grads])


def run_step(
    model,
    samples,
    groups,
    mode,
    st,
    *,
    per_token=True,
    packed=False,
    mask_trunc=False,
    constant=37.0,
):
    """One step through the normalization path, emulating Megatron's schedule scaling."""
    model.zero_grad()
    m = len(groups)
    scaling = MegatronScaling(calculate_per_token_loss=per_token, num_micro_batches=m)
    norm = Normalizer(mode=mode, settings=st, scaling=scaling, constant=constant)
    prepared_at_first_forward = []

    def prepare(i):
        mb = padded_mb(samples, groups[i], packed=packed)
        batch, tokens = build_grpo_batch(
            [samples[j] for j in groups[i]],
            mb,
            round_to=ROUND,
            mask_truncated=mask_trunc,
            dtype=F64,
        )
        batch.tokens = tokens
        return batch

    for batch in norm.iterate(prepare, m):
        if not prepared_at_first_forward:
            prepared_at_first_forward.append(norm.num_prepared)
        loss = norm.loss_for_backward(grpo_loss(model(batch.tokens), batch, st), batch)
        if not per_token:
            loss = loss / m  # what Megatron's schedule does without calculate_per_token_loss
        loss.backward()
    res = norm.finish()
    scale_gradients([model], res.grad_multiplier)
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    return res, grad, prepared_at_first_forward[0]


SPLITS = {1: [21], 3: [9, 2, 10], 7: [1, 5, 2, 4, 3, 1, 5]}


@pytest.mark.parametrize("agg", list(LossAggMode), ids=lambda m: m.value)
@pytest.mark.parametrize(
    "mode", [NormalizationMode.eager_global, NormalizationMode.deferred_global]
)
def test_exact_modes_match_global_objective(agg, mode):
    st = LossSettings(beta=0.04, loss_agg_mode=agg, max_response_len=9, epsilon_high=0.28)
    model, samples = TinyLM(), make_samples(21, seed=1)
    ref_loss, ref_grad = reference_grads(model, samples, st, mask_trunc=True)
    for num_mb, sizes in SPLITS.items():
        for per_token, packed in [(True, False), (False, True)]:
            res, grad, _ = run_step(
                model,
                samples,
                split(21, sizes),
                mode,
                st,
                per_token=per_token,
                packed=packed,
                mask_trunc=True,
            )
            rel = ((grad - ref_grad).norm() / ref_grad.norm()).item()
            assert rel <= 1e-12, (num_mb, per_token, packed, rel)
            assert res.metrics["loss"] == pytest.approx(ref_loss, rel=1e-12)
            assert res.metrics["loss_optimized"] == pytest.approx(ref_loss, rel=1e-12)
            assert res.metrics["masked_truncated"] == 4


def test_per_micro_batch_exact_when_uniform_biased_otherwise():
    st = LossSettings(loss_agg_mode=LossAggMode.token_mean)
    model = TinyLM()
    uniform = make_samples(21, seed=2, uniform=True)
    _, ref = reference_grads(model, uniform, st, mask_trunc=False)
    res, grad, _ = run_step(
        model, uniform, split(21, [7, 7, 7]), NormalizationMode.per_micro_batch, st
    )
    assert ((grad - ref).norm() / ref.norm()).item() <= 1e-12
    assert res.metrics["pmb_weight_min"] == res.metrics["pmb_weight_max"] == 1.0
    ragged = make_samples(21, seed=2)
    ref_loss, ref = reference_grads(model, ragged, st, mask_trunc=False)
    res, grad, _ = run_step(
        model, ragged, split(21, SPLITS[7]), NormalizationMode.per_micro_batch, st
    )
    rel = ((grad - ref).norm() / ref.norm()).item()
    assert rel > 1e-3  # biased: per-micro-batch weighting differs from the global token mean
    assert res.metrics["loss"] == pytest.approx(ref_loss, rel=1e-12)  # reported loss stays exact
    assert res.metrics["loss_optimized"] != pytest.approx(ref_loss, rel=1e-6)
    assert res.metrics["pmb_weight_min"] < 1.0 < res.metrics["pmb_weight_max"]


@pytest.mark.parametrize("mode", list(NormalizationMode))
def test_lazy_modes_prepare_one_micro_batch_per_yield(mode):
    model, samples = TinyLM(), make_samples(21, seed=3)
    _, _, prepared = run_step(model, samples, split(21, SPLITS[7]), mode, LossSettings())
    assert prepared == (7 if mode == NormalizationMode.eager_global else 1)


def test_worked_example_of_the_bias():
    """docs/normalization.md: 10 tokens of mean loss 1.0 and 90 of mean 2.0."""
    out = micro_batch_bias(counts=[10, 90], sums=[10.0, 180.0])
    assert out["exact"] == pytest.approx(1.9) and out["per_micro_batch"] == pytest.approx(1.5)
    assert micro_batch_bias([50, 50], [50.0, 100.0])["rel_deviation"] == pytest.approx(0.0)


def test_default_constant_and_megatron_factor():
    cfg = RunConfig()
    cfg.batching.train.max_tokens, cfg.batching.train.sequence_length_round = 1024, 8
    assert default_constant(cfg, LossSettings()) == 1024
    seq = LossSettings(loss_agg_mode=LossAggMode.seq_mean_token_sum)
    assert default_constant(cfg, seq) == 128
    cfg.normalization.constant = 5.0
    assert build_normalizer(cfg, seq, MegatronScaling(True, 3)).constant == 5.0
    assert MegatronScaling(False, 4, dp_cp_size=2).factor == 1 / 8
    assert int(MegatronScaling(True, 4).count_for_megatron()) == 0


def multi_turn_samples(n: int, seed: int) -> list[Sample]:
    """Trajectories: assistant turns with observation runs (loss_mask 0) between them; the
    old / ref logps at observation positions are absurd (+50) and the behaviour logps 0.0, so
    any read of them would show."""
    rng = random.Random(seed)
    out = make_samples(n, seed)
    for s in out:
        extra = rng.randint(1, 4)  # one observation run inserted after the first token
        s.response_ids[1:1] = [rng.randrange(VOCAB) for _ in range(extra)]
        mask = [1] + [0] * extra + [1] * (len(s.response_ids) - 1 - extra)
        for name in ("old_logps", "ref_logps", "behaviour_logps"):
            values = getattr(s, name)
            setattr(s, name, values[:1] + [0.0 if name == "behaviour_logps" else 50.0] * extra
                    + values[1:])  # fmt: skip
        s.loss_mask = mask
        s.token_versions = [0] * len(s.response_ids)
    return out


def assistant_only_reference(model, samples, st, mask_trunc):
    """reference_grads over the assistant tokens alone: each trajectory's observation tokens
    are inputs of the forward but contribute no term and count in no divisor."""
    return reference_grads(
        model, samples, st, mask_trunc, scored=lambda s: [k for k, m in enumerate(s.loss_mask) if m]
    )


@pytest.mark.parametrize("agg", list(LossAggMode), ids=lambda m: m.value)
@pytest.mark.parametrize("mode", list(NormalizationMode), ids=lambda m: m.value)
def test_trajectory_gradient_is_the_assistant_tokens_alone(agg, mode):
    """Multi-turn samples through every normalization mode and loss aggregation: the gradient
    and the loss are those of a float64 objective over the assistant tokens alone (any split for
    the exact modes; per_micro_batch in one micro-batch, where it is exact too)."""
    st = LossSettings(beta=0.04, loss_agg_mode=agg, max_response_len=13, epsilon_high=0.28)
    model, samples = TinyLM(), multi_turn_samples(21, seed=3)
    ref_loss, ref_grad = assistant_only_reference(model, samples, st, mask_trunc=True)
    splits = SPLITS if mode != NormalizationMode.per_micro_batch else {1: [21]}
    for sizes in splits.values():
        for per_token, packed in [(True, False), (False, True)]:
            res, grad, _ = run_step(
                model, samples, split(21, sizes), mode, st,
                per_token=per_token, packed=packed, mask_trunc=True,
            )  # fmt: skip
            rel = ((grad - ref_grad).norm() / ref_grad.norm()).item()
            assert rel <= 1e-12, (sizes, per_token, packed, rel)
            assert res.metrics["loss"] == pytest.approx(ref_loss, rel=1e-12)
            kept = [s for s in samples if not s.truncated]
            assert res.metrics["tokens"] == sum(sum(s.loss_mask) for s in kept)
