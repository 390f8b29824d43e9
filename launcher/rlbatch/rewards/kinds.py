"""The brought reward kinds as a table: ``data.reward`` (or a ``data.reward_fn`` entry) of
code_exec, http, judge or reward_model -> a batch scorer of RewardInputs into Scored values,
and each kind's check before launch."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlbatch.config.enums import RewardKind
from rlbatch.config.errors import ConfigError
from rlbatch.config.rewards import RewardModelTemplate
from rlbatch.rewards.base import Failure, Scored

if TYPE_CHECKING:
    from rlbatch.config.schema import BatchingPassConfig, DataConfig


class RewardInput(Protocol):
    """What a brought reward reads of a sample (rlbatch.grpo.rewards.RewardInput)."""

    @property
    def prompt(self) -> str: ...
    @property
    def response(self) -> str: ...
    @property
    def answer(self) -> str: ...
    @property
    def fields(self) -> Mapping[str, Any]: ...
    @property
    def prompt_index(self) -> int: ...
    @property
    def raw_prompt(self) -> Any: ...


BatchReward = Callable[[Sequence[RewardInput]], list[Scored]]


def _label(i: int, x: RewardInput) -> str:
    return f"sample {i} (prompt index {x.prompt_index})"


def _code_exec(cfg: DataConfig, infer: BatchingPassConfig) -> BatchReward:
    from rlbatch.rewards.code_exec import CodeExecReward
    from rlbatch.rewards.sandbox import probe_isolation

    isolation, why = probe_isolation(cfg.code_exec.isolation)
    if isolation is None:
        raise RuntimeError(f"data.reward=code_exec: no sandbox isolation works here ({why})")
    reward = CodeExecReward(cfg.code_exec, isolation)
    return lambda inputs: reward.score([x.response for x in inputs], [x.fields for x in inputs])


def _http(cfg: DataConfig, infer: BatchingPassConfig) -> BatchReward:
    from rlbatch.rewards.served import HttpReward, sample_payload

    assert cfg.reward_url is not None
    reward = HttpReward(cfg.reward_url, cfg.served, cfg.reward_abs_max)

    def score(inputs: Sequence[RewardInput]) -> list[Scored]:
        payloads = [sample_payload(x.prompt, x.response, x.answer, x.fields) for x in inputs]
        return reward.score(payloads, [_label(i, x) for i, x in enumerate(inputs)])

    return score


def _judge(cfg: DataConfig, infer: BatchingPassConfig) -> BatchReward:
    from rlbatch.rewards.judge import JudgeReward

    url = cfg.judge.url or cfg.reward_url
    assert url is not None
    judge = JudgeReward(url, cfg.judge, cfg.served)

    def score(inputs: Sequence[RewardInput]) -> list[Scored]:
        messages = [judge.message(x.prompt, x.response, x.answer) for x in inputs]
        return judge.score(messages, [_label(i, x) for i, x in enumerate(inputs)])

    return score


def _reward_model(cfg: DataConfig, infer: BatchingPassConfig) -> BatchReward:
    from rlbatch.rewards.reward_model import RewardModel

    assert cfg.reward_model is not None
    model = RewardModel(
        cfg.reward_model,
        cfg.reward_model_batching,
        infer,
        cfg.reward_model_dtype,
        cfg.reward_model_template,
    )

    def score(inputs: Sequence[RewardInput]) -> list[Scored]:
        out = model.score([model.text(x.raw_prompt, x.prompt, x.response) for x in inputs])
        return [bounded(s, cfg.reward_abs_max, "the reward model's score") for s in out]

    return score


def bounded(scored: Scored, abs_max: float, what: str) -> Scored:
    """``scored``, or 0 with an ``out_of_range`` failure when its value is not finite or is
    over ``abs_max`` (data.reward_abs_max) in size."""
    value = scored.value
    if math.isfinite(value) and abs(value) <= abs_max:
        return scored
    why = f"{what} is {value!r}: rewards must be finite and at most {abs_max:g} in size"
    return Scored(0.0, (*scored.failures, Failure("out_of_range", f"{why} (data.reward_abs_max)")))


BROUGHT: dict[RewardKind, Callable[[DataConfig, BatchingPassConfig], BatchReward]] = {
    RewardKind.code_exec: _code_exec,
    RewardKind.http: _http,
    RewardKind.judge: _judge,
    RewardKind.reward_model: _reward_model,
}
"""Factories of the brought kinds (built once per process, in the driver's check and in each
worker) from ``data`` and the run's ``batching.infer`` (the reward model's micro-batches)."""


# ------------------------------------------------------------------------------------------
# Checks before launch
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetRows:
    """The rows of the dataset a run reads (training or evaluation), as the checks see them."""

    key: str
    """The config key of the dataset's file: data.path, or eval.data.path for the held-out set."""
    path: str | None
    """That key's value (the file)."""
    rows: list[dict[str, Any]]
    """Each row's fields, prompt and answer included."""
    where: list[str]
    """Where each row is in the file ("line 3", "row 7"), aligned with ``rows``."""


