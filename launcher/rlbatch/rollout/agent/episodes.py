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
prompt extends a segment's prompt + response joins it (the tokens between the last completion
and the new one are masked: the policy did not sample them), any other starts a new one. Every
sampled token is in exactly one segment, with the log-probability it was sampled with.

A new segment is a *branch* when its call samples again from a point the episode already
reached: the same prompt as an earlier call (two calls at once, best-of-k), or an earlier
call's prompt + completion followed by new turns (the harness went on from a reply other than
the latest). Anything else is a *split*: the harness rewrote its history. Both train as their
own samples; only splits are divergences (env.agent.on_divergence).
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
    """The seed it sampled from (rlbatch.rollout.agent.session: from the row's seed and its
    index, or from the client's ``seed`` and its prompt)."""
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
    client_seed: Optional[int] = None
    """The ``seed`` the client sent, if any."""
    truncated: bool = False
    """It stopped at a token limit of the run (rollout.max_new_tokens, env.max_total_tokens),
    not at the client's own smaller ``max_tokens`` (both answer finish_reason=length)."""

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
            "truncated": self.truncated,
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
    """Its last completion stopped at a token limit of the run (:attr:`Call.truncated`)."""
    branch: bool = False
    """It samples again from a point the episode already reached (not a rewritten history)."""

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
        self.truncated = call.truncated


def _extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(ids) >= len(prefix) and list(ids[: len(prefix)]) == list(prefix)


def branches_from(prompt_ids: Sequence[int], earlier: Sequence[Call]) -> bool:
    """Whether a prompt samples again from a point the ``earlier`` calls reached: one's prompt
    exactly, or one's prompt + completion followed by new turns (a branch, not a rewrite)."""
    return any(
        list(prompt_ids) == c.prompt_ids
        or (c.completion_ids and _extends(prompt_ids, [*c.prompt_ids, *c.completion_ids]))
        for c in earlier
    )


def assemble(calls: Sequence[Call]) -> list[Segment]:
    """The segments of an episode's calls (see the module docstring); calls answered without
    sampling (past env.max_turns) add nothing."""
    segments: list[Segment] = []
    sampled: list[Call] = []
    for call in calls:
        if not call.completion_ids:
            continue
        home = next((s for s in reversed(segments) if s.extended_by(call.prompt_ids)), None)
        if home is None:
            home = Segment(list(call.prompt_ids))
            home.branch = bool(segments) and branches_from(call.prompt_ids, sampled)
            segments.append(home)
        home.add(call)
        sampled.append(call)
    return segments


def final_segment(segments: Sequence[Segment], calls: Sequence[Call]) -> int:
    """The index in ``segments`` (:func:`assemble`'s) of the segment where the episode ended:
    the one holding its last call (``calls[-1]``, whatever order the segments were created in),
    or, when that call was answered without sampling (past env.max_turns, no room left under
    env.max_total_tokens), the latest one its prompt extends, else the one holding the latest
    sampled call."""
    if not segments:
        raise ValueError("an episode without sampled calls has no segment")
    last = calls[-1]
    for k, seg in enumerate(segments):
        if last.index in seg.calls:
            return k
    for k in reversed(range(len(segments))):
        if segments[k].extended_by(last.prompt_ids):
            return k
    latest = max(c for seg in segments for c in seg.calls)
    return next(k for k, seg in enumerate(segments) if latest in seg.calls)


class DivergenceError(RuntimeError):
    """env.agent.on_divergence=error and a call rewrote its episode's history."""
