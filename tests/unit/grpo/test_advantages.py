"""Group advantages against a float64 reference written with the statistics module."""

import math
import random
import statistics

import pytest

from rlbatch.config.schema import AdvantageEstimator, ScaleRewards
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


def _loo_reference(rewards, g):
    out = []
    for i in range(0, len(rewards), g):
        grp = rewards[i : i + g]
        out += [r - math.fsum(grp[:k] + grp[k + 1 :]) / (g - 1) for k, r in enumerate(grp)]
    return out


@pytest.mark.parametrize("g", [2, 4, 8])
def test_rloo_is_the_leave_one_out_baseline(g):
    rng = random.Random(100 + g)
    rewards = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(g * 6)]
    got = compute_advantages(rewards, g, ScaleRewards.group, 1e-4, AdvantageEstimator.rloo)
    assert got == pytest.approx(_loo_reference(rewards, g), rel=1e-12, abs=1e-14)


def _reinforce_pp_reference(rewards, tokens, g, baseline, eps):
    """REINFORCE++: (optionally group-centred) reward, whitened over every loss token."""
    values = []
    for i in range(0, len(rewards), g):
        grp = rewards[i : i + g]
        mean = math.fsum(grp) / g if baseline else 0.0
        values += [r - mean for r in grp]
    per_token = [v for v, n in zip(values, tokens, strict=True) for _ in range(n)]
    mean, std = statistics.fmean(per_token), statistics.stdev(per_token)
    return [(v - mean) / (std + eps) for v in values]


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_is_dp_invariant_and_matches_float64(baseline):
    """The estimator's values from each rank's aggregator, then the global normalization at the
    round's first step (rlbatch.grpo.proximal): one rank or the same samples on two ranks give
    the same advantages, equal to REINFORCE++'s token-level whitening."""
    from rlbatch.grpo.proximal import normalize_over_batch
    from rlbatch.grpo.types import Prompt, Sample

    g, eps = 4, 1e-4
    est = AdvantageEstimator.reinforce_pp_baseline if baseline else AdvantageEstimator.reinforce_pp
    rng = random.Random(int(baseline))
    rewards = [rng.choice([0.0, 0.3, 1.0]) for _ in range(8 * g)]
    tokens = [rng.randint(1, 9) for _ in rewards]
    want = _reinforce_pp_reference(rewards, tokens, g, baseline, eps)

    def make():
        values = compute_advantages(rewards, g, ScaleRewards.group, eps, est)
        return [
            Sample(Prompt(0, (1,), ""), i // g, [5] * n, [-1.0] * n, False, 0, r, v)
            for i, (r, v, n) in enumerate(zip(rewards, values, tokens, strict=True))
        ]

    for dp in (1, 2):
        samples = make()
        shares = [samples[k * len(samples) // dp : (k + 1) * len(samples) // dp] for k in range(dp)]
        # the all-gather: every rank sees the values of every rank before any normalizes
        gathered = [[(s.advantage, s.num_loss_tokens) for s in x] for x in shares]
        for share in shares:  # every rank normalizes its own share with the same statistics
            normalize_over_batch(share, eps, lambda _mine, x=gathered: x)
        got = [s.advantage for s in samples]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-13)
