"""Reward functions: built-ins selected by ``data.reward`` (RewardKind) through an explicit
registry, or a weighted list by import path (``data.reward_fn``, rlbatch.grpo.user_rewards).

Every built-in maps one :class:`RewardInput` to a float. ``build_reward_fn`` is the factory of
one built-in (it checks that the kind fits the data source: ``task`` needs a built-in task);
``build_rewards`` assembles the run's :class:`RewardSet`, whose components are each logged as
``reward/<name>_mean``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional, Protocol

from rlbatch.config.distill import pure_distillation
from rlbatch.config.schema import (
    BatchingConfig,
    BatchingPassConfig,
    BuiltinTask,
    DataConfig,
    DataSource,
    RewardKind,
    RunConfig,
)
from rlbatch.grpo.tasks import task_reward
from rlbatch.grpo.types import Sample
from rlbatch.grpo.user_rewards import Completion, UserReward, call_reward, load_reward
from rlbatch.rewards.base import Failure, Scored


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
    response_ids: tuple[int, ...] = ()
    """Response token ids, EOS excluded."""
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The dataset row's other fields (not the prompt, not the answer)."""
    prompt_index: int = -1
    """Index of the prompt in the dataset (names the sample in errors)."""
    raw_prompt: Any = field(default=None, hash=False, compare=False)
    """The prompt as the dataset row holds it (text or chat messages, before any chat
    template): what data.reward_model_template=model renders."""


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


MATH_VERIFY_TIMEOUT_S = 5
"""Longest math-verify parse / comparison of one answer (pathological LaTeX scores 0)."""


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    return "Timeout is disabled" not in record.getMessage()


def math_verify_reward(x: RewardInput) -> float:
    """1.0 when math-verify finds the response's final answer symbolically equal to the
    reference (fractions, roots, intervals, tuples, sets, LaTeX or plain); needs the ``math``
    extra (pip install math-verify)."""
    import threading

    from math_verify import parse, verify

    # math-verify bounds parsing time with SIGALRM, which only the main thread may use; off it,
    # its per-call "timeout is disabled" warning is dropped (it would repeat for every sample).
    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_drop_timeout_notice)
    gold = parse(_as_latex(x.answer), parsing_timeout=limit)
    if not gold:
        return 0.0
    answer = parse(x.response, parsing_timeout=limit)
    return 1.0 if verify(gold, answer, timeout_seconds=limit) else 0.0


def _as_latex(answer: str) -> str:
    """A bare reference answer (``\\frac{1}{2}``, ``(1, 2]``) inside $...$ so math-verify's LaTeX
    extraction sees all of it; text that already has delimiters or \\boxed is left alone."""
    text = answer.strip()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


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
    RewardKind.math_verify: lambda cfg: math_verify_reward,
    RewardKind.none: lambda cfg: lambda x: 0.0,
}


def build_reward_fn(cfg: DataConfig) -> RewardFn:
    """The reward function that ``data.reward`` names (a per-sample built-in; the brought kinds
    score batches: build_rewards)."""
    kind = RewardKind(cfg.reward)
    if kind not in _REGISTRY:
        raise ValueError(f"data.reward={kind.value} scores batches: use build_rewards")
    if kind == RewardKind.task and DataSource(cfg.source) != DataSource.builtin:
        raise ValueError(
            f"data.reward=task needs data.source=builtin (got data.source={cfg.source.value}):"
            " a file dataset has no task reward; set data.reward=exact_match, math or format"
        )
    return _REGISTRY[kind](cfg)


@dataclass(frozen=True)
class RewardComponent:
    """One term of the total reward: ``weight * score(batch)``, logged as reward/<name>_mean."""

    name: str
    weight: float
    score: Callable[[Sequence[RewardInput]], list[float]]
    scored: Optional[Callable[[Sequence[RewardInput]], list[Scored]]] = None
    """A brought reward (rlbatch.rewards): values with the reason of every failure; when set,
    ``score`` is its values alone."""
    served: bool = False
    """Scored by a server (http, judge): its failures count against
    data.served.max_error_fraction."""


NamedFailure = tuple[str, Failure]
"""(reward part name, failure) of one sample."""


