"""The built-in tool-calling environment: a calculator (``env.path=rlbatch.env.calculator:Calculator``).

Call format (documented in docs/environments.md): an assistant turn that contains
``<calc>EXPRESSION</calc>`` calls the calculator on the first such expression (``+ - * /``,
parentheses, decimals; parsed by :mod:`rlbatch.env.arithmetic`, never ``eval``); the
observation is ``<result>VALUE</result>`` or ``<error>WHAT</error>``. A turn without a call is
the final answer: the episode ends and is scored against the row's answer.

Reward of the final answer (dense, for small models): the partial credit of the built-in
digit_copy task (rlbatch.grpo.tasks.digit_copy_reward: 1.0 for exactly the answer, something
for digits at the right places and the right length), plus ``call_reward`` for every
well-formed call (default 0). An episode that ends without a final answer (max_turns) is scored
by its last turn the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlbatch.env.arithmetic import ArithmeticError_, evaluate, format_number
from rlbatch.env.protocol import StepResult
from rlbatch.grpo.tasks import digit_copy_reward

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)


@dataclass
class CalculatorState:
    answer: str
    calls: list[str] = field(default_factory=list)


class Calculator:
    """Tool calls ``<calc>...</calc>`` answered with ``<result>...</result>``."""

    def __init__(self, answer_key: str = "answer", call_reward: float = 0.0) -> None:
        self.answer_key = answer_key
        self.call_reward = call_reward

    def reset(self, row: dict[str, Any]) -> CalculatorState:
        return CalculatorState(answer=str(row[self.answer_key]).strip())

    def step(self, state: CalculatorState, text: str) -> StepResult:
        call = CALL.search(text)
        if call is None:  # the final answer
            return StepResult(None, True, digit_copy_reward(text.strip(), state.answer))
        state.calls.append(call.group(1))
        try:
            observation = f"<result>{format_number(evaluate(call.group(1)))}</result>"
            reward = self.call_reward
        except ArithmeticError_ as err:
            observation, reward = f"<error>{err}</error>", 0.0
        return StepResult(observation, False, reward)
