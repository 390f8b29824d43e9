"""Records that flow through a GRPO step (shared by rollout, aggregation, loss and loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class Prompt:
    """One dataset prompt, tokenized."""

    index: int
    """Index in the dataset (stable across epochs)."""
    prompt_ids: tuple[int, ...]
    answer: str
    """Reference answer given to the reward function."""
    text: str = ""
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    """The dataset row's other fields (given to reward functions that ask for them)."""


@dataclass
class Sample:
    """One completion of one prompt (a GRPO group has num_generations of them, contiguous)."""

    prompt: Prompt
    group_id: int
    """Unique id of the prompt occurrence (siblings share it)."""
    response_ids: list[int]
    behaviour_logps: list[float]
    """Per response token, from the policy that generated it (len == len(response_ids))."""
    truncated: bool
    """Hit max_new_tokens without EOS."""
    policy_version: int
    """Optimizer steps the generating policy had taken."""
    reward: float = 0.0
    advantage: float = 0.0
    old_logps: Optional[list[float]] = None
    """Per response token, from the policy at the start of the training step(s)."""
    ref_logps: Optional[list[float]] = None
    """Per response token, from the reference model (beta > 0)."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Tokens of the full sequence (prompt + response)."""
        return len(self.prompt.prompt_ids) + len(self.response_ids)

    @property
    def input_ids(self) -> list[int]:
        return list(self.prompt.prompt_ids) + list(self.response_ids)
