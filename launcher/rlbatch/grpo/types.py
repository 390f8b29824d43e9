"""Records that flow through a GRPO step (shared by rollout, aggregation, loss and loop)."""

from __future__ import annotations

from collections.abc import Sequence
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
    raw: Any = field(default=None, hash=False, compare=False)
    """The prompt as the dataset row holds it (text or chat messages, before the chat
    template): what an environment's reset(row) reads."""


@dataclass
class Sample:
    """One completion of one prompt (a GRPO group has num_generations of them, contiguous).

    The per-token record every stage reads (created once by the rollout side, never
    re-derived from text downstream). ``response_ids`` is everything after the prompt, in the
    exact ids the model saw: for a multi-turn trajectory the assistant turns as sampled with the
    environment's observation tokens between them. Every per-token list below has the length of
    ``response_ids``:

    - ``loss_mask``: 1 for tokens the policy sampled (they carry loss, KL, entropy and count in
      every normalization divisor), 0 for tokens it did not (observations, tool results);
    - ``behaviour_logps``: the sampling policy's log-prob of each sampled token (0.0 where the
      mask is 0: never read there);
    - ``token_versions``: the policy version that sampled each token (a row continued under
      newer weights carries several);
    - ``token_advantages`` (on-policy distillation, else None): the per-token advantage the
      teacher gives each sampled token (0.0 where the mask is 0), added in the loss to
      ``advantage`` (the group reward advantage) times grpo.distill.reward_coef.
    """

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
    loss_mask: Optional[list[int]] = None
    """Per response token: 1 sampled by the policy (trained on), 0 not (observation). Filled with
    ones when a single-turn rollout leaves it out."""
    token_versions: Optional[list[int]] = None
    """Per response token: the policy version that sampled it. Filled with ``policy_version``
    when left out."""
    token_advantages: Optional[list[float]] = None
    """Per response token: the dense (teacher) advantage, rlbatch.grpo.distill; None without
    distillation (the loss then uses ``advantage`` alone on every token)."""
    episode: Optional[dict[str, Any]] = None
    """Multi-turn rollouts (env.path): the episode's record (rlbatch.env.driver.Episode: turns
    with role and text, the environment's rewards, why it ended, seconds in environment calls);
    None for single-turn samples."""
    routing: Optional[Any] = None
    """MoE policies rolled out on the built-in engine: the experts every token (prompt and
    response) was routed to as the rollout fed it, an int8 / int16 array ``[length,
    num_moe_layers, k]`` (-1 = unknown: the last token, never fed), what
    grpo.routing_replay=r3 replays and ``moe/routing_mismatch`` compares against
    (rlbatch.engine.routing)."""
    old_routing: Optional[Any] = None
    """grpo.routing_replay=r2: the same record from the old-logprob pass, which the training
    forward and backward replay."""
    reward_failures: list[str] = field(default_factory=list)
    """Why the sample's brought rewards (code_exec tests, served requests) failed, one line per
    failure: ``<reward part>: <reason>: <detail>`` (logged samples)."""
    skipped: bool = False
    """The episode ended in an environment or harness error under env.on_error=skip: it carries
    no loss (every token of it, earlier segments included, is masked out), takes no part in its
    group's baseline or scale, and its advantage is 0 (rlbatch.grpo.stages.skip_episode)."""
    earlier_segments: list[Sample] = field(default_factory=list)
    """A split or branched agent episode (env.agent.on_divergence=split, best-of-k calls): its
    segments other than the one where it ended (the one holding its last call), in the order its
    calls created them, each its own training sample (its own prompt, tokens, mask and
    behaviour logps). This sample is the segment where the episode ended and the row of its
    group: reward, advantage and truncation are the episode's, computed on this sample, and
    :func:`trained_samples` hands them to the earlier segments. Empty for every other
    sample."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if self.loss_mask is None:
            self.loss_mask = [1] * n
        if self.token_versions is None:
            self.token_versions = [self.policy_version] * n
        for name in ("behaviour_logps", "loss_mask", "token_versions"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"Sample.{name} has {got} entries for {n} response tokens")
        if self.token_advantages is not None and len(self.token_advantages) != n:
            raise ValueError(
                f"Sample.token_advantages has {len(self.token_advantages)} entries for {n}"
                " response tokens"
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Samples pickled before the per-token fields existed load with their defaults."""
        self.__dict__.update(state)
        self.__dict__.setdefault("episode", None)
        self.__dict__.setdefault("reward_failures", [])
        self.__dict__.setdefault("token_advantages", None)
        self.__dict__.setdefault("routing", None)
        self.__dict__.setdefault("old_routing", None)
        self.__dict__.setdefault("earlier_segments", [])
        self.__dict__.setdefault("skipped", False)
        if self.__dict__.get("loss_mask") is None or self.__dict__.get("token_versions") is None:
            self.__dict__.setdefault("loss_mask", None)
            self.__dict__.setdefault("token_versions", None)
            self.__post_init__()

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens that carry loss (mask 1)."""
        assert self.loss_mask is not None
        return sum(self.loss_mask)

    @property
    def length(self) -> int:
        """Tokens of the full sequence (prompt + response)."""
        return len(self.prompt.prompt_ids) + len(self.response_ids)

    @property
    def input_ids(self) -> list[int]:
        return list(self.prompt.prompt_ids) + list(self.response_ids)


def trained_samples(rows: Sequence[Sample]) -> list[Sample]:
    """Every sample an optimizer step trains from ``rows`` (one per episode): the rows in order,
    then the earlier segments of split agent episodes (:attr:`Sample.earlier_segments`), in row
    and segment order, each handed its episode's group, reward, advantage, truncation and skip:
    the reward is the episode's, so grpo.mask_truncated_completions masks an episode cut short
    whole, and not a segment whose own last call stopped at a length limit while the episode
    went on. Without split episodes: ``rows`` itself, in the same order (the rows' groups stay
    contiguous runs, which the planner's sibling spreading reads)."""
    extra = []
    for row in rows:
        for part in row.earlier_segments:
            part.group_id, part.reward, part.advantage = row.group_id, row.reward, row.advantage
            part.truncated = row.truncated
            part.skipped = row.skipped
            extra.append(part)
    return [*rows, *extra]


def group_rows(prompts: Sequence[Prompt], num_generations: int) -> list[tuple[int, Prompt]]:
    """(group index, prompt) per row: each prompt repeated num_generations times contiguously,
    as every rollout engine lays out its rows. A prompt without tokens is an error."""
    rows = [(g, p) for g, p in enumerate(prompts) for _ in range(num_generations)]
    if rows and min(len(p.prompt_ids) for _, p in rows) < 1:
        raise ValueError("a prompt has no tokens: every prompt needs >= 1 token (e.g. a BOS)")
    return rows
