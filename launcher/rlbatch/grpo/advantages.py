"""Advantage estimators (docs/grpo_loss.md, "Advantage estimators"), selected by
``grpo.advantage_estimator`` from the table ``ADVANTAGE_ESTIMATORS`` (rewards of whole groups,
``[P, G]``, in; one advantage per sample out):

- ``grpo``: A = (r - mean_group) / (std + eps), groups = contiguous runs of `group_size`
  rewards. ``scale_rewards``: ``group`` divides by the group's std, ``batch`` by the std of the
  whole batch (rewards still centred on their group mean), ``none`` does not divide;
- ``rloo``: the leave-one-out baseline, A = r - mean of the G - 1 siblings;
- ``reinforce_pp`` / ``reinforce_pp_baseline``: r, or r - mean_group, then normalized over the
  whole generation batch of every DP rank (:func:`normalize_over_tokens`, at the round's first
  step: rlbatch.grpo.proximal).

The std is the **unbiased** one (Bessel's correction, n - 1), as TRL's ``torch.std`` and
verl's GRPO use; a group of one has std 0 (its centred reward is 0 anyway). Computed in
float64.

Episodes left out (env.on_error=skip, ``Sample.skipped``): every estimator computes over the
group's remaining members only (their mean, std, leave-one-out mean; the batch std over the
remaining rewards), a left-out member's value is 0, and a group left with fewer than 2 members
has every value 0 (no baseline to compare against: :func:`masked_advantages`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from rlbatch.config.schema import AdvantageEstimator, ScaleRewards


def _unbiased_std(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return np.zeros_like(x.mean(axis=axis))
    return x.std(axis=axis, ddof=1)


def unbiased_std(values: Sequence[float]) -> float:
    """The unbiased (n - 1) std of ``values`` in float64; 0 for fewer than two values."""
    return float(_unbiased_std(np.asarray(values, dtype=np.float64)))


def grpo_advantages(r: np.ndarray, scale: ScaleRewards, eps: float) -> np.ndarray:
    """GRPO (DeepSeekMath, arXiv 2402.03300): group-centred, divided per ``scale``."""
    centred = r - r.mean(axis=1, keepdims=True)
    if scale == ScaleRewards.group:
        return centred / (_unbiased_std(r, axis=1)[:, None] + eps)
    if scale == ScaleRewards.batch:
        return centred / (float(_unbiased_std(r.reshape(-1))) + eps)
    return centred


def rloo_advantages(r: np.ndarray, scale: ScaleRewards, eps: float) -> np.ndarray:
    """RLOO (Kool et al. 2019; Ahmadian et al., arXiv 2402.14740): r_i minus the mean of the
    other G - 1 rewards of its group, = G / (G - 1) (r_i - mean_group); 0 for a group of one."""
    g = r.shape[1]
    if g < 2:
        return np.zeros_like(r)
    return (r - r.mean(axis=1, keepdims=True)) * (g / (g - 1))


def reinforce_pp_values(r: np.ndarray, scale: ScaleRewards, eps: float) -> np.ndarray:
    """REINFORCE++ (arXiv 2501.03262): the outcome reward itself; the global normalization
    follows (:func:`normalize_over_tokens`)."""
    return r.copy()


def reinforce_pp_baseline_values(r: np.ndarray, scale: ScaleRewards, eps: float) -> np.ndarray:
    """REINFORCE++-baseline (arXiv 2501.03262): the group-centred reward; the global
    normalization follows."""
    return r - r.mean(axis=1, keepdims=True)


ADVANTAGE_ESTIMATORS: dict[
    AdvantageEstimator, Callable[[np.ndarray, ScaleRewards, float], np.ndarray]
] = {
    AdvantageEstimator.grpo: grpo_advantages,
    AdvantageEstimator.rloo: rloo_advantages,
    AdvantageEstimator.reinforce_pp: reinforce_pp_values,
    AdvantageEstimator.reinforce_pp_baseline: reinforce_pp_baseline_values,
}
GLOBALLY_NORMALIZED = frozenset(
    {AdvantageEstimator.reinforce_pp, AdvantageEstimator.reinforce_pp_baseline}
)
"""Estimators whose values are normalized over the whole generation batch (all DP ranks)."""


def masked_advantages(
    r: np.ndarray,
    member: np.ndarray,
    estimator: AdvantageEstimator,
    scale: ScaleRewards,
    eps: float,
) -> np.ndarray:
    """The estimators over each group's members only (``member`` ``[P, G]`` bool; False = an
    episode left out): n = members of the group, mean and unbiased std over them, RLOO's
    baseline the mean of the n - 1 other members, the batch std over every member of every
    group. Left-out entries are 0; so is every entry of a group with n < 2."""
    m = member.astype(np.float64)
    n = m.sum(axis=1, keepdims=True)
    alive = n >= 2
    safe_n = np.maximum(n, 1.0)
    mean = (r * m).sum(axis=1, keepdims=True) / safe_n
    centred = (r - mean) * m
    est = AdvantageEstimator(estimator)
    if est == AdvantageEstimator.reinforce_pp:
        return r * m  # no group baseline: a lone member keeps its reward
    if est == AdvantageEstimator.reinforce_pp_baseline:
        return np.where(alive, centred, 0.0)
    if est == AdvantageEstimator.rloo:
        return np.where(alive, centred * (n / np.maximum(n - 1.0, 1.0)), 0.0)
    if scale == ScaleRewards.group:
        var = (centred**2).sum(axis=1, keepdims=True) / np.maximum(n - 1.0, 1.0)
        return np.where(alive, centred / (np.sqrt(var) + eps), 0.0)
    if scale == ScaleRewards.batch:
        kept = r[member]
        std = float(kept.std(ddof=1)) if kept.size >= 2 else 0.0
        return np.where(alive, centred / (std + eps), 0.0)
    return np.where(alive, centred, 0.0)


def compute_advantages(
    rewards: Sequence[float],
    group_size: int,
    scale: ScaleRewards,
    eps: float,
    estimator: AdvantageEstimator = AdvantageEstimator.grpo,
    members: Sequence[bool] | None = None,
) -> list[float]:
    """Advantages (or, for a globally normalized estimator, the values to normalize) of
    `rewards` (contiguous groups of `group_size`), float64. ``members``: per reward, False
    for an episode left out of its group (env.on_error=skip; :func:`masked_advantages`);
    None or all True = every reward counts."""
    if group_size <= 0 or len(rewards) % group_size:
        raise ValueError(
            f"{len(rewards)} rewards do not form whole groups of grpo.num_generations="
            f"{group_size}: a GRPO group must never be split"
        )
    if not rewards:
        return []
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)  # [P, G]
    if members is not None and not all(members):
        if len(members) != len(rewards):
            raise ValueError(f"{len(members)} member flags for {len(rewards)} rewards")
        member = np.asarray(members, dtype=bool).reshape(-1, group_size)
        out = masked_advantages(r, member, estimator, ScaleRewards(scale), eps)
        return [float(a) for a in out.reshape(-1)]
    out = ADVANTAGE_ESTIMATORS[AdvantageEstimator(estimator)](r, ScaleRewards(scale), eps)
    return [float(a) for a in out.reshape(-1)]


def normalize_over_tokens(
    values: Sequence[float], tokens: Sequence[int], eps: float
) -> tuple[float, float]:
    """(mean, std) of per-sample ``values`` over the batch's loss tokens (each sample counted
    once per token it trains, as REINFORCE++ whitens its per-token returns); the unbiased std.
    The advantage is then (value - mean) / (std + eps)."""
    v = np.asarray(values, dtype=np.float64)
    n = np.asarray(tokens, dtype=np.float64)
    total = n.sum()
    if total <= 0:
        return 0.0, 0.0
    mean = float((v * n).sum() / total)
    var = float((n * (v - mean) ** 2).sum() / max(total - 1.0, 1.0))
    return mean, math.sqrt(var)


def group_reward_stats(rewards: Sequence[float], group_size: int) -> dict[str, float]:
    """Metrics: reward mean/std over the batch, fraction of groups with zero reward spread."""
    if not rewards:
        return {"reward_mean": 0.0, "reward_std": 0.0, "zero_std_group_fraction": 0.0}
    r = np.asarray(rewards, dtype=np.float64)
    groups = r.reshape(-1, group_size)
    flat = groups.max(axis=1) == groups.min(axis=1)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(_unbiased_std(r)),
        "zero_std_group_fraction": float(flat.mean()),
    }
