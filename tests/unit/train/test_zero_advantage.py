"""Rewards out of bounds and steps that learn nothing: an environment's episode reward that is
not finite or over data.reward_abs_max counts as 0 with an out_of_range failure; the guard
stops a run after grpo.max_zero_advantage_steps steps in a row whose every advantage is 0,
saying why and what to change, and a resumed run counts on from its history."""

from __future__ import annotations

import math

import pytest

from rlbatch.grpo.stages import add_episode_rewards
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.train.health import ZeroAdvantageError, ZeroAdvantageGuard


def _sample(env_reward: float | None) -> Sample:
    episode = None if env_reward is None else {"reward": env_reward, "end": "done"}
    return Sample(Prompt(0, (1,), ""), 0, [5], [-1.0], False, 0, episode=episode)


def test_an_environment_reward_out_of_bounds_counts_as_zero_and_is_a_failure():
    samples = [_sample(r) for r in (0.5, 1e300, math.inf, math.nan, -2e6, None)]
    totals = add_episode_rewards(samples, [1.0] * len(samples), abs_max=1e6)
    assert totals == [1.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [s.metrics.get("reward_fail/out_of_range", 0.0) for s in samples] == [0, 1, 1, 1, 1, 0]
    assert [s.metrics.get("reward/env") for s in samples] == [0.5, 0.0, 0.0, 0.0, 0.0, None]
    assert samples[1].reward_failures[0].startswith("env: out_of_range: the environment's reward")
    assert "data.reward_abs_max" in samples[1].reward_failures[0]
    # without a bound (the default) only non-finite rewards are refused
    assert add_episode_rewards([_sample(1e300)], [0.0]) == [1e300]


def _record(step: int, frac: float, **extra: float) -> dict:
    return {"step": step, "advantage_zero_frac": frac, "reward_mean": 0.0, **extra}


def test_the_guard_stops_after_the_limit_of_steps_in_a_row_saying_why():
    guard = ZeroAdvantageGuard(3)
    for step, frac in enumerate([1.0, 1.0, 0.5, 1.0, 1.0], start=1):
        guard.observe(_record(step, frac))  # a step with a spread starts the count again
    with pytest.raises(ZeroAdvantageError) as err:
        guard.observe(_record(6, 1.0, **{"reward_fail/out_of_range": 8.0}))
    message = str(err.value)
    assert message.startswith("every advantage was 0 at steps 4..6 (3 steps in a row)")
    assert "{'reward_fail/out_of_range': 8.0}" in message
    assert "raise grpo.max_zero_advantage_steps (now 3), set it to 0 to never stop" in message
    assert "grpo.filter_groups=zero_variance" in message


def test_the_guard_is_off_at_zero_and_a_resumed_run_counts_on_from_its_history():
    off = ZeroAdvantageGuard(0)
    for step in range(1, 100):
        off.observe(_record(step, 1.0))
    resumed = ZeroAdvantageGuard(3, history=[_record(1, 0.0), _record(2, 1.0), _record(3, 1.0)])
    with pytest.raises(ZeroAdvantageError, match="at steps 2..4"):
        resumed.observe(_record(4, 1.0))


def test_under_pure_distillation_the_guard_blames_the_teacher_not_the_rewards():
    """A pure distillation record has no reward_mean (no reward is computed)."""
    guard = ZeroAdvantageGuard(2)
    guard.observe({"step": 1, "advantage_zero_frac": 1.0, "distill/teacher_kl": 0.0})
    with pytest.raises(ZeroAdvantageError) as err:
        guard.observe({"step": 2, "advantage_zero_frac": 1.0, "distill/teacher_kl": 0.0})
    message = str(err.value)
    assert "pure distillation (grpo.distill.reward_coef=0)" in message
    assert "grpo.distill.teacher is not the student itself" in message
    assert "rewards were equal" not in message and "filter_groups" not in message
    # a served teacher: the key is grpo.distill.teacher_url, and the likely cause a rollout server
    served = ZeroAdvantageGuard(1, teacher_key="grpo.distill.teacher_url")
    with pytest.raises(ZeroAdvantageError) as err:
        served.observe({"step": 1, "advantage_zero_frac": 1.0, "distill/teacher_kl": 0.0})
    assert "Check that grpo.distill.teacher_url is not a rollout server" in str(err.value)
    assert "grpo.distill.teacher is not" not in str(err.value)
