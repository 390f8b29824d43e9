"""The objective's families, each a table of small pure functions selected by a config enum
(docs/grpo_loss.md has every formula and its paper):

- ``POLICY_LOSSES`` (``grpo.policy_loss``): the per-token policy-gradient term;
- ``KL_ESTIMATORS`` (``grpo.kl_estimator``): the per-token estimate of KL(pi || ref);
- ``ROLLOUT_CORRECTIONS`` (``grpo.rollout_correction``): how the weight pi_old / pi_behaviour
  is applied (truncated or as a rejection mask, per token or per sequence).

Every tensor is flat ``[N]`` over the micro-batch's loss tokens, in ``loss_mask`` order; ``seq``
names each token's sample (0 .. num_seqs - 1). The aggregation over tokens and sequences
(``loss_agg_mode``) is the loss's, the same for every entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlbatch.config.enums import KLEstimator, PolicyLoss, RolloutCorrection


@dataclass(frozen=True)
class PolicyParams:
    """Hyper-parameters the policy losses read."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


@dataclass
class PolicyTerm:
    """What a policy loss returns, per loss token."""

    pg: torch.Tensor
    """[N] the policy-gradient term (with autograd), before the correction weight."""
    ratio: torch.Tensor
    """[N] the importance ratio the term uses (a sequence's ratio on each of its tokens)."""
    clipped: torch.Tensor
    """[N] bool: the clip (or the weight's clamp) is active at the token."""


def seq_sum(values: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs] sum of ``values`` over each sample's tokens."""
    out = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq, values)


def seq_mean(values: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs] mean of ``values`` over each sample's tokens (0 for a sample without any)."""
    counts = torch.bincount(seq, minlength=num_seqs).clamp(min=1).to(values.dtype)
    return seq_sum(values, seq, num_seqs) / counts


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, p: PolicyParams) -> PolicyTerm:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) = -min(r A, clip(r) A)."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - p.epsilon_low, 1.0 + p.epsilon_high)
    return PolicyTerm(torch.maximum(unclipped, clipped), ratio, clipped > unclipped)


def clip_loss(logps, old, adv, seq, num_seqs, p: PolicyParams) -> PolicyTerm:
    """PPO's clipped surrogate on the token ratio r = pi / pi_old (GRPO, DeepSeekMath
    arXiv 2402.03300; clip-higher eps_high > eps_low from DAPO arXiv 2503.14476)."""
    return _clipped_surrogate(torch.exp(logps - old), adv, p)


def gspo_loss(logps, old, adv, seq, num_seqs, p: PolicyParams) -> PolicyTerm:
    """GSPO (arXiv 2507.18071): the clipped surrogate on the sequence ratio
    s_i = exp(mean_{t in i} log(pi / pi_old)), the same on each token of sample i."""
    log_s = seq_mean(logps - old, seq, num_seqs)[seq]
    return _clipped_surrogate(torch.exp(log_s), adv, p)


def gspo_token_loss(logps, old, adv, seq, num_seqs, p: PolicyParams) -> PolicyTerm:
    """GSPO-token (arXiv 2507.18071, eq. 13): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: the
    value of s_i with the gradient of each token's own log-prob (for per-token advantages; with
    one advantage per sample it equals gspo in value and gradient)."""
    log_s = seq_mean(logps.detach() - old, seq, num_seqs)[seq]
    return _clipped_surrogate(torch.exp(logps - logps.detach() + log_s), adv, p)


