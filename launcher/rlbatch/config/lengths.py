"""The longest sequence a run can produce, for the checks that bound it (positions, vLLM's
model length, the planner's budget): torch-free, imported by the rule modules and validate."""

from __future__ import annotations

from rlbatch.config.env import multi_turn
from rlbatch.config.schema import RunConfig


def longest_sequence(cfg: RunConfig) -> int:
    """The longest possible sample: max prompt + max new tokens (single turn), or
    env.max_total_tokens (a multi-turn trajectory)."""
    if multi_turn(cfg.env):
        return cfg.env.max_total_tokens
    return cfg.data.max_prompt_len + cfg.rollout.max_new_tokens


def longest_sequence_text(cfg: RunConfig) -> str:
    """Where :func:`longest_sequence` comes from, for error messages."""
    if multi_turn(cfg.env):
        return "env.max_total_tokens"
    return "data.max_prompt_len + rollout.max_new_tokens"