@dataclass(frozen=True)
class RewardSet:
    """The run's rewards; the total of a sample is the weighted sum of its components."""

    components: tuple[RewardComponent, ...]

    def score(self, inputs: Sequence[RewardInput]) -> tuple[list[float], dict[str, list[float]]]:
        """(total per sample, each component's values per sample by name)."""
        totals, parts, _ = self.score_detailed(inputs)
        return totals, parts

    def score_detailed(
        self, inputs: Sequence[RewardInput]
    ) -> tuple[list[float], dict[str, list[float]], list[list[NamedFailure]]]:
        """(total per sample, each component's values by name, each sample's failures)."""
        parts: dict[str, list[float]] = {}
        failures: list[list[NamedFailure]] = [[] for _ in inputs]
        for c in self.components:
            if c.scored is None:
                parts[c.name] = c.score(inputs)
                continue
            out = c.scored(inputs)
            parts[c.name] = [s.value for s in out]
            for i, s in enumerate(out):
                failures[i].extend((c.name, f) for f in s.failures)
        totals = [
            sum(c.weight * parts[c.name][i] for c in self.components) for i in range(len(inputs))
        ]
        return totals, parts, failures


def _builtin_component(
    kind: RewardKind, cfg: DataConfig, name: str, weight: float, infer: BatchingPassConfig
):
    from rlbatch.rewards.kinds import BROUGHT

    if kind in BROUGHT:
        scored = BROUGHT[kind](cfg, infer)
        served = kind in (RewardKind.http, RewardKind.judge)
        return RewardComponent(
            name, weight, lambda inputs: [s.value for s in scored(inputs)], scored, served
        )
    fn = build_reward_fn(_with_reward(cfg, kind))
    return RewardComponent(name, weight, lambda inputs: score(fn, inputs, name))


def _with_reward(cfg: DataConfig, kind: RewardKind) -> DataConfig:
    import dataclasses

    return dataclasses.replace(cfg, reward=kind)


def _user_component(
    reward: UserReward, name: str, weight: float, cfg: DataConfig
) -> RewardComponent:
    def score_user(inputs: Sequence[RewardInput]) -> list[float]:
        batch = [
            Completion(
                prompt=x.prompt,
                completion=x.response,
                completion_ids=list(x.response_ids),
                answer=x.answer,
                fields=x.fields,
                label=f"sample {i} (prompt index {x.prompt_index})",
            )
            for i, x in enumerate(inputs)
        ]
        return call_reward(
            reward, batch, abs_max=cfg.reward_abs_max, timeout_s=cfg.reward_timeout_s
        )

    return RewardComponent(name, weight, score_user)


def reward_names(specs: Sequence[str]) -> list[str]:
    """Metric names of data.reward_fn entries: the function (or built-in) name, made unique."""
    names: list[str] = []
    for spec in specs:
        base = spec.rpartition(":")[2] or spec
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


def component_names(cfg: DataConfig) -> list[str]:
    """Names of the run's reward components (without loading anything); data.reward=none
    (an environment's rewards alone) has none."""
    if cfg.reward_fn:
        return reward_names(cfg.reward_fn)
    kind = RewardKind(cfg.reward)
    return [] if kind == RewardKind.none else [kind.value]


def build_rewards(cfg: DataConfig, infer: BatchingPassConfig | None = None) -> RewardSet:
    """data.reward_fn (weighted by data.reward_weights) when set, else data.reward alone.
    ``infer``: the run's batching.infer (how data.reward=reward_model batches its forwards;
    None = that slot's default)."""
    if infer is None:
        infer = BatchingConfig().infer
    if not cfg.reward_fn:
        kind = RewardKind(cfg.reward)
        if kind == RewardKind.none:
            return RewardSet(())
        return RewardSet((_builtin_component(kind, cfg, component_names(cfg)[0], 1.0, infer),))
    weights = cfg.reward_weights or [1.0] * len(cfg.reward_fn)
    components = []
    for spec, name, weight in zip(cfg.reward_fn, reward_names(cfg.reward_fn), weights, strict=True):
        if ":" in spec:
            components.append(_user_component(load_reward(spec), name, weight, cfg))
        else:
            components.append(_builtin_component(RewardKind(spec), cfg, name, weight, infer))
    return RewardSet(tuple(components))


OVERLONG = "overlong"
"""Name of the overlong-shaping reward part (metric ``reward/overlong_mean``)."""


