"""GRPO loss of one micro-batch: per-token terms, aggregation and metrics.

The loss returns a NUMERATOR (the sum over the micro-batch of per-token or per-sequence
terms, with autograd) and the local DIVISOR COUNT (valid tokens for ``token-mean``, valid
sequences for the ``seq-mean-*`` modes). Dividing is the job of :mod:`rlbatch.grpo.normalization`,
so that every normalization mode (eager, per micro-batch, deferred) is built on the same numbers.
``docs/grpo_loss.md`` has the formulas.

Layout: every per-token tensor is aligned with the model's logits ``[rows, seq]``: position p
holds the data of the token at p + 1 (the token that position p predicts). Padded micro-batches
hold one sample per row; packed ones one row with the samples side by side; ``seq_index`` names
the sample (0 .. num_seqs - 1) of each position, so both layouts aggregate the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlbatch.batching.plan import MicroBatch
from rlbatch.config.distill import reward_weight
from rlbatch.config.schema import (
    KLEstimator,
    LossAggMode,
    PolicyLoss,
    RolloutCorrection,
    RunConfig,
)
from rlbatch.grpo.lcm import old_from_forward
from rlbatch.grpo.objectives import (
    KL_ESTIMATORS,
    MASK_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    CorrectionParams,
    PolicyParams,
    PolicyTerm,
    seq_mean,
)
from rlbatch.grpo.types import Sample

# Keys of the metric sums each micro-batch returns (a float64 vector, summed across
# micro-batches and ranks in one bundled all-reduce; see normalization.StepAccumulator).
STAT_KEYS: tuple[str, ...] = (
    "tokens",  # valid (loss-carrying) response tokens
    "seqs",  # sequences with at least one valid token
    "clipped",  # tokens where the policy loss's clip (or CISPO's weight clamp) was active
    "kl",  # sum of the KL estimate (grpo.kl_estimator) over tokens (0 when no reference logps)
    "entropy",  # sum of the per-token entropy of the current policy
    "ratio",  # sum of the importance ratio the policy loss uses
    "ratio_sq",  # sum of its square
    "is_weight",  # sum of the applied correction weight (grpo.rollout_correction)
    "is_capped",  # tokens whose weight was truncated at the cap (tis modes)
    "is_masked",  # tokens whose weight was masked to 0 (mask modes)
    "mismatch_k1",  # sum of log(pi_rollout / pi_trainer): k1 of KL(rollout || trainer)
    "mismatch_k3",  # sum of w - 1 - log w, w = pi_trainer / pi_rollout: k3 of the same KL
    "log_ppl_gap",  # sum over sequences of (trainer - rollout) log-perplexity
    "w_raw",  # sum of the raw token weight pi_trainer / pi_rollout
    "w_raw_sq",  # sum of its square (effective sample size)
    "masked_truncated",  # sequences excluded because they were truncated (option)
    "aux",  # MoE: the load-balancing loss's numerator, aggregated like the policy loss's
)
STAT_INDEX = {key: i for i, key in enumerate(STAT_KEYS)}

TOKEN_LEVEL = frozenset({LossAggMode.token_mean})


@dataclass(frozen=True)
class LossSettings:
    """The GRPO loss hyper-parameters (from ``cfg.grpo`` and ``cfg.rollout``)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    loss_agg_mode: LossAggMode = LossAggMode.token_mean
    rollout_correction_cap: float = 2.0
    max_response_len: int = 1
    """Dr. GRPO's constant (seq-mean-token-sum-norm): rollout.max_new_tokens."""
    mask_truncated_completions: bool = False
    temperature: float = 1.0
    """rollout.temperature: the current policy's logprobs are those of logits / temperature."""
    old_from_forward: bool = False
    """pi_old is the policy of this forward (a round of one step under a rollout correction,
    rlbatch.grpo.lcm.pi_old_source): old logps = the current logps, detached."""
    policy_loss: PolicyLoss = PolicyLoss.clip
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    rollout_correction: RolloutCorrection = RolloutCorrection.token_tis
    rollout_correction_lower: float = 0.0
    reward_coef: float = 1.0
    """grpo.distill.reward_coef with a teacher (1 without): the weight of the sample's group
    reward advantage beside the per-token teacher advantage."""
    aux_coeff: float = 0.0
    """model.moe_aux_loss_coeff: the weight of an MoE policy's load-balancing loss."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> LossSettings:
        g = cfg.grpo
        return cls(
            epsilon_low=g.epsilon_low,
            epsilon_high=g.epsilon_high,
            beta=g.beta,
            loss_agg_mode=LossAggMode(g.loss_agg_mode),
            rollout_correction_cap=g.rollout_correction_cap,
            max_response_len=cfg.rollout.max_new_tokens,
            mask_truncated_completions=g.mask_truncated_completions,
            temperature=cfg.rollout.temperature,
            old_from_forward=old_from_forward(cfg),
            policy_loss=PolicyLoss(g.policy_loss),
            sapo_tau_pos=g.sapo_tau_pos,
            sapo_tau_neg=g.sapo_tau_neg,
            kl_estimator=KLEstimator(g.kl_estimator),
            kl_bias_correction=g.kl_bias_correction,
            entropy_coef=g.entropy_coef,
            rollout_correction=RolloutCorrection(g.rollout_correction),
            rollout_correction_lower=g.rollout_correction_lower,
            reward_coef=reward_weight(cfg),
            aux_coeff=cfg.model.moe_aux_loss_coeff,
        )

    @property
    def policy_params(self) -> PolicyParams:
        return PolicyParams(
            self.epsilon_low, self.epsilon_high, self.sapo_tau_pos, self.sapo_tau_neg
        )

    @property
    def correction_params(self) -> CorrectionParams:
        return CorrectionParams(self.rollout_correction_cap, self.rollout_correction_lower)

    @property
    def token_level(self) -> bool:
        """True when the divisor counts tokens, False when it counts sequences."""
        return self.loss_agg_mode in TOKEN_LEVEL


@dataclass
class GRPOBatch:
    """Per-token GRPO fields of one micro-batch, aligned with the logits ``[R, S]``."""

    labels: torch.Tensor
    """[R, S] long: the token each position predicts (0 where unused)."""
    loss_mask: torch.Tensor
    """[R, S] bool: the position predicts a response token that carries loss."""
    seq_index: torch.Tensor
    """[R, S] long: sample (0 .. num_seqs-1) of each position; 0 where loss_mask is False."""
    old_logps: torch.Tensor
    """[R, S] float: log pi_old of the predicted token (the clip's anchor)."""
    advantages: torch.Tensor
    """[num_seqs] float: the group reward advantage of each sample."""
    token_advantages: Optional[torch.Tensor] = None
    """[R, S] float: the per-token (teacher) advantage at each position (on-policy
    distillation); None = none. A token's advantage is reward_coef * advantages[seq] + this."""
    behaviour_logps: Optional[torch.Tensor] = None
    """[R, S] float: log pi_behaviour (the generating policy); None = same as old."""
    ref_logps: Optional[torch.Tensor] = None
    """[R, S] float: log pi_ref; needed when beta > 0."""
    num_truncated_masked: int = 0
    """Sequences dropped from the loss by mask_truncated_completions."""
    index: int = 0
    """Position of the micro-batch in the rank's plan (for error messages)."""
    loss_scale: torch.Tensor | float = 1.0
    """Set by the normalizer: the factor the numerator is multiplied by in the loss."""
    tokens: Optional[torch.Tensor] = None
    """[R, S] long: the input token ids the schedule feeds the model (set when prepared)."""
    micro_batch: Optional[MicroBatch] = None
    """The plan's micro-batch these rows come from (layout and sample order; set when prepared)."""

    @property
    def num_seqs(self) -> int:
        return int(self.advantages.numel())

    def to(self, device: torch.device | str) -> GRPOBatch:
        """Move every tensor field (in place) to ``device``; returns self."""
        for name in ("labels", "loss_mask", "seq_index", "old_logps", "advantages"):
            setattr(self, name, getattr(self, name).to(device))
        for name in ("behaviour_logps", "ref_logps", "tokens", "token_advantages"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self


@dataclass
class LossTerms:
    """What the loss of one micro-batch returns."""

    numerator: torch.Tensor
    """Scalar with autograd: sum of the per-token (token-mean) or per-sequence terms."""
    count: torch.Tensor
    """float64 scalar: local divisor count, valid tokens (token-level) or valid sequences."""
    stats: torch.Tensor
    """[len(STAT_KEYS)] float64, detached: metric sums (see STAT_KEYS). Kept on the device:
    nothing here synchronizes with the host."""
    weight_max: Optional[torch.Tensor] = None
    """float64 scalar, detached: the largest raw pi_old / pi_behaviour over the loss tokens
    (None under grpo.rollout_correction=none, where no weight applies)."""


def divisor_count(batch: GRPOBatch, settings: LossSettings) -> torch.Tensor:
    """The local divisor of a micro-batch (float64 scalar), known from its data before any
    forward."""
    if settings.token_level:
        return batch.loss_mask.sum().to(torch.float64)
    return _valid_seqs(batch).sum().to(torch.float64)


def _valid_seqs(batch: GRPOBatch) -> torch.Tensor:
    """[num_seqs] bool: the sequence has at least one loss-carrying token."""
    counts = torch.bincount(batch.seq_index[batch.loss_mask], minlength=batch.num_seqs)
    return counts > 0


# ------------------------------------------------------------------------------------------
# Building a micro-batch's GRPO fields from Samples
# ------------------------------------------------------------------------------------------


def row_offsets(lengths: Sequence[int], packed: bool, round_to: int) -> list[tuple[int, int]]:
    """(row, start column) of each sample: padded = own row at column 0; packed = row 0 at
    the running sum of round_up(length, round_to) (plan.MicroBatch's packed layout)."""
    if not packed:
        return [(j, 0) for j in range(len(lengths))]
    out, col = [], 0
    for n in lengths:
        out.append((0, col))
        col += -(-n // round_to) * round_to
    return out


def _fill_logps(
    sample: Sample, n: int, old: torch.Tensor, behaviour: torch.Tensor, ref: torch.Tensor
) -> bool:
    """Write the first n response tokens' old / behaviour / ref logps into the given views
    (without old logps, old is the behaviour: grpo.rollout_correction=none, no weight; with
    LossSettings.old_from_forward the loss replaces it by the forward's logps; which one applies:
    rlbatch.grpo.lcm.pi_old_source). True if ref was set."""
    old_l = sample.old_logps if sample.old_logps is not None else sample.behaviour_logps
    old.copy_(torch.tensor(old_l[:n], dtype=torch.float64))
    behaviour.copy_(torch.tensor(sample.behaviour_logps[:n], dtype=torch.float64))
    if sample.ref_logps is None:
        return False
    ref.copy_(torch.tensor(sample.ref_logps[:n], dtype=torch.float64))
    return True


def build_grpo_batch(
    samples: Sequence[Sample],
    micro_batch: MicroBatch,
    *,
    round_to: int,
    mask_truncated: bool = False,
    with_behaviour: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[GRPOBatch, torch.Tensor]:
    """The GRPO fields and the input tokens ``[R, S]`` of one planned micro-batch.

    ``samples`` are the micro-batch's samples in plan order. ``micro_batch.lengths`` may be
    shorter than a sample (oversize ``truncate``): only the kept response tokens carry loss.
    Old logps default to the behaviour logps (grpo.rollout_correction=none: the ratio is taken
    against the behaviour policy, no weight). A sample whose old logps come from an old-logprob
    pass gets the behaviour importance weight pi_old / pi_behaviour (``behaviour_logps`` is set
    when any sample has one, or always with ``with_behaviour``: the old logps come from the
    training forward, old_from_forward). The rule: rlbatch.grpo.lcm.pi_old_source.
    """
    rows = max(1, micro_batch.num_rows)
    width = micro_batch.padded_len
    tokens = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    seq_index = torch.zeros(rows, width, dtype=torch.long)
    old, behaviour, ref, dense = (torch.zeros(rows, width, dtype=torch.float64) for _ in range(4))
    any_stale, any_ref = with_behaviour, False
    any_dense = any(s.token_advantages is not None for s in samples)
    masked = 0
    places = row_offsets(micro_batch.lengths, micro_batch.packed, round_to)
    for j, (sample, length, (row, col)) in enumerate(
        zip(samples, micro_batch.lengths, places, strict=True)
    ):
        ids = sample.input_ids[:length]
        tokens[row, col : col + length] = torch.tensor(ids, dtype=torch.long)
        labels[row, col : col + length - 1] = torch.tensor(ids[1:], dtype=torch.long)
        if mask_truncated and sample.truncated:
            masked += 1
            continue
        p_len = len(sample.prompt.prompt_ids)
        n_resp = max(0, length - p_len)
        sl = slice(col + p_len - 1, col + p_len - 1 + n_resp)  # positions predicting the response
        assert sample.loss_mask is not None
        keep = torch.tensor(sample.loss_mask[:n_resp], dtype=torch.bool)  # observations: 0
        mask[row, sl] = keep
        seq_index[row, sl] = j * keep.long()
        any_stale |= sample.old_logps is not None
        any_ref |= _fill_logps(sample, n_resp, old[row, sl], behaviour[row, sl], ref[row, sl])
        if sample.token_advantages is not None:
            values = torch.tensor(sample.token_advantages[:n_resp], dtype=torch.float64)
            dense[row, sl] = values * keep
    batch = GRPOBatch(
        labels=labels,
        loss_mask=mask,
        seq_index=seq_index,
        old_logps=old.to(dtype),
        advantages=torch.tensor([s.advantage for s in samples], dtype=dtype),
        behaviour_logps=behaviour.to(dtype) if any_stale else None,
        ref_logps=ref.to(dtype) if any_ref else None,
        token_advantages=dense.to(dtype) if any_dense else None,
        num_truncated_masked=masked,
    )
    return batch, tokens


# ------------------------------------------------------------------------------------------
# The loss
# ------------------------------------------------------------------------------------------


def grpo_loss(
    output: Any, batch: GRPOBatch, settings: LossSettings, aux: Optional[torch.Tensor] = None
) -> LossTerms:
    """GRPO loss of one micro-batch from the training forward's output: the schedule's
    ``LMOutput`` (hidden states projected in chunks at the loss positions only, or logits), or
    plain logits ``[R, S, V/tp]``. ``aux``: an MoE policy's per-sample load-balancing loss
    (:func:`loss_from_logps`)."""
    from rlbatch.engine.lm_head import LMOutput

    if isinstance(output, torch.Tensor):
        output = LMOutput(logits=output)
    logps, entropy = output.logprobs(
        batch.loss_mask,
        batch.labels,
        temperature=settings.temperature,
        entropy=True,
        # the entropy carries a gradient only when it is a loss term (grpo.entropy_coef)
        entropy_grad=torch.is_grad_enabled() and settings.entropy_coef != 0.0,
        inplace=True,  # the logits are not read again
    )  # [N], [N]: loss positions only, in loss_mask order
    return loss_from_logps(logps, batch, settings, entropy=entropy, aux=aux)


def loss_from_logps(
    logps: torch.Tensor,
    batch: GRPOBatch,
    settings: LossSettings,
    *,
    entropy: Optional[torch.Tensor] = None,
    aux: Optional[torch.Tensor] = None,
) -> LossTerms:
    """The loss from the current policy's logps at the valid positions (flat ``[N]``,
    in ``loss_mask`` order). Returns the numerator, the local count and the metric sums.

    l_t = w_t * pg_t + beta * kl_t - entropy_coef * H_t, with pg from grpo.policy_loss, w from
    grpo.rollout_correction and kl from grpo.kl_estimator (docs/grpo_loss.md); pg's advantage is
    the sample's A_i, or reward_coef * A_i + D_t with per-token (teacher) advantages D_t.

    ``aux`` (MoE, ``[num_seqs]`` with autograd): each sample's load-balancing loss b_i, added
    to every loss token of the sample as aux_coeff * b_i, so it is averaged exactly like the
    policy loss (grpo.loss_agg_mode: token-weighted under token-mean, one share a sequence in the
    seq-mean modes); its aggregated value is the ``aux`` metric sum either way."""
    mask = batch.loss_mask
    seq = batch.seq_index[mask]  # [N]
    if settings.old_from_forward:  # pi_old = this forward's policy: ratio 1, gradient of logps
        old = logps.detach()
    else:
        old = batch.old_logps[mask].to(logps.dtype)
    adv = batch.advantages.to(logps.dtype)[seq]  # [N]
    if settings.reward_coef != 1.0:
        adv = settings.reward_coef * adv
    if batch.token_advantages is not None:  # + D_t (on-policy distillation)
        adv = adv + batch.token_advantages[mask].to(logps.dtype)
    term = POLICY_LOSSES[settings.policy_loss](
        logps, old, adv, seq, batch.num_seqs, settings.policy_params
    )
    log_w = _log_weight(logps, old, batch)  # log(pi_trainer / pi_rollout), data
    is_weight, hit, weight_max = _importance_weights(log_w, seq, batch, settings)
    per_token = is_weight * term.pg

    kl = None
    if batch.ref_logps is not None:
        kl = KL_ESTIMATORS[settings.kl_estimator](logps, batch.ref_logps[mask].to(logps.dtype))
    if settings.beta != 0.0:
        if kl is None:
            raise ValueError("grpo.beta > 0 needs ref_logps in the batch (the reference pass)")
        kl_term = kl * torch.exp(logps - old) if settings.kl_bias_correction else kl
        per_token = per_token + settings.beta * kl_term
    if settings.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("grpo.entropy_coef != 0 needs the per-token entropy")
        per_token = per_token - settings.entropy_coef * entropy.to(per_token.dtype)

    aux_sum = None
    if aux is not None:
        aux_token = aux.to(device=per_token.device, dtype=per_token.dtype)[seq]  # [N]
        if settings.aux_coeff != 0.0 and per_token.requires_grad and not aux.requires_grad:
            raise RuntimeError(
                "the load-balancing loss has no gradient (its router logits were computed "
                "without autograd, e.g. by model.recompute=full): it would train nothing"
            )
        if settings.aux_coeff != 0.0:
            per_token = per_token + settings.aux_coeff * aux_token
        with torch.no_grad():
            aux_sum = aggregate(aux_token.detach(), seq, batch.num_seqs, settings)[0]
    numerator, count = aggregate(per_token, seq, batch.num_seqs, settings)
    with torch.no_grad():
        stats = _stats(batch, settings, term, is_weight, hit, log_w, seq, kl, entropy, aux_sum)
    return LossTerms(numerator=numerator, count=count, stats=stats, weight_max=weight_max)


def _log_weight(logps: torch.Tensor, old: torch.Tensor, batch: GRPOBatch) -> torch.Tensor:
    """log(pi_trainer / pi_rollout) per loss token, detached: pi_old against the behaviour
    logps when the batch has them, else (old logps = the rollout's) this forward against them."""
    if batch.behaviour_logps is None:
        return logps.detach() - old.detach()
    return old.detach() - batch.behaviour_logps[batch.loss_mask].to(old.dtype)


def _importance_weights(
    log_w: torch.Tensor, seq: torch.Tensor, batch: GRPOBatch, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(applied weight, tokens the cap or mask acted on, largest raw weight) per loss token.

    The one implementation of the weight pi_old / pi_behaviour: the staleness correction of
    off-policy samples and the rollout-mismatch correction are the same quantity. A batch without
    behaviour logps (grpo.rollout_correction=none: pi_old is the behaviour policy itself) gets
    weight 1 and no maximum."""
    if batch.behaviour_logps is None:
        ones = torch.ones_like(log_w)
        return ones, torch.zeros_like(ones, dtype=torch.bool), None
    weight_max = torch.exp(log_w).max().to(torch.float64) if log_w.numel() else None
    fn = ROLLOUT_CORRECTIONS[settings.rollout_correction]
    weight, hit = fn(log_w, seq, batch.num_seqs, settings.correction_params)
    return weight, hit, weight_max


def _stats(
    batch: GRPOBatch,
    settings: LossSettings,
    term: PolicyTerm,
    is_weight: torch.Tensor,
    hit: torch.Tensor,
    log_w: torch.Tensor,
    seq: torch.Tensor,
    kl: Optional[torch.Tensor],
    entropy: Optional[torch.Tensor],
    aux: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The metric sums (STAT_KEYS order, float64, on the device). Every per-token term is cast
    to float64 before it is summed: variances are E[x^2] - E[x]^2, whose fp32 sums lose the
    small spreads (a ratio_std of 2e-4 read for ratios all within 5e-7 of 1)."""
    zero = torch.zeros((), dtype=torch.float64, device=log_w.device)
    masking = settings.rollout_correction in MASK_MODES
    log_w = log_w.detach().double()
    w = torch.exp(log_w)
    ratio = term.ratio.detach().double()
    valid = _valid_seqs(batch)
    gap = seq_mean(-log_w, seq, batch.num_seqs)[valid].sum() if log_w.numel() else zero
    values = {
        "tokens": batch.loss_mask.sum(),
        "seqs": valid.sum(),
        "clipped": term.clipped.sum(),
        "kl": kl.detach().double().sum() if kl is not None else zero,
        "entropy": entropy.detach().double().sum() if entropy is not None else zero,
        "ratio": ratio.sum(),
        "ratio_sq": (ratio * ratio).sum(),
        "is_weight": is_weight.detach().double().sum(),
        "is_capped": zero if masking else hit.sum(),
        "is_masked": hit.sum() if masking else zero,
        "mismatch_k1": (-log_w).sum(),
        "mismatch_k3": (w - 1.0 - log_w).sum(),
        "log_ppl_gap": gap,
        "w_raw": w.sum(),
        "w_raw_sq": (w * w).sum(),
        "masked_truncated": zero + batch.num_truncated_masked,
        "aux": aux if aux is not None else zero,
    }
    return torch.stack([values[k].to(torch.float64) for k in STAT_KEYS])


def aggregate(
    per_token: torch.Tensor, seq: torch.Tensor, num_seqs: int, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and divisor count of ``loss_agg_mode`` (``[N]`` terms, ``[N]`` sample ids).

    token-mean:              sum_t l_t                       / #tokens
    seq-mean-token-mean:     sum_i (sum_{t in i} l_t / n_i)  / #seqs
    seq-mean-token-sum:      sum_i sum_{t in i} l_t          / #seqs
    seq-mean-token-sum-norm: sum_i sum_{t in i} l_t / L_max  / #seqs   (Dr. GRPO)
    """
    mode = settings.loss_agg_mode
    if mode == LossAggMode.token_mean:
        count = torch.tensor(float(per_token.numel()), dtype=torch.float64)
        return per_token.sum(), count.to(per_token.device)
    n_i = torch.bincount(seq, minlength=num_seqs)  # [num_seqs]
    valid = n_i > 0
    seq_sum = torch.zeros(num_seqs, dtype=per_token.dtype, device=per_token.device)
    seq_sum = seq_sum.index_add(0, seq, per_token)
    if mode == LossAggMode.seq_mean_token_mean:
        numerator = (seq_sum[valid] / n_i[valid].to(per_token.dtype)).sum()
    elif mode == LossAggMode.seq_mean_token_sum:
        numerator = seq_sum.sum()
    elif mode == LossAggMode.seq_mean_token_sum_norm:
        numerator = seq_sum.sum() / float(settings.max_response_len)
    else:  # pragma: no cover - enum is closed
        raise ValueError(f"unknown loss_agg_mode {mode}")
    return numerator, valid.sum().to(torch.float64)


def summarize_stats(stats: torch.Tensor, loss_numerator: float, divisor: float) -> dict[str, float]:
    """Step metrics from globally reduced stat sums (``STAT_KEYS`` order)."""
    s = {k: float(stats[i]) for i, k in enumerate(STAT_KEYS)}
    tokens = max(s["tokens"], 1.0)
    ratio_mean = s["ratio"] / tokens
    ratio_var = max(s["ratio_sq"] / tokens - ratio_mean * ratio_mean, 0.0)
    return {
        "loss": loss_numerator / divisor if divisor > 0 else 0.0,
        "tokens": s["tokens"],
        "seqs": s["seqs"],
        "clip_fraction": s["clipped"] / tokens,
        "kl": s["kl"] / tokens,
        "entropy": s["entropy"] / tokens,
        "ratio_mean": ratio_mean,
        "ratio_std": math.sqrt(ratio_var),
        "is_weight_mean": s["is_weight"] / tokens,
        "is_capped_fraction": s["is_capped"] / tokens,
        "is_masked_fraction": s["is_masked"] / tokens,
        "mismatch_kl_k1": s["mismatch_k1"] / tokens,
        "mismatch_kl_k3": s["mismatch_k3"] / tokens,
        "mismatch_log_ppl_gap": s["log_ppl_gap"] / max(s["seqs"], 1.0),
        "mismatch_ess": s["w_raw"] ** 2 / (tokens * s["w_raw_sq"]) if s["w_raw_sq"] > 0 else 1.0,
        "masked_truncated": s["masked_truncated"],
        # MoE policies only (a balance loss is never 0): what the loss averaged, before the
        # coefficient model.moe_aux_loss_coeff
        **({"moe/aux_loss": s["aux"] / divisor} if s["aux"] and divisor > 0 else {}),
    }
