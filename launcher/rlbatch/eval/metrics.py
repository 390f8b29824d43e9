"""Metrics of one evaluation, pure (no torch): every prompt got N scored samples.

- ``pass@k``: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code"): for a prompt with c correct of n samples, 1 - C(n-c, k) / C(n, k), the
  chance that k samples drawn without replacement hold at least one correct one; averaged over
  prompts.
- ``mean@N``: the fraction of correct samples, averaged over prompts (the expected accuracy of
  one sample, which is also pass@1).
- ``maj@N``: majority vote: the answer most samples of a prompt give (ties: the one given
  first) decides; the prompt counts when that answer is correct. Only where the reward can
  extract an answer (rlbatch.eval.answers).
- ``reward_mean`` and ``response_len_mean``: over every sample.

A sample is correct when its reward is above ``eval.correct_threshold``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

PREFIX = "eval/"
"""Every evaluation metric's name starts with it (metrics.jsonl, TensorBoard, wandb)."""


@dataclass(frozen=True)
class ScoredSample:
    """One sample of an evaluation prompt, scored."""

    text: str
    """Decoded response, EOS excluded."""
    reward: float
    correct: bool
    num_tokens: int
    """Response tokens (EOS included when produced)."""
    truncated: bool
    """Ended at the token limit without EOS."""
    answer: Optional[str] = None
    """The answer the reward grades (majority vote); None when none could be read."""
    error: Optional[str] = None
    """Why its episode failed (an agent harness's error under env.on_error=zero_reward or
    skip); None when it did not. An errored sample is never correct."""


@dataclass(frozen=True)
class PromptResult:
    """Every sample of one evaluation prompt."""

    index: int
    """Position of the prompt in the evaluation set."""
    prompt: str
    reference: str
    samples: tuple[ScoredSample, ...]

    @property
    def num_correct(self) -> int:
        return sum(1 for s in self.samples if s.correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the unbiased pass@k of a prompt with c correct of n samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    # the product form of the ratio: no huge binomials
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_answer(samples: Sequence[ScoredSample]) -> Optional[ScoredSample]:
    """The first sample giving the most frequent answer (None: no sample has an answer)."""
    counts: dict[str, int] = {}
    first: dict[str, ScoredSample] = {}
    for s in samples:
        if s.answer is None:
            continue
        counts[s.answer] = counts.get(s.answer, 0) + 1
        first.setdefault(s.answer, s)
    if not counts:
        return None
    best = max(counts.values())
    winner = next(a for a in first if counts[a] == best)  # dicts keep first-seen order
    return first[winner]


def metric_names(
    pass_k: Sequence[int], num_samples: int, majority: bool, errors: bool = False
) -> list[str]:
    """Names of the metrics :func:`summarize` returns for these settings (without timings);
    ``errors``: episodes can fail (an environment, env.path, or an agent harness), so
    ``env_errors`` counts them."""
    names = ["reward_mean", *(f"pass@{k}" for k in pass_k), f"mean@{num_samples}"]
    if majority:
        names.append(f"maj@{num_samples}")
    names += ["response_len_mean", "num_prompts"]
    if errors:
        names.append("env_errors")
    return [PREFIX + n for n in names]


def summarize(
    results: Sequence[PromptResult],
    pass_k: Sequence[int],
    majority: bool,
    errors: bool = False,
    skip_errors: bool = False,
) -> dict[str, float]:
    """The evaluation's metrics (names: :func:`metric_names`); every prompt has N samples.
    ``errors``: count the errored samples (``env_errors``); ``skip_errors`` (env.on_error=skip):
    ``reward_mean`` is over the others (NaN when every sample failed), as training leaves
    errored episodes out, so a policy that breaks the harness does not score above a wrong
    answer scored below 0. Errored samples are never correct (pass@k, mean@N, maj@N)."""
    if not results:
        raise ValueError("an evaluation needs at least one prompt")
    n = len(results[0].samples)
    if n < 1 or any(len(r.samples) != n for r in results):
        raise ValueError("every evaluation prompt needs the same number (>= 1) of samples")
    samples = [s for r in results for s in r.samples]
    scored = [s for s in samples if not (skip_errors and s.error is not None)]
    mean = sum(s.reward for s in scored) / len(scored) if scored else math.nan
    out = {"reward_mean": mean}
    for k in pass_k:
        out[f"pass@{k}"] = _mean(pass_at_k(n, r.num_correct, k) for r in results)
    out[f"mean@{n}"] = _mean(r.num_correct / n for r in results)
    if majority:
        votes = [majority_answer(r.samples) for r in results]
        out[f"maj@{n}"] = _mean(1.0 if v is not None and v.correct else 0.0 for v in votes)
    out["response_len_mean"] = sum(s.num_tokens for s in samples) / len(samples)
    out["num_prompts"] = float(len(results))
    if errors:
        out["env_errors"] = float(sum(1 for s in samples if s.error is not None))
    return {PREFIX + k: v for k, v in out.items()}


def _mean(values) -> float:
    items = list(values)
    return sum(items) / len(items)


def best_step(
    records: Sequence[dict], metric: str, mode: str, steps: Sequence[int]
) -> Optional[int]:
    """The step among ``steps`` (those with a checkpoint) whose record holds the best value of
    ``metric`` (mode ``max`` or ``min``; ties: the earliest); None when none has a value."""
    allowed = set(steps)
    best: Optional[tuple[float, int]] = None
    for rec in records:
        step, value = rec.get("step"), rec.get(metric)
        if step not in allowed or not isinstance(value, (int, float)) or math.isnan(value):
            continue
        key = -value if mode == "max" else value
        if best is None or (key, step) < best:
            best = (key, step)
    return None if best is None else best[1]


def is_new_best(records: Sequence[dict], metric: str, mode: str, value: float) -> bool:
    """Whether ``value`` beats every earlier value of ``metric`` of a trained step (step >= 1)."""
    earlier = [
        r[metric]
        for r in records
        if r.get("step", 0) >= 1 and isinstance(r.get(metric), (int, float))
    ]
    if not earlier:
        return True
    return value > max(earlier) if mode == "max" else value < min(earlier)
