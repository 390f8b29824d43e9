"""The environment protocol: ``reset(row) -> state``, ``step(state, text) -> StepResult``.

An environment is any class with these two methods (either may be ``async def``)::

    class MyEnv:
        def __init__(self, **kwargs): ...            # env.kwargs
        def reset(self, row: dict) -> Any: ...       # per episode: the dataset row
        def step(self, state, text: str) -> dict:    # after each assistant turn
            return {"observation": "...", "done": False, "reward": 0.0}

``step`` returns a mapping with the keys ``observation`` (a ``str`` appended as the next turn,
or ``None`` when the episode is over), ``done`` (bool) and optionally ``reward`` (a number,
default 0), or an object with those attributes (:class:`StepResult` is one). The state is the
environment's own: rlbatch passes it back untouched, so it may be mutated in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol


class Environment(Protocol):
    """What ``env.path`` names (docs/environments.md)."""

    def reset(self, row: dict[str, Any]) -> Any:
        """Start an episode for one dataset row (prompt, answer and every other field); returns
        the episode's state."""
        ...

    def step(self, state: Any, text: str) -> Any:
        """React to one assistant turn (its decoded text, EOS excluded): a StepResult-like
        mapping or object."""
        ...


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns (as this class, any object with these attributes, or a dict)."""

    observation: Optional[str] = None
    """Text appended as the next turn; None ends the episode."""
    done: bool = False
    """The episode is over (no further turn even with an observation)."""
    reward: float = 0.0
    """Reward of this step; a trajectory's environment reward is the sum over its steps."""


class EnvSpecError(ValueError):
    """env.path cannot be loaded, or the class lacks what the protocol needs."""


class EnvCallError(Exception):
    """An environment's reset / step raised, timed out or returned the wrong type (or every
    episode of a step failed); the message names the environment class, the sample and the
    turn. Not a RuntimeError: the training loop reads a RuntimeError whose message mentions a
    timeout as a collective timeout, and this message may name env.timeout_s."""


def as_step_result(value: Any, where: str) -> StepResult:
    """Normalise what ``step`` returned; EnvCallError naming what was expected."""
    expected = (
        "step must return a dict with keys 'observation' (str or None), 'done' (bool) and"
        " optionally 'reward' (a number), or an object with those attributes"
    )
    if isinstance(value, StepResult):
        fields = value.__dict__
    elif isinstance(value, Mapping):
        fields = dict(value)
    elif all(hasattr(value, k) for k in ("observation", "done")):
        fields = {
            k: getattr(value, k) for k in ("observation", "done", "reward") if hasattr(value, k)
        }
    else:
        raise EnvCallError(f"{where}: returned {type(value).__name__} {value!r:.80}: {expected}")
    missing = [k for k in ("observation", "done") if k not in fields]
    if missing:
        raise EnvCallError(f"{where}: returned {value!r:.120} without {missing}: {expected}")
    observation, done, reward = fields["observation"], fields["done"], fields.get("reward", 0.0)
    if observation is not None and not isinstance(observation, str):
        raise EnvCallError(
            f"{where}: observation is {type(observation).__name__}, expected str or None"
        )
    if not isinstance(done, bool):
        raise EnvCallError(f"{where}: done is {type(done).__name__} {done!r}, expected bool")
    if reward is None:
        reward = 0.0
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise EnvCallError(f"{where}: reward is {type(reward).__name__}, expected a number")
    if not math.isfinite(float(reward)):
        raise EnvCallError(f"{where}: reward is {reward}, expected a finite number")
    return StepResult(observation, done, float(reward))
