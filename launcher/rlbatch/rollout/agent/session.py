"""The calls of one round of agent episodes (rlbatch.rollout.agent.engine): the endpoint's
threads hand each call here (:meth:`AgentSession.answer`: its prompt ids, spliced onto the
episode's history when its messages continue it, its token limit and its seed), and the
generating thread takes the waiting calls to decode (:meth:`AgentSession.take`) once every
running episode has one, so which calls share a decode batch follows the harnesses' progress,
never their timing."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np

from rlbatch.config.enums import ChatTemplate, OnDivergence, ToolParser
from rlbatch.grpo.types import Prompt
from rlbatch.rollout.agent import chat
from rlbatch.rollout.agent.endpoint import CallError
from rlbatch.rollout.agent.episodes import Call, DivergenceError, branches_from
from rlbatch.rollout.protocol import DecodedRow, segment_seed

log = logging.getLogger(__name__)


IGNORED_SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")


@dataclasses.dataclass
class Limits:
    """The run's settings a call is answered under."""

    max_new_tokens: int
    max_total_tokens: int
    max_turns: int
    eos_ids: tuple[int, ...]
    template: ChatTemplate
    tool_parser: ToolParser
    on_divergence: OnDivergence


class Episode:
    """One row's episode: its calls and what the session knows of its state."""

    def __init__(self, row: int, prompt: Prompt, seed: int) -> None:
        self.row, self.prompt, self.seed = row, prompt, seed
        self.calls: list[Call] = []
        self.errors: list[str] = []
        """Calls the endpoint refused for a harness fault (n > 1, ...)."""
        self.diverged = False
        """A call diverged under env.agent.on_divergence=error."""
        self.waiting = 0
        """Calls waiting to be decoded."""
        self.closed = False
        """Its harness returned, raised or ran out of time: no call of it is sampled anymore."""
        self.late_calls = 0
        """Calls refused because they came after that (409)."""
        self.idle_since = time.monotonic()
        """When it last started or had a call answered (its harness's own work since)."""
        self.lock = threading.Lock()


@dataclasses.dataclass
class _Job:
    key: str
    episode: Episode
    prompt_ids: list[int]
    seed: int
    max_tokens: int
    future: Future


