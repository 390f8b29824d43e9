"""The built-in multi-turn game: guess the number (``env.path=rlbatch.env.guess_number:GuessNumber``).

The row's answer is the secret (an integer in [low, high]). Each assistant turn's first integer
is a guess; the observation is ``higher`` (the secret is larger), ``lower`` or, for a turn
without an integer, ``say a number``. A right guess ends the episode with reward 1; an episode
cut by env.max_turns keeps the partial credit of its closest guess,
``0.5 * (1 - |guess - secret| / (high - low))``, given at the step that made it (so the sum of
the step rewards is the episode's reward).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from rlbatch.env.protocol import StepResult

NUMBER = re.compile(r"-?\d+")


@dataclass
class GuessState:
    secret: int
    best: float = 0.0
    """Partial credit of the closest guess so far (already paid out)."""


class GuessNumber:
    """Higher / lower feedback until the secret is found."""

    def __init__(self, low: int = 0, high: int = 9, answer_key: str = "answer") -> None:
        if high <= low:
            raise ValueError(f"env.kwargs: high={high} must be above low={low}")
        self.low, self.high, self.answer_key = low, high, answer_key

    def reset(self, row: dict[str, Any]) -> GuessState:
        return GuessState(secret=int(str(row[self.answer_key]).strip()))

    def _closeness(self, guess: int, secret: int) -> float:
        return 0.5 * max(0.0, 1.0 - abs(guess - secret) / (self.high - self.low))

    def step(self, state: GuessState, text: str) -> StepResult:
        found: Optional[re.Match[str]] = NUMBER.search(text)
        if found is None:
            return StepResult("say a number", False, 0.0)
        guess = int(found.group())
        if guess == state.secret:
            reward, state.best = 1.0 - state.best, 1.0
            return StepResult(None, True, reward)
        credit = self._closeness(guess, state.secret)
        reward = max(0.0, credit - state.best)  # pay only the improvement: the sum is the best
        state.best = max(state.best, credit)
        return StepResult("higher" if state.secret > guess else "lower", False, reward)
