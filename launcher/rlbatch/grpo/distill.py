"""On-policy distillation's per-token advantage (docs/grpo_loss.md, "On-policy distillation").

The student samples; a teacher scores each sampled token y_t; the advantage of the token is

    D_t = coef * clamp(log pi_teacher(y_t) - log pi_behaviour(y_t), -clip, clip)

(the behaviour log-prob is the sampling policy's, the same number the rollout correction reads).
On the student's own samples its expectation is minus the reverse KL(student || teacher) per
token: maximizing it moves the student towards the teacher where the student actually goes
(Agarwal et al., GKD, arXiv 2306.13649; Qwen3's on-policy distillation). Tokens outside the loss
(multi-turn observations) get 0: they were not sampled. The loss adds D_t to the group reward
advantage times grpo.distill.reward_coef on each token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from rlbatch.config.enums import DistillEstimator
from rlbatch.grpo.types import Sample

KL_SUM = "distill/kl_sum"
"""Sample metric: the sum over its sampled tokens of log pi_behaviour - log pi_teacher."""
TOKENS = "distill/tokens"
"""Sample metric: its scored (sampled) tokens."""
CLIPPED = "distill/clipped"
"""Sample metric: its tokens whose difference grpo.distill.clip clamped."""
SECONDS = "distill/seconds"
"""Sample metric: its share of the teacher pass's seconds (the pass's time / its samples)."""


@dataclass(frozen=True)
class DistillSettings:
    """grpo.distill's coefficients (rlbatch.config.distill)."""

    coef: float = 1.0
    reward_coef: float = 1.0
    clip: Optional[float] = None
    estimator: DistillEstimator = DistillEstimator.reverse_kl

    @classmethod
    def from_config(cls, cfg: Any) -> DistillSettings:
        d = cfg.grpo.distill
        return cls(d.coef, d.reward_coef, d.clip, DistillEstimator(d.kl_estimator))


def reverse_kl_advantage(
    teacher: float, behaviour: float, clip: Optional[float]
) -> tuple[float, bool]:
    """(clamped teacher - behaviour log-prob, whether the clamp acted)."""
    diff = teacher - behaviour
    if clip is None or -clip <= diff <= clip:
        return diff, False
    return math.copysign(clip, diff), True


ESTIMATORS = {DistillEstimator.reverse_kl: reverse_kl_advantage}


def apply_teacher(
    samples: Sequence[Sample],
    teacher_logps: Sequence[Sequence[float]],
    settings: DistillSettings,
    seconds: float = 0.0,
) -> None:
    """Set each sample's ``token_advantages`` (coef * D_t on sampled tokens, 0 elsewhere) and
    its distillation metrics from the teacher's log-probs of its response tokens."""
    fn = ESTIMATORS[settings.estimator]
    share = seconds / max(len(samples), 1)
    for s, lps in zip(samples, teacher_logps, strict=True):
        assert s.loss_mask is not None
        adv, kl, clipped = [], 0.0, 0
        for t_lp, b_lp, m in zip(lps, s.behaviour_logps, s.loss_mask, strict=True):
            if not m:
                adv.append(0.0)
                continue
            d, hit = fn(float(t_lp), float(b_lp), settings.clip)
            adv.append(settings.coef * d)
            kl += float(b_lp) - float(t_lp)
            clipped += hit
        s.token_advantages = adv
        s.metrics[KL_SUM] = kl
        s.metrics[TOKENS] = float(s.num_loss_tokens)
        s.metrics[CLIPPED] = float(clipped)
        s.metrics[SECONDS] = share


ZERO_TOLERANCE = 1e-5
"""Nats: a teacher log-prob within this of the behaviour log-prob on every sampled token of a
sample teaches it nothing (the zero-advantage guard counts it as 0). Two fp32 engines computing
the same model's log-probs (vLLM's kernels and megatron's, or megatron at two layouts) differ by
up to a few 1e-6 nats, so a teacher that is the student gives such noise, never exact zeros,
and Adam would turn that noise into full-size steps away from the teacher."""


def zero_advantage(sample: Sample, reward_coef: float, coef: float = 1.0) -> bool:
    """The sample teaches nothing: its combined advantage reward_coef * A + D_t is 0 on every
    token (what the zero-advantage guard counts); each teacher advantage coef * D_t counts as 0
    when |D_t| is within :data:`ZERO_TOLERANCE` (numeric noise of a teacher equal to the
    behaviour policy)."""
    if reward_coef != 0.0 and sample.advantage != 0.0:
        return False
    bound = ZERO_TOLERANCE * abs(coef)
    return all(abs(a) <= bound for a in sample.token_advantages or ())


def distill_metrics(sums: Sequence[float], num_ranks: int) -> dict[str, float]:
    """The step's distillation metrics from the DP sums of (KL_SUM, TOKENS, CLIPPED, SECONDS)
    over its samples: mean per-token reverse KL, clamped fraction, teacher-pass seconds per
    rank."""
    kl, tokens, clipped, seconds = sums
    return {
        "distill/teacher_kl": kl / max(tokens, 1.0),
        "distill/clip_frac": clipped / max(tokens, 1.0),
        "distill/teacher_seconds": seconds / max(num_ranks, 1),
    }


def sample_sums(samples: Sequence[Sample]) -> list[float]:
    """This rank's (KL_SUM, TOKENS, CLIPPED, SECONDS) over ``samples``."""
    return [sum(s.metrics.get(k, 0.0) for s in samples) for k in (KL_SUM, TOKENS, CLIPPED, SECONDS)]
