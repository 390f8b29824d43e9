"""What the ``eval`` group means once the training config fills its nulls (pure, no torch).

:func:`eval_data` is the held-out prompt set as a DataConfig (null ``eval.data.*`` keys from
``data.*``, the evaluation's reward in its reward fields); :func:`eval_rollout` the sampling
settings; :func:`eval_metric_names` the metrics an evaluation reports (what
``trainer.checkpoint.keep_best`` may name); :func:`eval_due` the steps the loop evaluates at.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

from rlbatch.config.env import multi_turn
from rlbatch.config.schema import DataConfig, RolloutConfig, RunConfig

GREEDY = 0.0
"""eval.temperature that means greedy decoding."""


def eval_enabled(cfg: RunConfig) -> bool:
    """Evaluation during training is on (eval.every_steps > 0)."""
    return cfg.eval.every_steps > 0


def eval_due(cfg: RunConfig, step: int) -> bool:
    """Whether the loop evaluates after optimizer step ``step`` (0: the initial policy)."""
    every = cfg.eval.every_steps
    if every <= 0:
        return False
    if step == 0:
        return cfg.eval.at_start
    return step % every == 0 or step == cfg.trainer.max_steps


def eval_data_seed(seed: int) -> int:
    """The seed that generates a built-in evaluation set: another one than training's."""
    return int(hashlib.sha256(f"rlbatch-eval:{seed}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def eval_data(cfg: RunConfig) -> DataConfig:
    """The evaluation prompts and reward as a DataConfig (null eval.data keys: data.*)."""
    own = {
        f.name: getattr(cfg.eval.data, f.name)
        for f in dataclasses.fields(cfg.eval.data)
        if getattr(cfg.eval.data, f.name) is not None
    }
    data = dataclasses.replace(cfg.data, **own, shuffle=False)
    ev = cfg.eval
    if ev.reward_fn:
        return dataclasses.replace(data, reward_fn=list(ev.reward_fn), reward_weights=None)
    if ev.reward is not None:
        return dataclasses.replace(data, reward=ev.reward, reward_fn=[], reward_weights=None)
    return data


def eval_rollout(cfg: RunConfig) -> RolloutConfig:
    """Sampling settings of the evaluation (null keys: rollout.*); greedy = top_k 1."""
    ev, r = cfg.eval, cfg.rollout
    temperature = r.temperature if ev.temperature is None else ev.temperature
    greedy = temperature == GREEDY
    return dataclasses.replace(
        r,
        temperature=1.0 if greedy else temperature,
        top_k=1 if greedy else r.top_k,
        top_p=r.top_p if ev.top_p is None else ev.top_p,
        max_new_tokens=r.max_new_tokens if ev.max_new_tokens is None else ev.max_new_tokens,
    )


def eval_pass_k(cfg: RunConfig) -> list[int]:
    """The k of each pass@k: eval.pass_k, or 1 and num_samples."""
    if cfg.eval.pass_k is not None:
        return list(cfg.eval.pass_k)
    return sorted({1, cfg.eval.num_samples})


def majority_supported(cfg: RunConfig) -> bool:
    """Whether the evaluation's reward grades an answer maj@N can vote on."""
    from rlbatch.eval.answers import voting_kind

    data = eval_data(cfg)
    return voting_kind(data.reward, data.reward_fn) is not None


def eval_metric_names(cfg: RunConfig) -> list[str]:
    """The metrics of one evaluation (eval/reward_mean, eval/pass@k, ...)."""
    from rlbatch.eval.metrics import metric_names

    return metric_names(
        eval_pass_k(cfg),
        cfg.eval.num_samples,
        majority_supported(cfg),
        multi_turn(cfg.env),
    )


def in_step_ranks(cfg: RunConfig) -> int:
    """The expert-parallel size evaluation's ranks must keep in step at: on the built-in engine
    each MoE forward is an all-to-all over the expert group, and on vLLM the weight sync before
    the first generate call gathers the experts over it (a rank with no block would never make
    that call, and its peers would wait for it)."""
    return cfg.parallel.ep


def blocks_needed(prompts: int, size: int, dp: int) -> int:
    """The generate calls (blocks of at most ``size`` prompts) evaluation makes when its ranks
    must keep in step: a multiple of dp, every rank making as many (rlbatch.eval.runner's
    prompt_blocks); each block needs a prompt."""
    calls = math.ceil(prompts / size)
    return dp * math.ceil(calls / dp)
