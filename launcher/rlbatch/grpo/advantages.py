"""Group-relative advantages (docs/grpo_loss.md).

A = (r - mean_group) / (std + eps), groups = contiguous runs of `group_size` rewards.
``scale_rewards``: ``group`` divides by the group's std, ``batch`` by the std of the whole
batch (rewards still centred on their group mean), ``none`` does not divide.

The std is the **unbiased** one (Bessel's correction, n - 1), as TRL's ``torch.std`` and
verl's GRPO use; a group of one has std 0 (its centred reward is 0 anyway). Computed in
float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlbatch.config.schema import ScaleRewards


def _unbiased_std(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return np.zeros_like(x.mean(axis=axis))
    return x.std(axis=axis, ddof=1)


def unbiased_std(values: Sequence[float]) -> float:
    """The unbiased (n - 1) std of ``values`` in float64; 0 for fewer than two values."""
    return float(_unbiased_std(np.asarray(values, dtype=np.float64)))


def compute_advantages(
    rewards: Sequence[float], group_size: int, scale: ScaleRewards, eps: float
) -> list[float]:
    """Advantages of `rewards` (contiguous groups of `group_size`), float64."""
    if group_size <= 0 or len(rewards) % group_size:
        raise ValueError(
            f"{len(rewards)} rewards do not form whole groups of grpo.num_generations="
            f"{group_size}: a GRPO group must never be split"
        )
    if not rewards:
        return []
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)  # [P, G]
    centred = r - r.mean(axis=1, keepdims=True)
    scale = ScaleRewards(scale)
    if scale == ScaleRewards.group:
        centred = centred / (_unbiased_std(r, axis=1)[:, None] + eps)
    elif scale == ScaleRewards.batch:
        centred = centred / (float(_unbiased_std(r.reshape(-1))) + eps)
    return [float(a) for a in centred.reshape(-1)]


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
