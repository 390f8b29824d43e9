"""Evaluation metrics against direct references: pass@k by enumerating every k-subset of the
samples (the probability that a random subset holds a correct one), majority vote by counting,
best-checkpoint selection by hand."""

from __future__ import annotations

import itertools
import random

import pytest

from rlbatch.config.schema import BuiltinTask, RewardKind
from rlbatch.eval.answers import answer_fn, voting_kind
from rlbatch.eval.metrics import (
    PromptResult,
    ScoredSample,
    best_step,
    is_new_best,
    majority_answer,
    metric_names,
    pass_at_k,
    summarize,
)
from rlbatch.grpo.rewards import RewardInput


def _subsets_pass(flags: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_a_k_subset_holds_a_correct_sample(n):
    for c in range(n + 1):
        flags = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_subsets_pass(flags, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 5)


def _sample(answer, correct, reward=None, tokens=3):
    r = float(correct) if reward is None else reward
    return ScoredSample("t", r, correct, tokens, False, answer)


def test_majority_vote_takes_the_most_frequent_answer_first_seen_on_ties():
    votes = [_sample("7", False), _sample("5", True), _sample("5", True), _sample("7", False)]
    assert majority_answer(votes).answer == "7"  # 2 - 2: "7" came first
    assert majority_answer(votes[1:]).answer == "5"
    assert majority_answer([_sample(None, True)]) is None


def test_summarize_averages_over_prompts():
    rng = random.Random(0)
    results = []
    for i in range(6):
        samples = []
        for _ in range(4):
            answer = rng.choice(["1", "2", None])
            samples.append(
                _sample(answer, answer == "1", reward=rng.random(), tokens=rng.randint(1, 9))
            )
        results.append(PromptResult(i, f"p{i}", "1", tuple(samples)))
    out = summarize(results, [1, 3], majority=True)
    assert list(out) == metric_names([1, 3], 4, True)
    flat = [s for r in results for s in r.samples]
    assert out["eval/reward_mean"] == pytest.approx(sum(s.reward for s in flat) / 24)
    for k in (1, 3):
        ref = sum(_subsets_pass([s.correct for s in r.samples], k) for r in results) / 6
        assert out[f"eval/pass@{k}"] == pytest.approx(ref, abs=1e-12)
    assert out["eval/mean@4"] == pytest.approx(sum(s.correct for s in flat) / 24)
    maj = 0
    for r in results:
        answers = [s.answer for s in r.samples if s.answer is not None]
        if answers:
            top = max(answers.count(a) for a in answers)
            maj += next(a for a in answers if answers.count(a) == top) == "1"
    assert out["eval/maj@4"] == pytest.approx(maj / 6)
    assert out["eval/response_len_mean"] == pytest.approx(sum(s.num_tokens for s in flat) / 24)
    assert "eval/maj@4" not in summarize(results, [1], majority=False)


def test_best_step_and_new_best():
    records = [
        {"step": 0, "m": 9.0},
        {"step": 2, "m": 0.5},
        {"step": 4, "m": 0.7},
        {"step": 5},
        {"step": 6, "m": 0.7},
    ]
    assert best_step(records, "m", "max", [2, 4, 6]) == 4  # ties: the earliest
    assert best_step(records, "m", "max", [2, 6]) == 6  # only checkpointed steps count
    assert (
        best_step(records, "m", "min", [0, 4]) == 4 and best_step(records, "m", "max", [0, 4]) == 0
    )
    assert best_step(records, "m", "max", [5]) is None
    assert is_new_best(records, "m", "max", 0.8) and not is_new_best(records, "m", "max", 0.7)
    assert is_new_best(records, "m", "min", 0.4) and not is_new_best(records, "m", "min", 0.6)
    assert is_new_best(records[:1], "m", "max", 0.0)  # step 0 is no trained checkpoint


def test_answers_the_rewards_grade():
    x = RewardInput("p", " so \\boxed{\\frac{3}{6}} ", "1/2", 5)
    assert answer_fn(voting_kind(RewardKind.math, []), BuiltinTask.digit_copy)(x) == "1/2"
    assert (
        answer_fn(RewardKind.exact_match, BuiltinTask.digit_copy)(x) == "so \\boxed{\\frac{3}{6}}"
    )
    assert answer_fn(RewardKind.task, BuiltinTask.target_length)(x) == "5"
    assert voting_kind(RewardKind.format, []) is None
    assert voting_kind(RewardKind.format, ["my.py:fn", "math"]) == RewardKind.math
    assert voting_kind(RewardKind.math, ["my.py:fn"]) is None


def test_harness_errors_are_counted_and_left_out_of_the_reward_mean_under_skip():
    """Two prompts x 2 samples: a crash scored 0 beside wrong answers scored -1. Counted in
    eval/env_errors; under env.on_error=skip the reward mean is the other samples' (-1), not
    raised by the crash; under zero_reward the crash weighs its 0."""
    crash = ScoredSample("", 0.0, False, 3, False, error="harness h.py:run raised ValueError")
    wrong = ScoredSample("7", -1.0, False, 3, False)
    right = ScoredSample("4", 1.0, True, 3, False)
    results = [PromptResult(0, "p", "4", (crash, wrong)), PromptResult(1, "q", "4", (wrong, right))]
    skip = summarize(results, [1], majority=False, errors=True, skip_errors=True)
    assert list(skip) == metric_names([1], 2, False, errors=True)
    assert skip["eval/env_errors"] == 1.0
    assert skip["eval/reward_mean"] == pytest.approx((-1.0 - 1.0 + 1.0) / 3)
    zero = summarize(results, [1], majority=False, errors=True)
    assert zero["eval/reward_mean"] == pytest.approx((0.0 - 1.0 - 1.0 + 1.0) / 4)
    assert zero["eval/mean@2"] == pytest.approx(0.25)
    assert "eval/env_errors" not in summarize(results, [1], majority=False)
