"""Built-in tasks: generated from a seed, no download, verifiable, with partial credit.

Both tasks are made for the tiny CPU model (2 layers, hidden 64, byte tokenizer) to show a
reward that rises within ~60 GRPO steps. Why they are learnable (docs/data_and_rewards.md):

- the reward is dense: a random byte policy already scores a little (length and digit terms),
  so most GRPO groups have non-zero reward variance from step 0 and advantages are non-zero;
- the first improvements need no conditioning on the prompt at all ("emit digits", "stop
  earlier"), which a 2-layer model learns by shifting its output biases; copying the exact
  digits (digit_copy) or counting to the target (target_length) then adds reward on top.

Rewards here take the decoded response text (EOS excluded) and the response token count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlbatch.config.schema import BuiltinTask

DIGIT_COPY_MIN_DIGITS = 2
"""Shortest number to copy."""
DIGIT_COPY_MAX_DIGITS = 4
"""Longest number to copy."""
TARGET_LENGTH_MIN = 2
"""Smallest target response length (tokens)."""
TARGET_LENGTH_MAX = 12
"""Largest target response length (tokens); below rollout.max_new_tokens=24."""
LENGTH_SCALE = 24.0
"""Length error at which the length terms reach zero: the default rollout.max_new_tokens, so a
random policy that never emits EOS still gets a (small) gradient towards stopping earlier."""

# digit_copy reward weights: exact positional matches, digit-ness of the answer positions,
# closeness of the response length to the answer length. They sum to 1.
W_MATCH = 0.6
W_DIGIT = 0.2
W_LENGTH = 0.2


@dataclass(frozen=True)
class TaskExample:
    """One prompt of a dataset, before chat templating and tokenization."""

    prompt: str
    answer: str


def generate_examples(task: BuiltinTask, num_prompts: int, seed: int) -> list[TaskExample]:
    """The built-in dataset of `task`: `num_prompts` examples, a pure function of `seed`."""
    if num_prompts <= 0:
        raise ValueError(f"data.num_prompts={num_prompts} must be positive: set it to e.g. 4096")
    rng = random.Random(f"{task.value}:{seed}")
    if task == BuiltinTask.digit_copy:
        return [_digit_copy_example(rng) for _ in range(num_prompts)]
    if task == BuiltinTask.target_length:
        return [_target_length_example(rng) for _ in range(num_prompts)]
    raise ValueError(f"data.task={task!r} is not a built-in task: use one of {list(BuiltinTask)}")


def _digit_copy_example(rng: random.Random) -> TaskExample:
    n = rng.randint(DIGIT_COPY_MIN_DIGITS, DIGIT_COPY_MAX_DIGITS)
    digits = "".join(str(rng.randint(0, 9)) for _ in range(n))
    return TaskExample(prompt=f"copy:{digits}=", answer=digits)


def _target_length_example(rng: random.Random) -> TaskExample:
    n = rng.randint(TARGET_LENGTH_MIN, TARGET_LENGTH_MAX)
    return TaskExample(prompt=f"say {n} chars:", answer=str(n))


def _length_score(actual: int, target: int) -> float:
    """1 at the target length, falling linearly to 0 at LENGTH_SCALE away."""
    return max(0.0, 1.0 - abs(actual - target) / LENGTH_SCALE)


def digit_copy_reward(response: str, answer: str) -> float:
    """Partial credit in [0, 1] for copying `answer` (digits) into `response`.

    0.6 x (positions i < len(answer) with response[i] == answer[i]) / len(answer)
    + 0.2 x (digits among the first len(answer) response characters) / len(answer)
    + 0.2 x max(0, 1 - |len(response) - len(answer)| / 24).
    Exactly the answer (then EOS) scores 1.0; the answer followed by junk scores less.
    """
    n = len(answer)
    if n == 0:
        return 0.0
    head = response[:n]
    matches = sum(1 for a, b in zip(head, answer, strict=False) if a == b)
    digits = sum(1 for c in head if c.isascii() and c.isdigit())
    return W_MATCH * matches / n + W_DIGIT * digits / n + W_LENGTH * _length_score(len(response), n)


def target_length_reward(num_response_tokens: int, answer: str) -> float:
    """1.0 when the response has exactly int(answer) tokens (EOS excluded), linear falloff."""
    return _length_score(num_response_tokens, int(answer))


def task_reward(task: BuiltinTask, response: str, answer: str, num_response_tokens: int) -> float:
    """The verifiable reward of built-in `task` for one response."""
    if task == BuiltinTask.digit_copy:
        return digit_copy_reward(response, answer)
    if task == BuiltinTask.target_length:
        return target_length_reward(num_response_tokens, answer)
    raise ValueError(f"data.task={task!r} is not a built-in task: use one of {list(BuiltinTask)}")
