"""The answer a reward grades, read from a response: what maj@N votes on.

A table keyed by the built-in reward kind; a kind that is missing (``format``, a user's
function) grades no single answer, and maj@N is then not reported. The evaluation's reward is
the first entry of ``eval.reward_fn`` / ``data.reward_fn`` that is a built-in, or the built-in
reward alone (rlbatch.eval.runner).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from rlbatch.config.schema import BuiltinTask, RewardKind
from rlbatch.grpo.rewards import RewardInput, extract_math_answer

AnswerFn = Callable[[RewardInput], Optional[str]]


def _math_answer(x: RewardInput) -> Optional[str]:
    """The final number (last \\boxed{} or last number) as an exact fraction, e.g. '3/4'."""
    value = extract_math_answer(x.response)
    return None if value is None else str(value)


def _stripped_response(x: RewardInput) -> Optional[str]:
    """The whole response is the answer (exact_match, digit_copy)."""
    return x.response.strip()


def _response_length(x: RewardInput) -> Optional[str]:
    """target_length grades the number of response tokens."""
    return str(x.num_response_tokens)


_TASK_ANSWERS: dict[BuiltinTask, AnswerFn] = {
    BuiltinTask.digit_copy: _stripped_response,
    BuiltinTask.target_length: _response_length,
}

_ANSWERS: dict[RewardKind, Callable[[BuiltinTask], AnswerFn]] = {
    RewardKind.math: lambda task: _math_answer,
    RewardKind.math_verify: lambda task: _math_answer,
    RewardKind.exact_match: lambda task: _stripped_response,
    RewardKind.task: lambda task: _TASK_ANSWERS[task],
}


def voting_kind(reward: Optional[RewardKind], reward_fn: Sequence[str]) -> Optional[RewardKind]:
    """The built-in reward whose answer maj@N votes on: the first built-in entry of
    ``reward_fn`` when it is set, else ``reward``; None when it has no answer to vote on."""
    if reward_fn:
        kinds = [RewardKind[s] for s in reward_fn if s in RewardKind.__members__]
        reward = kinds[0] if kinds else None
    return reward if reward in _ANSWERS else None


def answer_fn(kind: Optional[RewardKind], task: BuiltinTask) -> Optional[AnswerFn]:
    """The answer extractor of reward ``kind`` (None: maj@N is not reported)."""
    return None if kind is None or kind not in _ANSWERS else _ANSWERS[kind](task)
