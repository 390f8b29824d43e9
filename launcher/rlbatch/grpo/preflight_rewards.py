"""The reward checks rlbatch-train (and rlbatch-score) run before launch
(rlbatch.grpo.preflight): each data.reward_fn entry imported and its signature checked against
the dataset's fields, relative file paths made absolute so the workers find them, the reward
kinds and their weights, and the penalties a policy could game."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import BatchingPassConfig, DataConfig, DataSource, RewardKind
from rlbatch.rewards.kinds import DatasetRows


def check_rewards(
    data: DataConfig, fields: set[str] | None, errors: list[ConfigError], prefix: str = "data"
) -> None:
    """data.reward / data.reward_fn (``prefix`` names the group in the errors: data or eval)."""
    from rlbatch.grpo.user_rewards import RewardSpecError, is_import_spec, load_reward

    kinds = [] if data.reward_fn else [RewardKind(data.reward)]
    for i, spec in enumerate(data.reward_fn):
        key = f"{prefix}.reward_fn[{i}]"
        if not is_import_spec(spec):
            if spec in RewardKind.__members__:
                kinds.append(RewardKind[spec])
            else:
                choices = ", ".join(RewardKind.__members__)
                errors.append(
                    ConfigError(
                        key,
                        spec,
                        f"is neither PATH.py:function, module:function nor one of {choices}",
                    )
                )
            continue
        spec = absolute_spec(spec)
        data.reward_fn[i] = spec
        try:
            reward = load_reward(spec)
        except RewardSpecError as err:
            errors.append(ConfigError(key, spec, str(err)))
            continue
        missing = [f for f in reward.field_args if fields is not None and f not in fields]
        if missing:
            errors.append(
                ConfigError(
                    key,
                    spec,
                    f"parameter(s) {missing} name no field of every dataset row (row fields:"
                    f" {sorted(fields or [])}): rename them to prompt/completion/completion_ids/"
                    "answer (or their plurals), give them defaults, or add the fields",
                )
            )
    _check_kinds(data, kinds, errors, prefix)
    _check_weights(data, errors)


def check_reward_specs(data: DataConfig, errors: list[ConfigError]) -> None:
    """data.reward / data.reward_fn alone (no dataset: row-field checks skipped)."""
    check_rewards(data, None, errors)


def check_brought_rewards(
    data: DataConfig,
    seed: int,
    errors: list[ConfigError],
    key: str = "data.path",
    infer: BatchingPassConfig | None = None,
    rows: DatasetRows | None = None,
    warnings: list[str] | None = None,
    verifiers: str | None = None,
) -> None:
    """The brought kinds among the rewards (code_exec, http, judge, reward_model): each one's
    check (rlbatch.rewards.kinds.CHECKS) over the rows of ``data``'s dataset, whose file is
    config key ``key`` (data.path, or eval.data.path for the held-out set), or over ``rows``
    when given (rlbatch-score's input: the dataset is not read then), or over the tasks of
    ``verifiers`` (env.agent.verifiers: its taskset is the dataset); with ``infer``
    (batching.infer), the reward model's longest text against that budget; with ``warnings``,
    code_exec's stub check over a sample of the rows (rlbatch.rewards.kinds.stub_warnings)."""
    from rlbatch.grpo.rewards import brought_kinds
    from rlbatch.rewards.kinds import CHECKS

    kinds = brought_kinds(data)
    if not kinds:
        return
    if infer is not None and RewardKind.reward_model in kinds:
        from rlbatch.rewards.reward_model import budget_errors

        errors += budget_errors(data.reward_model_batching, infer)
    if rows is None and (verifiers or data.source == DataSource.builtin or path_exists(data)):
        from rlbatch.grpo.data import read_examples

        try:
            examples, _ = read_examples(data, seed, verifiers=verifiers)
            fields = [
                {**ex.fields, data.prompt_key: ex.prompt, data.answer_key: ex.answer}
                for ex in examples
            ]
            rows = DatasetRows(key, data.path, fields, [ex.where for ex in examples])
        except ValueError:
            rows = None  # the dataset check reports it
    found: list[ConfigError] = []
    for kind in dict.fromkeys(kinds):
        found += CHECKS[kind](data, rows)
    errors += found
    if warnings is not None and RewardKind.code_exec in kinds and not found:
        from rlbatch.rewards.kinds import stub_warnings

        warnings += stub_warnings(data, rows, seed)


def absolute_spec(spec: str) -> str:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return spec


def _check_kinds(
    data: DataConfig, kinds: list[RewardKind], errors: list[ConfigError], prefix: str
) -> None:
    key = f"{prefix}.reward_fn" if data.reward_fn else f"{prefix}.reward"
    if RewardKind.task in kinds and data.source != DataSource.builtin:
        errors.append(
            ConfigError(
                key,
                "task",
                f"needs data.source=builtin (got {data.source.name}): a file dataset has no task"
                " reward; use exact_match, math, math_verify, format or your own function",
            )
        )
    if RewardKind.math_verify in kinds and importlib.util.find_spec("math_verify") is None:
        errors.append(
            ConfigError(
                key,
                "math_verify",
                "needs the math-verify package: pip install 'rlbatch[math]', or use the"
                " dependency-free numeric reward math",
            )
        )


def _check_weights(data: DataConfig, errors: list[ConfigError]) -> None:
    weights = data.reward_weights
    if weights is None:
        return
    if not data.reward_fn:
        errors.append(
            ConfigError(
                "data.reward_weights",
                weights,
                "weighs the entries of data.reward_fn, which is empty: set data.reward_fn, or"
                " data.reward_weights=null",
            )
        )
    elif len(weights) != len(data.reward_fn):
        errors.append(
            ConfigError(
                "data.reward_weights",
                weights,
                f"has {len(weights)} weight(s) for {len(data.reward_fn)} data.reward_fn"
                " entries: give one weight per entry",
            )
        )
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        errors.append(ConfigError("data.reward_weights", weights, "weights must be finite"))
    errors += _gameable_penalties(data)


def _gameable_penalties(data: DataConfig) -> list[ConfigError]:
    """A served reward (http, judge) weighed below 0 while data.served.max_error_fraction lets
    failures train: a failed sample scores 0 on it, the best a negative weight gives, and a
    completion can make it fail (a judge reply quoting the completion's own score is
    unreadable), so the policy would learn to break its judge instead of avoiding the
    penalty."""
    served = {RewardKind.http.value, RewardKind.judge.value}
    fraction = data.served.max_error_fraction
    if fraction <= 0 or data.reward_weights is None:
        return []
    return [
        ConfigError(
            f"data.reward_weights[{i}]",
            weight,
            f"weighs data.reward_fn[{i}]={spec}, a served reward, below 0 while"
            f" data.served.max_error_fraction={fraction:g} trains on its failures scored 0,"
            " the best such a penalty gives: a completion that makes the judge or scorer"
            " fail escapes it. Set data.served.max_error_fraction=0 (any failure stops the"
            " run), or score the opposite quality with a weight >= 0",
        )
        for i, (spec, weight) in enumerate(zip(data.reward_fn, data.reward_weights, strict=False))
        if spec in served and weight < 0
    ]


def path_exists(data: DataConfig) -> bool:
    if not data.path:
        return False
    path = Path(data.path).expanduser()
    return path.is_dir() if data.source == DataSource.hf_disk else path.is_file()
