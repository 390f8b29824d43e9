"""The ``eval`` config group: validation during training and rlbatch-eval (docs/evaluation.md).

Dataclasses only (pure, like rlbatch.config.schema, which holds the field line in RunConfig);
what the group means is :mod:`rlbatch.eval.settings`, its rules :mod:`rlbatch.config.evaluation_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlbatch.config.enums import AnswerFormat, BuiltinTask, ChatTemplate, DataSource, RewardKind


@dataclass
class EvalDataConfig:
    """The held-out prompt set; every null field takes the value of the same ``data.*`` key.
    Built-in tasks are generated from a seed of their own, without the training prompts."""

    source: Optional[DataSource] = None
    """Prompt source (builtin, jsonl, parquet, hf_disk); null = data.source."""
    task: Optional[BuiltinTask] = None
    """Built-in task when source=builtin; null = data.task."""
    path: Optional[str] = None
    """JSONL / Parquet file or HF save_to_disk directory of the held-out prompts; null =
    data.path (refused for a file dataset while training: that would not be held out)."""
    prompt_key: Optional[str] = None
    """Field holding the prompt text; null = data.prompt_key."""
    answer_key: Optional[str] = None
    """Field holding the reference answer; null = data.answer_key."""
    num_prompts: Optional[int] = None
    """Size of the generated built-in set before the training prompts are taken out; null =
    data.num_prompts."""
    max_prompt_len: Optional[int] = None
    """Longest prompt in tokens (longer ones are bad rows); null = data.max_prompt_len."""
    chat_template: Optional[ChatTemplate] = None
    """Chat template of the prompts; null = data.chat_template."""
    answer_format: Optional[AnswerFormat] = None
    """raw or gsm8k reading of the answer field; null = data.answer_format."""


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate every this many optimizer steps and after the last one (0 = no evaluation)."""
    at_start: bool = True
    """With every_steps > 0: also evaluate the initial policy (a step-0 baseline)."""
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    """The held-out prompts (null keys: as data.*)."""
    verifiers: Optional[str] = None
    """With env.agent.verifiers: the verifiers environment whose taskset holds the held-out
    tasks (an installed environment's id, or a local .py file or package directory, as
    env.agent.verifiers), its tasks the evaluation's rows, its episodes and rewards the
    evaluation's (a verifiers 0.4 taskset has no held-out split of its own); eval.data is not
    read. null = no evaluation of a verifiers run (refused with eval.every_steps > 0)."""
    max_prompts: Optional[int] = 256
    """Evaluate the first this many prompts of the set; null = all of them."""
    num_samples: int = 4
    """Samples per prompt (N of pass@k, mean@N, maj@N)."""
    temperature: Optional[float] = None
    """Sampling temperature; 0 = greedy (then num_samples must be 1); null =
    rollout.temperature."""
    top_p: Optional[float] = None
    """Nucleus sampling mass in (0, 1]; null = rollout.top_p."""
    max_new_tokens: Optional[int] = None
    """Longest response in tokens; null = rollout.max_new_tokens."""
    pass_k: Optional[list[int]] = None
    """The k of each reported pass@k, each in 1..num_samples; null = 1 and num_samples."""
    correct_threshold: float = 0.5
    """A sample is correct when its reward is above this."""
    reward: Optional[RewardKind] = None
    """Built-in reward of the evaluation; null = the training reward (data.reward_fn with
    data.reward_weights when set, else data.reward)."""
    reward_fn: list[str] = field(default_factory=list)
    """Rewards by import path or built-in name, summed (as data.reward_fn); [] =
    eval.reward."""
