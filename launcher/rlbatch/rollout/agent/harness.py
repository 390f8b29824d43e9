"""Agent harnesses by import path (env.harness): loading, checking, and reading their reward.

A harness is ``async def run(client, model, row)``: ``client`` an ``openai.AsyncOpenAI`` already
pointed at the episode's address on the run's endpoint, ``model`` the name to pass (any name is
the policy), ``row`` the dataset row (prompt, answer and every other field). It returns the
episode's reward: a number, or a dict with ``reward`` and other numbers logged with it.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from rlbatch.env.protocol import EnvCallError


def load_harness(spec: str) -> Any:
    """The ``async def run(client, model, row)`` env.harness names; ValueError saying what is
    wrong."""
    from rlbatch.grpo.user_rewards import RewardSpecError, load_callable

    try:
        fn = load_callable(spec, what="function")
    except RewardSpecError as err:
        raise ValueError(str(err)) from err
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{spec} is not an async function: define it as async def run(client, model, row)")  # fmt: skip
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError as err:
        raise ValueError(f"{spec} cannot be called as run(client, model, row): {err}") from err
    return fn


def build_harness(cfg: Any) -> tuple[Any, str, str]:
    """(the harness the run's episodes go through, how errors name it, the file the loop
    watchdog looks in for the line that blocks): env.harness's function, the built-in
    OpenEnv harness for env.agent.openenv_url (rlbatch.rollout.agent.openenv), or the built-in
    verifiers harness for env.agent.verifiers (rlbatch.rollout.agent.verifiers_env)."""
    if cfg.env.harness:
        fn = load_harness(cfg.env.harness)
        return fn, cfg.env.harness, getattr(getattr(fn, "__code__", None), "co_filename", "")
    if cfg.env.agent.verifiers:
        from rlbatch.rollout.agent import verifiers_env

        found = verifiers_env.VerifiersHarness(cfg)
        # an evaluation's engine plays eval.verifiers' environment in env.agent.verifiers' place
        held_out = cfg.eval.verifiers and cfg.eval.verifiers == cfg.env.agent.verifiers
        key = "eval.verifiers" if held_out else "env.agent.verifiers"
        return found, f"verifiers ({key}={found.spec})", verifiers_env.__file__
    from rlbatch.rollout.agent import openenv

    harness = openenv.OpenEnvHarness(cfg)
    source = getattr(getattr(harness.act, "__code__", None), "co_filename", openenv.__file__)
    return harness, f"OpenEnv (env.agent.openenv_url={harness.url})", source


def ended_truncated(value: Any) -> bool:
    """Whether a harness's return value says the episode was cut by a limit (``truncated``:
    True in its dict; a harness that ends the exchange itself at its turn or token budget, as
    verifiers does at the run's env.max_turns / env.max_total_tokens), so the episode counts as
    truncated as one the endpoint cut does."""
    return isinstance(value, dict) and value.get("truncated") is True


def episode_reward(value: Any, where: str) -> tuple[float, dict[str, float]]:
    """(reward, extra logged parts) of what a harness returned; EnvCallError when it is not a
    finite number or a dict with one under ``reward``."""
    parts: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise EnvCallError(f"{where} returned a dict without 'reward': {value!r:.120}")
        parts = {
            str(k): float(v)
            for k, v in value.items()
            if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EnvCallError(
            f"{where} returned {type(value).__name__} {value!r:.80}: return a number (the"
            " episode's reward) or a dict with 'reward'"
        )
    if not math.isfinite(float(value)):
        raise EnvCallError(f"{where} returned {value}: the reward must be finite")
    return float(value), parts
