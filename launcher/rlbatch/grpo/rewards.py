"""Reward functions, selected by ``data.reward`` (RewardKind) through an explicit registry.

Every reward function maps one :class:`RewardInput` to a float. ``build_reward_fn`` is the only
factory; it also checks that the kind fits the data source (``task`` needs a built-in task).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Protocol

from rlbatch.config.schema import BuiltinTask, DataConfig, DataSource, RewardKind
from rlbatch.grpo.tasks import task_reward
from rlbatch.grpo.types import Sample


@dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one completion."""

    prompt: str
    """Prompt text as the model saw it (after chat templating)."""
    response: str
    """Decoded response text, EOS excluded."""
    answer: str
    """Reference answer of the prompt."""
    num_response_tokens: int
    """Response tokens, EOS excluded."""


RewardFn = Callable[[RewardInput], float]


def exact_match_reward(x: RewardInput) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace."""
    return 1.0 if x.response.strip() == x.answer.strip() else 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every \\boxed{...} in `text`, nested braces balanced."""
    out = []
    start = text.find("\\boxed{")
    while start >= 0:
        i, depth = start + len("\\boxed{"), 1
        begin = i
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[begin : i - 1])
        start = text.find("\\boxed{", i)
    return out


def _parse_number(text: str) -> Optional[Fraction]:
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    m = re.fullmatch(r"\\(?:d?frac)\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    try:
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def extract_math_answer(text: str) -> Optional[Fraction]:
    """The last \\boxed{...} if any, else the last number in `text`, as an exact Fraction."""
    boxed = _boxed_contents(text)
    if boxed:
        value = _parse_number(boxed[-1])
        if value is not None:
            return value
        numbers = _NUMBER.findall(boxed[-1])
        return _parse_number(numbers[-1]) if numbers else None
    numbers = _NUMBER.findall(text)
    return _parse_number(numbers[-1]) if numbers else None


def math_reward(x: RewardInput) -> float:
    """1.0 when the response's final answer equals the reference numerically (rel 1e-6)."""
    got, want = extract_math_answer(x.response), extract_math_answer(x.answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-9) else 0.0


_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(x: RewardInput) -> float:
    """1.0 for exactly ``<think>...</think><answer>...</answer>``; else 0.2 per tag present
    once (partial credit, at most 0.8)."""
    if _FORMAT.fullmatch(x.response):
        return 1.0
    return 0.2 * sum(1 for tag in _FORMAT_TAGS if x.response.count(tag) == 1)


def _task_reward_fn(task: BuiltinTask) -> RewardFn:
    def fn(x: RewardInput) -> float:
        return task_reward(task, x.response, x.answer, x.num_response_tokens)

    return fn


_REGISTRY: dict[RewardKind, Callable[[DataConfig], RewardFn]] = {
    RewardKind.task: lambda cfg: _task_reward_fn(cfg.task),
    RewardKind.exact_match: lambda cfg: exact_match_reward,
    RewardKind.math: lambda cfg: math_reward,
    RewardKind.format: lambda cfg: format_reward,
}


def build_reward_fn(cfg: DataConfig) -> RewardFn:
    """The reward function that ``data.reward`` names."""
    kind = RewardKind(cfg.reward)
    if kind == RewardKind.task and DataSource(cfg.source) != DataSource.builtin:
        raise ValueError(
            f"data.reward=task needs data.source=builtin (got data.source={cfg.source.value}):"
            " a file dataset has no task reward; set data.reward=exact_match, math or format"
        )
    return _REGISTRY[kind](cfg)


def score(fn: RewardFn, inputs: Sequence[RewardInput]) -> list[float]:
    """`fn` over a batch; a non-finite reward is an error naming the sample."""
    out = []
    for i, x in enumerate(inputs):
        r = float(fn(x))
        if not math.isfinite(r):
            raise ValueError(f"reward of sample {i} is {r}: reward functions must be finite")
        out.append(r)
    return out


class TextDecoder(Protocol):
    """The part of rlbatch.engine.tokenizer's Tokenizer that scoring needs."""

    eos_id: int

    def decode(self, ids: list[int]) -> str: ...


def reward_input(sample: Sample, tokenizer: TextDecoder) -> RewardInput:
    """What the reward function sees of `sample`: response decoded without its final EOS."""
    ids = list(sample.response_ids)
    if ids and ids[-1] == tokenizer.eos_id:
        ids = ids[:-1]
    return RewardInput(
        prompt=sample.prompt.text,
        response=tokenizer.decode(ids),
        answer=sample.prompt.answer,
        num_response_tokens=len(ids),
    )


def sample_reward_fn(fn: RewardFn, tokenizer: TextDecoder):
    """The LCM aggregator's reward_fn(samples) -> rewards on top of a RewardFn."""

    def reward_fn(samples: Sequence[Sample]) -> list[float]:
        return score(fn, [reward_input(s, tokenizer) for s in samples])

    return reward_fn