class AgentSession:
    """The episodes of one generate call, answered by the endpoint's threads (``answer``) and
    decoded by the generating thread (``take``)."""

    def __init__(
        self, limits: Limits, tokenizer: Any, episodes: dict[str, Episode], idle_s: float
    ) -> None:
        self.limits, self.tokenizer, self.episodes = limits, tokenizer, episodes
        self.idle_s = idle_s
        """env.timeout_s: an episode whose harness works longer than this between calls is
        not waited for (the others decode meanwhile)."""
        self.jobs: list[_Job] = []
        self.changed = threading.Condition()
        self.warned: set[str] = set()
        self.retired: list[str] = []
        """Keys of episodes given up on (their calls are answered 404 from then on)."""
        self.ended: dict[str, Episode] = {}
        """Episodes whose harness returned, raised or ran past its deadline (:meth:`end`)."""

    def retire(self, key: str, err: BaseException) -> None:
        """Stop serving episode ``key``: its waiting calls fail with ``err``, later ones 404."""
        with self.changed:
            ep = self.episodes.pop(key, None)
            self.retired.append(key)
            for job in [j for j in self.jobs if j.episode is ep]:
                job.future.set_exception(err)
                self.jobs.remove(job)

    def end(self, key: str) -> None:
        """Episode ``key``'s harness returned, raised or ran past its deadline: calls it left
        unanswered (a task it did not await) are dropped from its record, and every later call
        is refused (409, counted in its ``late_calls``), never sampled or trained: its reward was
        given on the calls before."""
        with self.changed:
            ep = self.episodes.pop(key, None)
            if ep is None:
                return
            self.ended[key] = ep
            with ep.lock:
                ep.closed = True
                ep.late_calls += sum(1 for c in ep.calls if c.reply is None)
                ep.calls = [c for c in ep.calls if c.reply is not None]
            gone = CallError(409, _late_text(key))
            for job in [j for j in self.jobs if j.episode is ep]:
                job.future.set_exception(gone)
                self.jobs.remove(job)
                ep.waiting -= 1

    def keys(self) -> list[str]:
        """Every episode key of the round, retired and ended ones included."""
        return [*self.episodes, *self.retired, *self.ended]

    # --------------------------------------------------------------- endpoint threads
    def answer(self, key: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        ep = self.episodes.get(key)
        if ep is None:
            self._refuse_late(self.ended.get(key), key)
            raise CallError(404, f"episode {key} is not running")
        n = body.get("n", 1)
        if n not in (1, None):
            ep.errors.append(f"asked for n={n} completions in one call: ask one per call")
            raise CallError(400, f"n={n}: this endpoint samples one completion per call (n=1)")
        self._warn_ignored(body)
        with ep.lock:
            if ep.closed:
                self._refuse_late(ep, key)
            index = len(ep.calls)
            prompt_ids, spliced, diverged = self._prompt(ep, kind, body)
            seed = _seed(ep, index, body, prompt_ids)
            call = Call(index, prompt_ids, [], [], -1, "length", seed, spliced)
            call.diverged, call.client_seed = diverged, client_seed(body)
            if kind == "chat":
                call.messages = list(body.get("messages") or [])
                call.tools = body.get("tools") or None
            ep.calls.append(call)
        limit, run_limit = self._max_tokens(body, len(prompt_ids))
        if index >= self.limits.max_turns or limit <= 0:
            call.reply = {"role": "assistant", "content": ""}
            call.truncated = True  # the run's limits answered it, not the client's
            return self._reply(call, "", [], "", [])
        job = _Job(key, ep, prompt_ids, call.seed, limit, Future())
        with self.changed:
            if ep.closed:  # ended meanwhile: end() dropped the call and counted it
                raise CallError(409, _late_text(key))
            ep.waiting += 1
            self.jobs.append(job)
            self.changed.notify_all()
        row: DecodedRow
        row, version = job.future.result()
        reply = self._finish(call, row, version, limit, body)
        call.truncated = call.finish_reason == "length" and limit >= run_limit
        return reply

    def _refuse_late(self, ep: Optional[Episode], key: str) -> None:
        """A call of an ended episode (:meth:`end`): counted, refused 409."""
        if ep is None:
            return
        ep.late_calls += 1
        raise CallError(409, _late_text(key))

    def _warn_ignored(self, body: dict[str, Any]) -> None:
        for key in IGNORED_SAMPLING:
            if body.get(key) is not None and key not in self.warned:
                self.warned.add(key)
                log.warning(
                    "agent endpoint: the client's %s=%s is ignored: completions are sampled"
                    " with rollout.temperature (the loss compares log-probs at it)",
                    key,
                    body[key],
                )

    def _max_tokens(self, body: dict[str, Any], prompt_len: int) -> tuple[int, int]:
        """(the call's token limit, the run's part of it): the least of the client's
        max_tokens, rollout.max_new_tokens and what env.max_total_tokens leaves."""
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        run_limit = min(self.limits.max_new_tokens, self.limits.max_total_tokens - prompt_len)
        if isinstance(asked, int) and asked > 0:
            return min(asked, run_limit), run_limit
        return run_limit, run_limit

    def _prompt(self, ep: Episode, kind: str, body: dict[str, Any]) -> tuple[list[int], bool, bool]:
        """(prompt ids, spliced, diverged) of a call (see rlbatch.rollout.agent.episodes)."""
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                if len(prompt) != 1:
                    raise CallError(400, "one prompt per call")
                prompt = prompt[0]
            vocab = getattr(self.tokenizer, "vocab_size", None)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
                if bad:
                    raise CallError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")  # fmt: skip
                ids = [int(t) for t in prompt]  # token in
            elif isinstance(prompt, str):
                ids = [int(t) for t in self.tokenizer.encode(prompt)]
            else:
                raise CallError(400, "prompt must be a string or a non-empty list of token ids")
            if not ids:
                raise CallError(400, "the prompt has no tokens")
            return ids, False, self._diverges(ep, ids)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise CallError(400, "messages must be a non-empty list")
        tools = body.get("tools") or None
        spliced = self._splice(ep, messages, tools)
        if spliced is not None:
            return spliced, True, False
        text = chat.render(self.limits.template, messages, self.tokenizer, tools)
        ids = [int(t) for t in self.tokenizer.encode(text)]
        return ids, False, self._diverges(ep, ids)

    def _splice(
        self, ep: Episode, messages: list[Any], tools: Optional[list[Any]]
    ) -> Optional[list[int]]:
        """An earlier call's ids + the new messages' rendering, when ``messages`` are that
        call's, its reply, then new ones (the latest such call; None when there is none)."""
        for last in reversed([c for c in ep.calls if c.completion_ids]):
            if last.messages is None or last.reply is None:
                continue
            known = len(last.messages)
            if (
                len(messages) <= known
                or (tools or None) != last.tools
                or not chat.same_messages(messages[:known], last.messages)
                or not chat.same_assistant_turn(messages[known], last.reply)
            ):
                continue
            eos = last.completion_ids[-1] in self.limits.eos_ids
            added = chat.continuation_text(
                self.limits.template, self.tokenizer, messages[known + 1 :], tools, eos
            )
            return [*last.prompt_ids, *last.completion_ids, *self.tokenizer.encode(added)]
        return None

    def _diverges(self, ep: Episode, ids: list[int]) -> bool:
        """Whether a call's prompt ``ids`` rewrites the episode's history: it neither continues
        an earlier call nor samples again from a prompt already sent (a branch)."""
        if not any(c.completion_ids for c in ep.calls) or branches_from(ids, ep.calls):
            return False
        if OnDivergence(self.limits.on_divergence) == OnDivergence.error:
            message = (
                f"call {len(ep.calls)} of episode {ep.row} (prompt index {ep.prompt.index})"
                " does not continue the episode's earlier calls (the harness rewrote or cut"
                " its history): env.agent.on_divergence=error; set it to split to train each"
                " part apart"
            )
            ep.errors.append(message)
            ep.diverged = True
            raise DivergenceError(message)
        return True

    def _finish(
        self, call: Call, row: DecodedRow, version: int, limit: int, body: dict[str, Any]
    ) -> dict[str, Any]:
        ids, logps = list(row.tokens), list(row.logps)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        eos = bool(ids) and ids[-1] in self.limits.eos_ids
        shown_ids = ids[:-1] if eos else ids
        text = self.tokenizer.decode(shown_ids)
        cut = _stop_cut(self.tokenizer, shown_ids, stops) if stops else None
        if cut is not None:
            keep, text = cut
            ids, logps, eos = ids[:keep], logps[:keep], False
        finish = "stop" if eos or cut is not None else "length" if len(ids) >= limit else "stop"
        call.completion_ids, call.logps, call.version = ids, logps, version
        call.server = row.server
        content: Optional[str] = text
        tool_calls: list[dict[str, Any]] = []
        if call.messages is not None:
            content, tool_calls = chat.parse_tool_calls(text, self.limits.tool_parser)
            if tool_calls and finish == "stop":
                finish = "tool_calls"
        call.finish_reason = finish
        call.reply = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        return self._reply(call, text, ids, content, tool_calls)

    def _reply(
        self,
        call: Call,
        text: str,
        ids: list[int],
        content: Optional[str],
        tool_calls: list[Any],
    ) -> dict[str, Any]:
        call.finish_reason = call.finish_reason if ids else "length"
        return {
            "text": text,
            "ids": ids,
            "logps": call.logps,
            "tokens": [self.tokenizer.decode([t]) for t in ids],
            "finish_reason": call.finish_reason,
            "content": content,
            "tool_calls": tool_calls,
            "prompt_tokens": len(call.prompt_ids),
        }

    # --------------------------------------------------------------- generating thread
    def take(self, running: Sequence[Episode], timeout: float) -> list[_Job]:
        """The waiting calls once every running episode has one or has worked longer than
        env.timeout_s since its last answer ([] when that is not so within ``timeout``)."""

        def ready() -> bool:
            now = time.monotonic()
            return bool(self.jobs) and all(
                ep.waiting or now - ep.idle_since > self.idle_s for ep in running
            )

        with self.changed:
            self.changed.wait_for(ready, timeout)
            if not ready():
                return []
            # in the round's episode order, not the calls' arrival order: a row's place in the
            # decode batch can move its log-probabilities by a float rounding
            jobs = sorted(self.jobs, key=lambda j: (j.episode.row, j.seed, j.prompt_ids))
            self.jobs = []
            for job in jobs:
                job.episode.waiting -= 1
            return jobs

    def fail_waiting(self, err: BaseException) -> None:
        with self.changed:
            for job in self.jobs:
                job.future.set_exception(err)
            self.jobs = []


def _late_text(key: str) -> str:
    return (
        f"episode {key} is over: its harness returned (or failed), so this call is not sampled"
        " or trained (await every call before returning)"
    )


_CLIENT_SEED_TAG = 0xC1_5EED


def _seed(ep: Episode, index: int, body: dict[str, Any], prompt_ids: list[int]) -> int:
    """A call's sampling seed (called under ``ep.lock``, before the call joins ``ep.calls``):
    from the row's seed and the call's index in its episode, or, when the client sends a
    ``seed``, from the row's seed, that seed, the call's prompt ids and how many earlier calls of
    the episode sent both. Calls sent at once arrive in any order, so their indices do; their
    seeds and prompts need not. The prompt keeps a seed sent on every call of an episode from
    replaying the same noise at each turn (each turn's prompt is longer), the count from
    replaying it on a prompt sent again (two calls at once with one seed are two samples; which
    call gets which follows their arrival)."""
    asked = client_seed(body)
    if asked is None:
        return segment_seed(ep.seed, index)
    repeat = sum(1 for c in ep.calls if c.client_seed == asked and c.prompt_ids == prompt_ids)
    ids = np.asarray(prompt_ids, dtype=np.int64).tobytes()
    digest = int.from_bytes(hashlib.blake2b(ids, digest_size=16).digest(), "little")
    entropy = [_CLIENT_SEED_TAG, ep.seed, asked, digest, repeat]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)


def client_seed(body: dict[str, Any]) -> Optional[int]:
    """The client's ``seed`` when it is one this endpoint uses (a non-negative int)."""
    asked = body.get("seed")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0:
        return asked
    return None


def _stop_cut(tokenizer: Any, ids: list[int], stops: list[str]) -> Optional[tuple[int, str]]:
    """(tokens kept, text shown) at the first stop string: the tokens up to the one that
    completes it (all sampled), the text before it."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        found = [text.find(s) for s in stops if s and s in text]
        if found:
            return n, text[: min(found)]
    return None
