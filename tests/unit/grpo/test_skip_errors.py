"""env.on_error=skip: an episode its environment or harness failed on is left out of its
group's baseline and scale under every advantage estimator (against float64 references written
with the statistics module), carries no loss (none of its tokens, split segments included, in
the loss or a normalization divisor), and the zero-advantage guard and grpo.filter_groups see a
group of fewer than 2 remaining episodes as teaching nothing."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from rlbatch.batching.plan import MicroBatch
from rlbatch.config.schema import AdvantageEstimator, ScaleRewards
from rlbatch.grpo.advantages import compute_advantages
from rlbatch.grpo.distill import zero_advantage
from rlbatch.grpo.loss import build_grpo_batch
from rlbatch.grpo.proximal import normalize_over_batch, scale_by_batch_std
from rlbatch.grpo.stages import add_episode_rewards
from rlbatch.grpo.types import Prompt, Sample, trained_samples
from rlbatch.train.episodes import groups_untrained
from rlbatch.train.filtering import teaching_groups

EPS = 1e-4
G = 4
# 5 groups of 4: all members; one errored; two errored; three errored (a lone member); all errored
MEMBERS = [True] * 4 + [True, False, True, True] + [False, True, True, False]
MEMBERS += [False, False, True, False] + [False] * 4


def _rewards(seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.choice([-1.0, 0.5, 1.0, rng.uniform(-1, 1)]) for _ in MEMBERS]


def _reference(rewards, members, estimator, scale):
    """Per group: statistics over its members only; 0 for a left-out one and for a group of
    fewer than 2 members (reinforce_pp: a lone member keeps its reward)."""
    kept_all = [r for r, m in zip(rewards, members, strict=True) if m]
    batch_std = statistics.stdev(kept_all)
    out = []
    for i in range(0, len(rewards), G):
        grp = [r for r, m in zip(rewards[i : i + G], members[i : i + G], strict=True) if m]
        n = len(grp)
        for r, m in zip(rewards[i : i + G], members[i : i + G], strict=True):
            if not m:
                out.append(0.0)
            elif estimator == "reinforce_pp":
                out.append(r)
            elif n < 2:
                out.append(0.0)
            elif estimator == "rloo":
                others = list(grp)
                others.remove(r)
                out.append(r - math.fsum(others) / (n - 1))
            else:
                centred = r - math.fsum(grp) / n
                if estimator == "grpo" and scale == "group":
                    centred /= statistics.stdev(grp) + EPS
                elif estimator == "grpo" and scale == "batch":
                    centred /= batch_std + EPS
                out.append(centred)
    return out


@pytest.mark.parametrize(
    "estimator,scale",
    [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("rloo", "group"),
     ("reinforce_pp", "group"), ("reinforce_pp_baseline", "group")],
)  # fmt: skip
def test_advantages_count_only_the_remaining_members(estimator, scale):
    rewards = _rewards(sum(map(ord, estimator + scale)))  # a fixed seed per case
    got = compute_advantages(
        rewards, G, ScaleRewards(scale), EPS, AdvantageEstimator(estimator), members=MEMBERS
    )
    want = _reference(rewards, MEMBERS, estimator, scale)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
    # an errored member's reward (0 under zero_reward, or anything) moves nobody's advantage
    moved = [r if m else 1e6 for r, m in zip(rewards, MEMBERS, strict=True)]
    assert compute_advantages(
        moved, G, ScaleRewards(scale), EPS, AdvantageEstimator(estimator), members=MEMBERS
    ) == pytest.approx(got, rel=1e-12, abs=1e-12)


def test_all_members_is_the_unmasked_computation():
    rewards = _rewards(7)
    for est in AdvantageEstimator:
        plain = compute_advantages(rewards, G, ScaleRewards.group, EPS, est)
        assert compute_advantages(rewards, G, ScaleRewards.group, EPS, est, [True] * 20) == plain


def _sample(group: int, reward: float, n: int = 3, error: bool = False) -> Sample:
    episode = {"reward": reward, "end": "error" if error else "done"}
    return Sample(Prompt(0, (1, 2), ""), group, [7] * n, [-1.0] * n, False, 0, episode=episode)


def _scored(members, rewards, tokens):
    samples = [
        _sample(i // G, r, n, error=not m)
        for i, (m, r, n) in enumerate(zip(members, rewards, tokens, strict=True))
    ]
    totals = add_episode_rewards(samples, [0.0] * len(samples), skip_errors=True)
    for s, t in zip(samples, totals, strict=True):
        s.reward = t
    return samples


def test_the_batch_scale_and_reinforce_pp_statistics_leave_errored_episodes_out():
    rng = random.Random(3)
    rewards = _rewards(3)
    tokens = [rng.randint(1, 6) for _ in rewards]
    # scale_rewards=batch at the round's first step: the std of the remaining rewards only
    samples = _scored(MEMBERS, rewards, tokens)
    centred = compute_advantages(
        [s.reward for s in samples], G, ScaleRewards.none, EPS, members=MEMBERS
    )
    for s, a in zip(samples, centred, strict=True):
        s.advantage = a
    std = scale_by_batch_std(samples, EPS, lambda mine: [mine])
    kept = [r for r, m in zip(rewards, MEMBERS, strict=True) if m]
    assert std == pytest.approx(statistics.stdev(kept), rel=1e-12)
    want = _reference(rewards, MEMBERS, "grpo", "batch")
    assert [s.advantage for s in samples] == pytest.approx(want, rel=1e-12, abs=1e-12)
    # REINFORCE++: whitened over the remaining episodes' tokens; an errored one stays at 0
    samples = _scored(MEMBERS, rewards, tokens)
    values = compute_advantages(
        [s.reward for s in samples], G, ScaleRewards.group, EPS, AdvantageEstimator.reinforce_pp,
        members=MEMBERS,
    )  # fmt: skip
    for s, v in zip(samples, values, strict=True):
        s.advantage = v
    normalize_over_batch(samples, EPS, lambda mine: [mine])
    weighted = [(r, n) for r, n, m in zip(rewards, tokens, MEMBERS, strict=True) if m]
    total = sum(n for _, n in weighted)
    mean = math.fsum(r * n for r, n in weighted) / total
    sd = math.sqrt(math.fsum(n * (r - mean) ** 2 for r, n in weighted) / (total - 1))
    want = [(r - mean) / (sd + EPS) if m else 0.0 for r, m in zip(rewards, MEMBERS, strict=True)]
    assert [s.advantage for s in samples] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_an_errored_episode_carries_no_loss_in_any_of_its_segments():
    row = _sample(0, 1.0, n=3, error=True)
    row.token_advantages = [0.5, -0.5, 1.0]
    earlier = _sample(0, 0.0, n=2)
    earlier.episode = None
    row.earlier_segments = [earlier]
    kept = _sample(0, 1.0, n=3)
    totals = add_episode_rewards([row, kept], [0.25, 0.25], skip_errors=True)
    assert totals == [0.0, 1.25]
    assert row.skipped and not kept.skipped
    assert row.loss_mask == [0, 0, 0] and earlier.loss_mask == [0, 0]
    assert row.token_advantages == [0.0, 0.0, 0.0]
    row.advantage, kept.advantage = 0.0, 0.7
    trained = trained_samples([row, kept])
    assert [s.skipped for s in trained] == [True, False, True]
    assert zero_advantage(row, 1.0) and not zero_advantage(kept, 1.0)
    lengths = tuple(s.length for s in trained)
    mb = MicroBatch((0, 1, 2), lengths, 8, 3 * 8, sum(lengths))
    batch, _ = build_grpo_batch(trained, mb, round_to=4, dtype=torch.float64)
    # only `kept`'s 3 tokens carry loss (every divisor counts the mask: token or sequence)
    assert batch.loss_mask.sum().item() == 3 and batch.loss_mask[1].sum().item() == 3
    # zero_reward (no skip): the same episode is trained on its 0
    again = _sample(0, 1.0, n=3, error=True)
    assert add_episode_rewards([again], [0.25]) == [0.0]
    assert not again.skipped and again.loss_mask == [1, 1, 1]


def test_filter_groups_and_the_untrained_group_count_see_the_remaining_members():
    rewards = [1.0, 0.0, 1.0, 1.0] + [1.0, 0.0, 0.0, 0.0] + [1.0, -1.0, 0.0, 0.0]
    members = [True, False, True, True] + [True, False, False, False] + [True] * 4
    samples = _scored(members, rewards, [2] * 12)
    # group 0: the remaining rewards are all 1 (the errored 0 would make a spread)
    # group 1: one remaining episode; group 2: no error, a spread
    assert teaching_groups(samples, G) == [False, False, True]
    assert groups_untrained(samples) == 1


def test_pure_distillation_leaves_errored_episodes_out_too():
    """grpo.distill.reward_coef=0 runs no reward function; the teacher's per-token advantage of
    an errored episode would still train it."""
    from rlbatch.grpo.stages import make_no_rewards

    for skip in (False, True):
        failed, fine = _sample(0, 0.0, error=True), _sample(0, 0.0)
        for s in (failed, fine):
            s.token_advantages = [0.5, -0.5, 1.0]
        assert make_no_rewards(skip)([failed, fine]) == [0.0, 0.0]
        assert failed.skipped == skip and not fine.skipped
        assert failed.token_advantages == ([0.0] * 3 if skip else [0.5, -0.5, 1.0])
        assert failed.loss_mask == ([0] * 3 if skip else [1] * 3)
        assert fine.token_advantages == [0.5, -0.5, 1.0] and fine.loss_mask == [1] * 3
