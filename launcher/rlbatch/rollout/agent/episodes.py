"""An agent episode's calls, and the training samples they make, without re-tokenizing.

A harness sends messages, never tokens. The endpoint keeps each episode's token history: a call
whose messages are the previous call's messages, then the assistant message the endpoint
returned for it, then new messages (tool results, the user's next turn), gets as its prompt
the previous call's exact prompt ids and sampled ids, followed by the new messages' rendering
alone (rlbatch.rollout.agent.chat.continuation_text): the *splice*. So a template that drops
earlier turns' reasoning, a stop string missing from the returned text, or a tokenizer whose
decode / encode round trip is not the identity never changes a token the policy sampled.

A call whose messages are anything else (the harness rewrote, summarised or cut its history)
is rendered whole; unless its ids still extend the episode's token for token, it *diverges*:
env.agent.on_divergence=split starts a new segment there (counted), error stops the run.

:func:`assemble` turns the calls into segments, purely from their token ids: a call whose
prompt extends the current segment's prompt + response joins it (the tokens between the last
completion and the new one are masked: the policy did not sample them), any other starts a new
one. Every sampled token is in exactly one segment, with the log-probability it was sampled
with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Call:
    """One chat or completion call of an episode, as the endpoint served it."""

    index: int
    """Its place in the episode (0, 1, ...)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    """The sampled ids (a stop string's tokens included; EOS included when sampled)."""
    logps: list[float]
    """Behaviour log-probability of each sampled id."""
    version: int
    """Policy version of the weights that sampled it."""
    finish_reason: str
    """stop | length | tool_calls."""
    seed: int
    spliced: bool = False
    """Its prompt is the episode's token history + the new messages' rendering."""
    diverged: bool = False
    """Its prompt does not extend the episode's previous call (a new segment starts)."""
    messages: Optional[list[Any]] = None
    """The chat messages it was given (None: a completions call)."""
    tools: Optional[list[Any]] = None
    reply: Optional[dict[str, Any]] = None
    """The assistant message returned (chat calls)."""
    server: Optional[str] = None
    """The rollout server that decoded it (rollout.backend=vllm_server); None elsewhere."""

    def record(self) -> dict[str, Any]:
        """What the episode record (logging.samples) shows of it."""
        return {
            "index": self.index,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logps": self.logps,
            "version": self.version,
            "finish_reason": self.finish_reason,
            "spliced": self.spliced,
            "diverged": self.diverged,
            "server": self.server,
        }


@dataclass
class Segment:
    """One training sample's worth of an episode: a prompt and every token after it."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    truncated: bool = False
    """Its last completion stopped at a length limit."""

    @property
    def sequence(self) -> list[int]:
        return [*self.prompt_ids, *self.ids]

    def extended_by(self, prompt_ids: Sequence[int]) -> bool:
        seq = self.sequence
        return len(prompt_ids) >= len(seq) and list(prompt_ids[: len(seq)]) == seq

    def add(self, call: Call) -> None:
        gap = list(call.prompt_ids[len(self.prompt_ids) + len(self.ids) :])
        self.ids += gap + call.completion_ids
        self.mask += [0] * len(gap) + [1] * len(call.completion_ids)
        self.logps += [0.0] * len(gap) + list(call.logps)
        self.calls.append(call.index)
        self.truncated = call.finish_reason == "length"


def assemble(calls: Sequence[Call]) -> list[Segment]:
    """The segments of an episode's calls (see the module docstring); calls answered without
    sampling (past env.max_turns) add nothing."""
    segments: list[Segment] = []
    for call in calls:
        if not call.completion_ids:
            continue
        if not segments or not segments[-1].extended_by(call.prompt_ids):
            segments.append(Segment(list(call.prompt_ids)))
        segments[-1].add(call)
    return segments


class DivergenceError(RuntimeError):
    """env.agent.on_divergence=error and a call rewrote its episode's history."""
