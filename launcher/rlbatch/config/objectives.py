"""The objective keys of ``grpo`` (policy loss, KL and entropy terms, advantage estimator,
rollout-mismatch correction, overlong shaping, dynamic sampling): a base of GRPOConfig, so the
user-facing keys are ``grpo.<field>``. docs/grpo_loss.md has the formulas and their papers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlbatch.config.enums import (
    AdvantageEstimator,
    FilterGroups,
    KLEstimator,
    PolicyLoss,
    RolloutCorrection,
)
from rlbatch.config.errors import ConfigError


@dataclass
class ObjectiveConfig:
    policy_loss: PolicyLoss = PolicyLoss.clip
    """Per-token policy term: clip (PPO/GRPO), gspo (sequence-level ratio, GSPO), gspo_token
    (its token-level form), cispo (clipped stop-gradient weight times log-prob, MiniMax-M1),
    sapo (soft sigmoid gate, SAPO)."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for tokens with a positive advantage."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for tokens with a negative advantage."""
    kl_estimator: KLEstimator = KLEstimator.k3
    """Estimator of KL(pi || ref) added with grpo.beta: k1 = log(pi/ref), k2 = (log(pi/ref))^2 / 2,
    k3 = ref/pi - log(ref/pi) - 1."""
    kl_bias_correction: bool = False
    """Multiply the KL term by the importance ratio pi / pi_old (TRL's use_bias_correction_kl):
    with k3 its gradient is then the unbiased gradient of KL(pi || ref)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef * the per-token entropy (0 = off)."""
    advantage_estimator: AdvantageEstimator = AdvantageEstimator.grpo
    """grpo (group-centred, scaled by grpo.scale_rewards), rloo (leave-one-out baseline),
    reinforce_pp (REINFORCE++: the reward normalized over the generation batch of every DP
    rank), reinforce_pp_baseline (the group-centred reward, then the same normalization)."""
    rollout_correction: RolloutCorrection = RolloutCorrection.token_tis
    """How the weight pi_old / pi_behaviour (rollout-mismatch and staleness correction) is
    applied: none (pi_old = pi_behaviour, no weight), token_tis / seq_tis (truncated at
    rollout_correction_cap), token_mask / seq_mask (0 outside [rollout_correction_lower,
    rollout_correction_cap])."""
    rollout_correction_cap: float = 2.0
    """Upper bound of the weight pi_old / pi_behaviour: the truncation (tis) or the mask's upper
    bound (mask modes)."""
    rollout_correction_lower: float = 0.0
    """Lower bound of the mask modes: a weight below it masks the token / sequence (0 = none)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: a response longer than rollout.max_new_tokens - this many tokens
    is penalized linearly, up to -overlong_penalty_factor at the limit (0 = off)."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at rollout.max_new_tokens (reward part ``overlong``)."""
    filter_groups: FilterGroups = FilterGroups.none
    """DAPO dynamic sampling: zero_variance drops groups whose rewards are all equal and fills
    the step's batch exactly with groups of further prompts."""
    max_generation_rounds: int = 8
    """With filter_groups: the most extra generation rounds a step may draw before the run
    stops with an error (the data gives too few groups with a reward spread)."""
    max_zero_advantage_steps: int = 20
    """Stop the run with an error after this many optimizer steps in a row whose every
    advantage is 0 (rewards equal within every group: nothing is learnt); 0 = never."""


def objective_errors(cfg: Any) -> list[ConfigError]:
    """Every problem of the objective keys of a RunConfig (each naming key, value and fix)."""
    g, errors = cfg.grpo, []
    for key, value in (
        ("grpo.sapo_tau_pos", g.sapo_tau_pos),
        ("grpo.sapo_tau_neg", g.sapo_tau_neg),
        ("grpo.rollout_correction_cap", g.rollout_correction_cap),
        ("grpo.max_generation_rounds", g.max_generation_rounds),
    ):
        if value <= 0:
            errors.append(ConfigError(key, value, "must be positive"))
    for key, value in (
        ("grpo.entropy_coef", g.entropy_coef),
        ("grpo.rollout_correction_lower", g.rollout_correction_lower),
        ("grpo.overlong_buffer_len", g.overlong_buffer_len),
        ("grpo.overlong_penalty_factor", g.overlong_penalty_factor),
    ):
        if value < 0:
            errors.append(ConfigError(key, value, "must be >= 0"))
    if g.rollout_correction_lower >= g.rollout_correction_cap > 0:
        errors.append(
            ConfigError(
                "grpo.rollout_correction_lower",
                g.rollout_correction_lower,
                f"must be below grpo.rollout_correction_cap = {g.rollout_correction_cap} (the "
                "mask modes keep weights in [lower, cap])",
            )
        )
    if g.overlong_buffer_len > cfg.rollout.max_new_tokens:
        errors.append(
            ConfigError(
                "grpo.overlong_buffer_len",
                g.overlong_buffer_len,
                f"must be <= rollout.max_new_tokens = {cfg.rollout.max_new_tokens} (the penalty "
                "ramps over the last overlong_buffer_len tokens before the limit)",
            )
        )
    return errors


def objective_warnings(cfg: Any) -> list[str]:
    """A warning for each objective key set away from its default where the run ignores it."""
    g, default = cfg.grpo, ObjectiveConfig()
    masking = g.rollout_correction in (RolloutCorrection.token_mask, RolloutCorrection.seq_mask)
    ignored = {
        "sapo_tau_pos": (g.policy_loss != PolicyLoss.sapo, "grpo.policy_loss is not sapo"),
        "sapo_tau_neg": (g.policy_loss != PolicyLoss.sapo, "grpo.policy_loss is not sapo"),
        "kl_bias_correction": (g.beta == 0, "grpo.beta=0"),
        "rollout_correction_lower": (not masking, "only the mask modes have a lower bound"),
        "overlong_penalty_factor": (g.overlong_buffer_len == 0, "grpo.overlong_buffer_len=0"),
        "max_generation_rounds": (g.filter_groups == FilterGroups.none, "grpo.filter_groups=none"),
    }
    out = [
        f"grpo.{key}={getattr(g, key)} is ignored: {why}"
        for key, (unused, why) in ignored.items()
        if unused and getattr(g, key) != getattr(default, key)
    ]
    if g.advantage_estimator != AdvantageEstimator.grpo and g.scale_rewards != "group":
        out.append(
            f"grpo.scale_rewards={g.scale_rewards.value} is ignored: it scales the grpo "
            f"advantage estimator only (grpo.advantage_estimator={g.advantage_estimator.value})"
        )
    if cfg.debug.perturb_behaviour_logps > 0:
        out.append(
            f"debug.perturb_behaviour_logps={cfg.debug.perturb_behaviour_logps}: the behaviour "
            "log-probs are perturbed on purpose (a test aid): do not train a real model so"
        )
    return out