def cispo_loss(logps, old, adv, seq, num_seqs, p: PolicyParams) -> PolicyTerm:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi:
    the weight is clipped and carries no gradient; every token keeps its gradient."""
    ratio = torch.exp(logps - old).detach()
    weight = torch.clamp(ratio, 1.0 - p.epsilon_low, 1.0 + p.epsilon_high)
    return PolicyTerm(-adv * weight * logps, ratio, weight != ratio)


def sapo_loss(logps, old, adv, seq, num_seqs, p: PolicyParams) -> PolicyTerm:
    """SAPO (arXiv 2511.20347): -A sigmoid(tau (r - 1)) 4 / tau, tau = sapo_tau_pos where
    A > 0 else sapo_tau_neg: a soft gate instead of the hard clip (gradient A r at r = 1)."""
    ratio = torch.exp(logps - old)
    pos = torch.full_like(adv, p.sapo_tau_pos)
    tau = torch.where(adv > 0, pos, torch.full_like(adv, p.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return PolicyTerm(-adv * gate, ratio, torch.zeros_like(ratio, dtype=torch.bool))


PolicyLossFn = Callable[..., PolicyTerm]
POLICY_LOSSES: dict[PolicyLoss, PolicyLossFn] = {
    PolicyLoss.clip: clip_loss,
    PolicyLoss.gspo: gspo_loss,
    PolicyLoss.gspo_token: gspo_token_loss,
    PolicyLoss.cispo: cispo_loss,
    PolicyLoss.sapo: sapo_loss,
}


# ------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence", 2020): x = log(ref / pi)
# ------------------------------------------------------------------------------------------


def kl_k1(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi / ref): unbiased value; its expected gradient on-policy is 0."""
    return logps - ref


def kl_k2(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k2 = (log(pi / ref))^2 / 2: its gradient is the unbiased gradient of KL(pi || ref)."""
    return 0.5 * (logps - ref) ** 2


def kl_k3(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1: unbiased, non-negative value (GRPO's estimator)."""
    x = ref - logps
    return torch.exp(x) - x - 1.0


KL_ESTIMATORS: dict[KLEstimator, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    KLEstimator.k1: kl_k1,
    KLEstimator.k2: kl_k2,
    KLEstimator.k3: kl_k3,
}


# ------------------------------------------------------------------------------------------
# Rollout corrections: log_w = log(pi_old / pi_behaviour) per token (data, no gradient)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorrectionParams:
    cap: float = 2.0
    lower: float = 0.0


def _no_correction(log_w, seq, num_seqs, c: CorrectionParams):
    """none: weight 1 everywhere."""
    return torch.ones_like(log_w), torch.zeros_like(log_w, dtype=torch.bool)


def _truncate(w: torch.Tensor, c: CorrectionParams):
    return torch.clamp(w, max=c.cap), w > c.cap


def _mask(w: torch.Tensor, c: CorrectionParams):
    keep = (w >= c.lower) & (w <= c.cap)
    return torch.where(keep, w, torch.zeros_like(w)), ~keep


def _seq_weight(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """prod_{t in i} w_t of each token's sample."""
    return torch.exp(seq_sum(log_w, seq, num_seqs))[seq]


def token_tis(log_w, seq, num_seqs, c: CorrectionParams):
    """Truncated importance sampling per token: min(w_t, cap) (IMPALA / TIS)."""
    return _truncate(torch.exp(log_w), c)


def seq_tis(log_w, seq, num_seqs, c: CorrectionParams):
    """Per sequence: min(prod_t w_t, cap) on each of its tokens."""
    return _truncate(_seq_weight(log_w, seq, num_seqs), c)


def token_mask(log_w, seq, num_seqs, c: CorrectionParams):
    """w_t where lower <= w_t <= cap, else 0 (the token is rejected)."""
    return _mask(torch.exp(log_w), c)


def seq_mask(log_w, seq, num_seqs, c: CorrectionParams):
    """prod_t w_t where it lies in [lower, cap], else 0 (the whole sequence is rejected)."""
    return _mask(_seq_weight(log_w, seq, num_seqs), c)


CorrectionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ROLLOUT_CORRECTIONS: dict[RolloutCorrection, CorrectionFn] = {
    RolloutCorrection.none: _no_correction,
    RolloutCorrection.token_tis: token_tis,
    RolloutCorrection.seq_tis: seq_tis,
    RolloutCorrection.token_mask: token_mask,
    RolloutCorrection.seq_mask: seq_mask,
}
MASK_MODES = frozenset({RolloutCorrection.token_mask, RolloutCorrection.seq_mask})