def _check_code_exec(cfg: DataConfig, rows: DatasetRows | None) -> list[ConfigError]:
    from rlbatch.rewards.sandbox import probe_isolation

    errors = []
    isolation, why = probe_isolation(cfg.code_exec.isolation)
    if isolation is None:
        errors.append(
            ConfigError(
                "data.code_exec.isolation",
                cfg.code_exec.isolation.name,
                f"no sandbox works on this machine ({why}): code_exec runs model-written"
                " programs only in namespaces; fix unshare (util-linux, user namespaces), or"
                " opt out of isolation explicitly with data.code_exec.isolation=none",
            )
        )
    if rows is not None:
        errors += _row_tests(rows)
    limits = {f"data.code_exec.limits.{k}": v for k, v in vars(cfg.code_exec.limits).items()}
    errors += _positive({"data.code_exec.num_workers": cfg.code_exec.num_workers, **limits})
    if cfg.code_exec.stub_check_rows < 0:
        why = "must be >= 0: the rows checked against stub programs before launch (0: off)"
        errors.append(
            ConfigError("data.code_exec.stub_check_rows", cfg.code_exec.stub_check_rows, why)
        )
    return errors + _unit_bound(cfg, RewardKind.code_exec, "every test passed")


def stub_warnings(cfg: DataConfig, rows: DatasetRows | None, seed: int) -> list[str]:
    """code_exec's stub check before launch: stub programs against the tests of a seeded
    sample of data.code_exec.stub_check_rows usable rows; a warning naming the rows a stub
    passes or earns part of the reward on (none when the check is off or no sandbox works)."""
    from rlbatch.rewards.code_exec import row_test_problems
    from rlbatch.rewards.sandbox import probe_isolation
    from rlbatch.rewards.sandbox_stubs import describe, run_stubs, sample_rows

    count = cfg.code_exec.stub_check_rows
    if rows is None or count <= 0:
        return []
    isolation, _ = probe_isolation(cfg.code_exec.isolation)
    usable = [i for i, row in enumerate(rows.rows) if not row_test_problems(row)]
    picked = [usable[i] for i in sample_rows(len(usable), count, seed)]
    if isolation is None or not picked:
        return []  # the code_exec check reports it
    found = run_stubs(
        cfg.code_exec, isolation, [rows.rows[i] for i in picked], [rows.where[i] for i in picked]
    )
    line = describe(found, len(picked), f"sampled rows of {rows.key}={rows.path}")
    if line is None:
        return []
    return [
        f"data.reward=code_exec: {line} (data.code_exec.stub_check_rows={count}; rlbatch-score checks every row)"
    ]


def _unit_bound(cfg: DataConfig, kind: RewardKind, best: str) -> list[ConfigError]:
    """A kind whose rewards lie in [0, 1] under a data.reward_abs_max below 1: its best rewards
    would all be out_of_range and score 0, a run that learns nothing without an error."""
    if cfg.reward_abs_max >= 1.0:
        return []
    why = (
        f"data.reward={kind.value} scores in [0, 1]: a reward of 1 ({best}) would be out of"
        " range and count as 0; set data.reward_abs_max >= 1"
    )
    return [ConfigError("data.reward_abs_max", cfg.reward_abs_max, why)]


def _row_tests(rows: DatasetRows) -> list[ConfigError]:
    """Every row without usable tests, as one error on the dataset's key."""
    from rlbatch.rewards.code_exec import row_test_problems

    bad = [
        f"{where}: {p}"
        for where, row in zip(rows.where, rows.rows, strict=True)
        for p in row_test_problems(row)
    ]
    if not bad:
        return []
    more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
    return [
        ConfigError(
            rows.key,
            rows.path,
            f"{len(bad)} row(s) without usable tests for data.reward=code_exec: "
            + "; ".join(bad[:20])
            + more
            + '. Give every row a \'tests\' list of {"input": str, "output": str} cases or a'
            " 'test_code' string of asserts",
        )
    ]


def _positive(values: dict[str, float]) -> list[ConfigError]:
    """An error for each dotted key whose value is not > 0."""
    return [ConfigError(k, v, "must be > 0") for k, v in values.items() if v <= 0]


def _first_sample(rows: DatasetRows | None, cfg: DataConfig) -> dict[str, Any]:
    from rlbatch.rewards.served import sample_payload

    row = dict((rows.rows if rows and rows.rows else [{}])[0])
    answer = str(row.pop(cfg.answer_key, ""))
    prompt = row.pop(cfg.prompt_key, "")
    return sample_payload(prompt if isinstance(prompt, str) else str(prompt), answer, answer, row)


