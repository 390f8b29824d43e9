"""Group advantages against a float64 reference written with the statistics module."""

import math
import random
import statistics

import pytest

from rlbatch.config.schema import ScaleRewards
from rlbatch.grpo.advantages import compute_advantages, group_reward_stats


def reference(rewards, g, scale, eps):
    out = []
    batch_std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    for i in range(0, len(rewards), g):
        grp = rewards[i : i + g]
        mean = math.fsum(grp) / g
        std = statistics.stdev(grp) if g > 1 else 0.0
        div = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out += [(r - mean) / div for r in grp]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_matches_float64_reference(scale, g):
    rng = random.Random(g)
    rewards = [rng.choice([0.0, 0.25, 1.0, rng.random()]) for _ in range(g * 5)]
    got = compute_advantages(rewards, g, ScaleRewards(scale), 1e-4)
    want = reference(rewards, g, scale, 1e-4)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_hand_example_unbiased_std():
    # group [0, 1]: mean 0.5, unbiased std sqrt(0.5)
    got = compute_advantages([0.0, 1.0], 2, ScaleRewards.group, 0.0)
    assert got == pytest.approx([-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)])


def test_flat_group_has_zero_advantage():
    assert compute_advantages([0.3] * 4, 4, ScaleRewards.group, 1e-4) == [0.0] * 4


def test_split_group_is_an_error():
    with pytest.raises(ValueError, match="grpo.num_generations=4"):
        compute_advantages([0.0] * 6, 4, ScaleRewards.group, 1e-4)


def test_stats():
    s = group_reward_stats([0.0, 1.0, 0.5, 0.5], 2)
    assert s["reward_mean"] == 0.5
    assert s["zero_std_group_fraction"] == 0.5
    assert s["reward_std"] == pytest.approx(statistics.stdev([0.0, 1.0, 0.5, 0.5]))