def overlong_penalty(num_tokens: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), scaled by ``factor``: 0 up
    to max_new_tokens - buffer_len response tokens, then linear down to -factor at
    max_new_tokens (and -factor beyond)."""
    start = max_new_tokens - buffer_len
    if num_tokens <= start:
        return 0.0
    if num_tokens > max_new_tokens:
        return -factor
    return (start - num_tokens) / buffer_len * factor


def overlong_component(max_new_tokens: int, buffer_len: int, factor: float) -> RewardComponent:
    """The overlong penalty as its own reward part (weight 1), over the response tokens the
    reward sees (EOS excluded)."""

    def score_overlong(inputs: Sequence[RewardInput]) -> list[float]:
        return [
            overlong_penalty(x.num_response_tokens, max_new_tokens, buffer_len, factor)
            for x in inputs
        ]

    return RewardComponent(OVERLONG, 1.0, score_overlong)


def build_run_rewards(cfg: RunConfig) -> RewardSet:
    """The run's reward parts: :func:`build_rewards` of ``data``, plus the overlong penalty
    when ``grpo.overlong_buffer_len`` > 0."""
    rewards = build_rewards(cfg.data, cfg.batching.infer)
    g = cfg.grpo
    if g.overlong_buffer_len <= 0:
        return rewards
    part = overlong_component(
        cfg.rollout.max_new_tokens, g.overlong_buffer_len, g.overlong_penalty_factor
    )
    return RewardSet((*rewards.components, part))


def brought_kinds(cfg: DataConfig) -> list[RewardKind]:
    """The brought kinds (code_exec, http, judge, reward_model) among the run's rewards."""
    from rlbatch.rewards.kinds import BROUGHT

    specs = cfg.reward_fn or [RewardKind(cfg.reward).value]
    kinds = [RewardKind(s) for s in specs if ":" not in s and s in RewardKind.__members__]
    return [k for k in kinds if k in BROUGHT]


def run_component_names(cfg: RunConfig) -> list[str]:
    """Names of the run's reward parts (:func:`build_run_rewards`, and ``env``: the sum of a
    multi-turn episode's step rewards), without loading anything. None under pure distillation
    (grpo.distill.reward_coef=0): no reward is computed, so none is logged."""
    if pure_distillation(cfg):
        return []
    extra = [OVERLONG] if cfg.grpo.overlong_buffer_len > 0 else []
    env = ["env"] if cfg.env.path else []
    return component_names(cfg.data) + extra + env


def score(fn: RewardFn, inputs: Sequence[RewardInput], name: str = "reward") -> list[float]:
    """`fn` over a batch; a non-finite reward is an error naming the reward and the sample."""
    out = []
    for i, x in enumerate(inputs):
        r = float(fn(x))
        if not math.isfinite(r):
            raise ValueError(
                f"{name} of sample {i} (prompt index {x.prompt_index}) is {r}: reward functions"
                " must be finite"
            )
        out.append(r)
    return out


class TextDecoder(Protocol):
    """The part of rlbatch.engine.tokenizer's Tokenizer that scoring needs."""

    eos_ids: tuple[int, ...]

    def decode(self, ids: list[int]) -> str: ...


def reward_input(sample: Sample, tokenizer: TextDecoder) -> RewardInput:
    """What the reward function sees of `sample`: response decoded without its final EOS (a
    multi-turn trajectory: everything after the prompt, assistant turns and the rendered
    observations between them, special tokens dropped by the tokenizer's decode; an agent
    harness's episode: its sampled turns only, one a line)."""
    ids = list(sample.response_ids)
    if ids and ids[-1] in tokenizer.eos_ids:
        ids = ids[:-1]
    text = None
    if sample.episode and "calls" in sample.episode and sample.loss_mask is not None:
        # an agent harness's episode: the harness wrote everything between the sampled turns
        # (its user and tool messages, tool results that may hold the answer), so the data
        # reward reads what the policy sampled only, each turn on a line of its own
        turns = _sampled_spans(ids, sample.loss_mask)
        ids = [t for turn in turns for t in turn]
        text = "\n".join(tokenizer.decode(turn) for turn in turns)
    return RewardInput(
        prompt=sample.prompt.text,
        response=tokenizer.decode(ids) if text is None else text,
        answer=sample.prompt.answer,
        num_response_tokens=len(ids),
        response_ids=tuple(ids),
        fields=sample.prompt.fields,
        prompt_index=sample.prompt.index,
        raw_prompt=sample.prompt.raw,
    )


def _sampled_spans(ids: Sequence[int], mask: Sequence[int]) -> list[list[int]]:
    """The runs of ``ids`` whose ``mask`` is 1 (the tokens the policy sampled), in order."""
    spans: list[list[int]] = []
    inside = False
    for token, keep in zip(ids, mask, strict=False):  # ids may have lost a final EOS
        if keep and not inside:
            spans.append([])
        if keep:
            spans[-1].append(token)
        inside = bool(keep)
    return spans


def sample_reward_fn(fn: RewardFn, tokenizer: TextDecoder):
    """The LCM aggregator's reward_fn(samples) -> rewards on top of a RewardFn."""

    def reward_fn(samples: Sequence[Sample]) -> list[float]:
        return score(fn, [reward_input(s, tokenizer) for s in samples])

    return reward_fn