def _check_url(cfg: DataConfig, kind: RewardKind, key: str, url: str | None) -> list[ConfigError]:
    if not url:
        need = f"data.reward={kind.value} needs the endpoint: set {key}=http://HOST:PORT/..."
        return [ConfigError(key, None, need)]
    if not url.startswith(("http://", "https://")):
        return [ConfigError(key, url, "must start with http:// or https://")]
    served = cfg.served
    keys = ("max_concurrency", "batch_size", "timeout_s", "max_response_bytes")
    return _positive({f"data.served.{k}": getattr(served, k) for k in keys})


def _error_fraction(cfg: DataConfig) -> list[ConfigError]:
    """data.served.max_error_fraction out of [0, 1] (checked beside the endpoint, not before
    it: the endpoint's own check still runs)."""
    fraction = cfg.served.max_error_fraction
    if 0.0 <= fraction <= 1.0:
        return []
    why = "is a fraction of a step's samples: set it in [0, 1] (1 never stops the run)"
    return [ConfigError("data.served.max_error_fraction", fraction, why)]


def _check_http(cfg: DataConfig, rows: DatasetRows | None) -> list[ConfigError]:
    return _check_http_endpoint(cfg, rows) + _error_fraction(cfg)


def _check_judge(cfg: DataConfig, rows: DatasetRows | None) -> list[ConfigError]:
    return _check_judge_endpoint(cfg, rows) + _error_fraction(cfg)


def _check_http_endpoint(cfg: DataConfig, rows: DatasetRows | None) -> list[ConfigError]:
    from rlbatch.rewards.served import HttpReward

    errors = _check_url(cfg, RewardKind.http, "data.reward_url", cfg.reward_url)
    if errors or not cfg.served.check:
        return errors
    assert cfg.reward_url is not None
    why = HttpReward(cfg.reward_url, cfg.served).check(_first_sample(rows, cfg))
    return [_unanswered("data.reward_url", cfg.reward_url, why)] if why else []


def _check_judge_endpoint(cfg: DataConfig, rows: DatasetRows | None) -> list[ConfigError]:
    from rlbatch.rewards.judge import JudgeReward

    key = "data.judge.url" if cfg.judge.url else "data.reward_url"
    url = cfg.judge.url or cfg.reward_url
    from rlbatch.rewards.judge import pattern_problem

    errors = _check_url(cfg, RewardKind.judge, key, url)
    if cfg.judge.max_score <= 0:
        errors.append(ConfigError("data.judge.max_score", cfg.judge.max_score, "must be > 0"))
    pattern = cfg.judge.score_pattern
    if pattern is not None and pattern_problem(pattern):
        errors.append(ConfigError("data.judge.score_pattern", pattern, pattern_problem(pattern)))
    errors += _unit_bound(cfg, RewardKind.judge, "the top of the judge's scale")
    if errors or not cfg.served.check:
        return errors
    assert url is not None
    sample = _first_sample(rows, cfg)
    why = JudgeReward(url, cfg.judge, cfg.served).check(sample["prompt"], sample["answer"])
    return [_unanswered(key, url, why)] if why else []


def _unanswered(key: str, url: str, why: str) -> ConfigError:
    return ConfigError(
        key,
        url,
        f"the check before launch failed: {why}. Start the server (or fix the URL); set"
        " data.served.check=false to skip this check",
    )


def _check_reward_model(cfg: DataConfig, rows: DatasetRows | None) -> list[ConfigError]:
    from rlbatch.rewards.reward_model import check_reward_model

    if not cfg.reward_model:
        return [
            ConfigError(
                "data.reward_model",
                None,
                "data.reward=reward_model needs the checkpoint: set data.reward_model=HF_DIR",
            )
        ]
    why = check_reward_model(cfg.reward_model)
    if why:
        return [ConfigError("data.reward_model", cfg.reward_model, why)]
    if RewardModelTemplate(cfg.reward_model_template) == RewardModelTemplate.model:
        from rlbatch.rewards.reward_model import template_problem

        why = template_problem(cfg.reward_model)
        if why:
            return [ConfigError("data.reward_model_template", "model", why)]
    return []


CHECKS: dict[RewardKind, Callable[[DataConfig, DatasetRows | None], list[ConfigError]]] = {
    RewardKind.code_exec: _check_code_exec,
    RewardKind.http: _check_http,
    RewardKind.judge: _check_judge,
    RewardKind.reward_model: _check_reward_model,
}
"""Each brought kind's check before launch: data.reward_url / data.reward_model set and
answering, the sandbox working, every row carrying tests (``rows``: the training or evaluation
dataset's rows; None when it could not be read)."""
