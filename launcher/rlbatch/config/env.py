"""Config group ``env``: multi-turn environments and tool calls (docs/environments.md).

With ``env.path`` null (the default) rollouts are single-turn: one prompt, one completion,
exactly as without this group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlbatch.config.enums import EnvOnError


@dataclass
class EnvConfig:
    path: Optional[str] = None
    """Environment class by import path: ``PATH.py:Class`` or ``module.path:Class`` (built-ins:
    ``rlbatch.env.calculator:Calculator``, ``rlbatch.env.guess_number:GuessNumber``); null =
    single-turn rollouts."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the environment class is constructed with."""
    max_turns: int = 4
    """Assistant turns per episode; an episode still going after this many is truncated."""
    max_observation_tokens: int = 64
    """Tokens of one rendered observation, its chat wrapper included; a longer one has its
    content cut (the wrapper kept) to this many (``observations_cut`` metric). Must exceed the
    wrapper of data.chat_template (qwen with the byte tokenizer: 84)."""
    max_total_tokens: int = 256
    """Tokens of a whole trajectory (prompt, every assistant turn and observation); reaching it
    ends the episode as truncated. Also the longest sequence the token budgets must hold."""
    timeout_s: float = 30.0
    """Longest one reset / step call may take; beyond it the call counts as an error."""
    max_concurrency: int = 16
    """Threads that run synchronous reset / step calls at once (async ones share one loop)."""
    on_error: EnvOnError = EnvOnError.raise_error
    """raise_error: an exception, timeout or wrong return type stops the run naming the
    environment, the sample and the turn; zero_reward: that episode ends with reward 0 (every
    reward part 0)."""
    max_error_fraction: float = 0.5
    """zero_reward: a step where more than this fraction of the episodes that reached the
    environment failed is a warning; a step where all of them failed stops the run."""
