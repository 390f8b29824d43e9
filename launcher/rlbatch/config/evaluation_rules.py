"""The cross-field rules of the ``eval`` group and of trainer.checkpoint.keep_best
(rlbatch.config.validate runs :func:`check_eval`); what the group means is
:mod:`rlbatch.eval.settings`. Pure: no torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import DataSource, RunConfig
from rlbatch.eval.settings import (
    GREEDY,
    eval_data,
    eval_enabled,
    eval_metric_names,
    eval_rollout,
    in_step_ranks,
)


def check_eval(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Every error of the eval group and of trainer.checkpoint.keep_best."""
    ev = cfg.eval
    _check_numbers(cfg, errors)
    _check_data(cfg, errors)
    _check_keep_best(cfg, errors)
    if ev.num_samples >= 1 and ev.pass_k is not None:
        bad = [k for k in ev.pass_k if not 1 <= k <= ev.num_samples]
        if bad or not ev.pass_k:
            errors.append(
                ConfigError(
                    "eval.pass_k",
                    ev.pass_k,
                    f"each k must be in 1..eval.num_samples={ev.num_samples} (and one at least):"
                    " raise eval.num_samples, or drop the larger k",
                )
            )


def _check_numbers(cfg: RunConfig, errors: list[ConfigError]) -> None:
    ev = cfg.eval
    checks = [
        ("eval.every_steps", ev.every_steps, ev.every_steps >= 0, "must be >= 0 (0 = off)"),
        ("eval.max_prompts", ev.max_prompts, ev.max_prompts is None or ev.max_prompts > 0,
         "must be positive (null = every prompt)"),
        ("eval.num_samples", ev.num_samples, ev.num_samples >= 1, "must be >= 1"),
        ("eval.temperature", ev.temperature, ev.temperature is None or ev.temperature >= 0,
         "must be >= 0 (0 = greedy)"),
        ("eval.top_p", ev.top_p, ev.top_p is None or 0 < ev.top_p <= 1, "must be in (0, 1]"),
        ("eval.max_new_tokens", ev.max_new_tokens,
         ev.max_new_tokens is None or ev.max_new_tokens > 0, "must be positive"),
        ("eval.correct_threshold", ev.correct_threshold, math.isfinite(ev.correct_threshold),
         "must be a finite number"),
        ("eval.data.num_prompts", ev.data.num_prompts,
         ev.data.num_prompts is None or ev.data.num_prompts > 0, "must be positive"),
        ("eval.data.max_prompt_len", ev.data.max_prompt_len,
         ev.data.max_prompt_len is None or ev.data.max_prompt_len > 0, "must be positive"),
    ]  # fmt: skip
    errors += [ConfigError(key, value, fix) for key, value, ok, fix in checks if not ok]
    dp, ep = cfg.parallel.dp, in_step_ranks(cfg)
    if ep > 1 and ev.max_prompts is not None and 0 < ev.max_prompts < dp:
        errors.append(
            ConfigError(
                "eval.max_prompts",
                ev.max_prompts,
                f"at parallel.ep={ep} every one of the {dp} data-parallel ranks must decode "
                "some held-out prompts (each MoE forward is an all-to-all over the expert "
                f"group): set eval.max_prompts={dp} or more",
            )
        )
    if ev.temperature == GREEDY and ev.num_samples > 1:
        errors.append(
            ConfigError(
                "eval.num_samples",
                ev.num_samples,
                "eval.temperature=0 (greedy) makes every sample of a prompt the same: set"
                " eval.num_samples=1, or a temperature > 0",
            )
        )
    longest = eval_data(cfg).max_prompt_len + eval_rollout(cfg).max_new_tokens
    if cfg.model.max_position_embeddings < longest:
        errors.append(
            ConfigError(
                "eval.max_new_tokens",
                ev.max_new_tokens,
                f"the longest evaluation sequence (prompt {eval_data(cfg).max_prompt_len} +"
                f" response {eval_rollout(cfg).max_new_tokens} tokens) exceeds"
                f" model.max_position_embeddings={cfg.model.max_position_embeddings}",
            )
        )


def _check_data(cfg: RunConfig, errors: list[ConfigError]) -> None:
    data, own = eval_data(cfg), cfg.eval.data
    if data.source == DataSource.builtin or cfg.env.agent.verifiers:
        return  # env.agent.verifiers: refused with evaluation (rlbatch.config.agent_rules)
    key = "eval.data.path" if own.path is not None else "data.path"
    if eval_enabled(cfg) and own.path is None:
        errors.append(
            ConfigError(
                "eval.data.path",
                None,
                f"eval.every_steps={cfg.eval.every_steps} on a {data.source.name} dataset needs a"
                " held-out file: set eval.data.path=FILE (the training file is not held out)",
            )
        )
    elif not data.path:
        errors.append(ConfigError(key, None, f"source {data.source.name} needs a file"))
    elif data.source == DataSource.hf_disk and not Path(data.path).is_dir():
        errors.append(ConfigError(key, data.path, "no such directory (HF save_to_disk)"))
    elif data.source != DataSource.hf_disk and not Path(data.path).is_file():
        errors.append(ConfigError(key, data.path, "no such file"))


def _check_keep_best(cfg: RunConfig, errors: list[ConfigError]) -> None:
    metric = cfg.trainer.checkpoint.keep_best
    if metric is None:
        return
    if not eval_enabled(cfg):
        errors.append(
            ConfigError(
                "trainer.checkpoint.keep_best",
                metric,
                "needs evaluation during training: set eval.every_steps > 0",
            )
        )
        return
    names = [n for n in eval_metric_names(cfg) if n != "eval/num_prompts"]
    if metric not in names:
        errors.append(
            ConfigError(
                "trainer.checkpoint.keep_best",
                metric,
                f"is not a metric of the evaluation: use one of {', '.join(names)}",
            )
        )
