"""Rollouts through agent harnesses (env.harness): the loop's RolloutEngine for them.

``generate`` runs one episode per row: the harness's ``run(client, model, row)`` on an event
loop thread, its client pointed at the episode's address on this rank's endpoint
(rlbatch.rollout.agent.endpoint). The endpoint's threads hand each call's prompt ids here
(:class:`AgentSession`); the calling thread decodes them on the run's engine at the current
weights and answers. Decoding waits until every running episode has a call waiting (or has
ended, or has worked on its own longer than env.timeout_s since its last answer), so for
harnesses whose own work between calls stays under env.timeout_s, which calls share a decode
batch follows the harnesses' progress, never their timing; each call samples from ``segment_seed(row seed, call index)``: a deterministic harness
gives the same episodes again (resume included). At most env.max_concurrency episodes run at
once; each is bounded by env.agent.episode_timeout_s.

Each episode's calls become samples by rlbatch.rollout.agent.episodes (exact sampled ids,
splice, divergence): one per segment. The row's sample is the last segment and carries the
earlier ones (``Sample.earlier_segments``: a split episode trains every segment, with the
episode's reward and advantage). The harness's return value is the episode's reward
(``Sample.episode`` carries it and the calls, as an environment's episode record does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

from rlbatch.config.enums import ChatTemplate, EnvOnError, OnDivergence, ToolParser
from rlbatch.env.protocol import EnvCallError
from rlbatch.grpo.types import Prompt, Sample, group_rows
from rlbatch.rollout.agent import chat
from rlbatch.rollout.agent.decoders import AgentDecoder, build_decoder
from rlbatch.rollout.agent.endpoint import CallError, Endpoint
from rlbatch.rollout.agent.episodes import Call, DivergenceError, assemble, branches_from
from rlbatch.rollout.agent.harness import episode_reward, load_harness
from rlbatch.rollout.protocol import DecodedRow, row_seeds, segment_seed
from rlbatch.runtime import progress

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

    def retire(self, key: str, err: BaseException) -> None:
        """Stop serving episode ``key``: its waiting calls fail with ``err``, later ones 404."""
        with self.changed:
            ep = self.episodes.pop(key, None)
            self.retired.append(key)
            for job in [j for j in self.jobs if j.episode is ep]:
                job.future.set_exception(err)
                self.jobs.remove(job)

    def keys(self) -> list[str]:
        """Every episode key of the round, retired ones included."""
        return [*self.episodes, *self.retired]

    # --------------------------------------------------------------- endpoint threads
    def answer(self, key: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        ep = self.episodes.get(key)
        if ep is None:
            raise CallError(404, f"episode {key} is not running")
        n = body.get("n", 1)
        if n not in (1, None):
            ep.errors.append(f"asked for n={n} completions in one call: ask one per call")
            raise CallError(400, f"n={n}: this endpoint samples one completion per call (n=1)")
        self._warn_ignored(body)
        with ep.lock:
            index = len(ep.calls)
            prompt_ids, spliced, diverged = self._prompt(ep, kind, body)
            call = Call(index, prompt_ids, [], [], -1, "length", _seed(ep, index, body), spliced)
            call.diverged = diverged
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
            ep.waiting += 1
            self.jobs.append(job)
            self.changed.notify_all()
        row: DecodedRow
        row, version = job.future.result()
        reply = self._finish(call, row, version, limit, body)
        call.truncated = call.finish_reason == "length" and limit >= run_limit
        return reply

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
            jobs, self.jobs = self.jobs, []
            for job in jobs:
                job.episode.waiting -= 1
            return jobs

    def fail_waiting(self, err: BaseException) -> None:
        with self.changed:
            for job in self.jobs:
                job.future.set_exception(err)
            self.jobs = []


def _seed(ep: Episode, index: int, body: dict[str, Any]) -> int:
    """A call's sampling seed: from the row's seed and the call's index in its episode, or the
    client's ``seed`` when it sends one (calls sent at once arrive in any order, so their
    indices do; their seeds need not)."""
    asked = body.get("seed")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0:
        return segment_seed(ep.seed, (1 << 40) + asked)
    return segment_seed(ep.seed, index)


def _stop_cut(tokenizer: Any, ids: list[int], stops: list[str]) -> Optional[tuple[int, str]]:
    """(tokens kept, text shown) at the first stop string: the tokens up to the one that
    completes it (all sampled), the text before it."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        found = [text.find(s) for s in stops if s and s in text]
        if found:
            return n, text[: min(found)]
    return None


async def _harness_call(key: str, harness: Any, client: Any, model: str, row: Any) -> Any:
    """The harness's run, awaited in a frame :meth:`_Loop.holder` recognises (``key``: the
    episode whose harness holds the loop when its code is on the loop thread's stack)."""
    return await harness(client, model, row)


class _Loop:
    """One event loop in a daemon thread: where harnesses run. A heartbeat callback every
    ``BEAT_S`` tells how long the loop has gone without running its callbacks (:meth:`lag`):
    code that holds it without awaiting, which :meth:`holder` names."""

    BEAT_S = 0.1

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.beat = time.monotonic()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="rlbatch-harness", daemon=True
        )
        self.thread.start()
        self.loop.call_soon_threadsafe(self._beat)

    def _beat(self) -> None:
        self.beat = time.monotonic()
        self.loop.call_later(self.BEAT_S, self._beat)

    def submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def lag(self) -> float:
        """Seconds since the loop last ran its heartbeat."""
        return time.monotonic() - self.beat

    def holder(self, source: str) -> tuple[Optional[str], str]:
        """(the key of the episode whose harness runs on the loop now, or None when the code
        running is no episode's run call; ``file:line in function`` where it runs: the
        innermost frame in ``source``, the harness's file, else the innermost)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        frames, key = [], None
        while frame is not None and key is None:
            if frame.f_code is _harness_call.__code__:
                key = frame.f_locals.get("key")
            else:
                frames.append(frame)
            frame = frame.f_back
        at = next((f for f in frames if f.f_code.co_filename == source), None)
        at = at or (frames[0] if frames else None)
        if at is None:
            return key, "an unknown place"
        return key, f"{at.f_code.co_filename}:{at.f_lineno} in {at.f_code.co_name}"


@dataclasses.dataclass
class _Running:
    """An episode in flight."""

    slot: str
    """Its key when the round began: its place among the round's rows (a restart gives it a
    new key, never a new slot)."""
    episode: Episode
    future: Future
    started: float


_ENDPOINTS: dict[tuple[str, int], Endpoint] = {}


def shared_endpoint(host: str, port: int, token: Optional[str]) -> Endpoint:
    """This process's endpoint at (host, port): training's engine and evaluation's share it
    (they never generate at once), so a fixed env.agent.port is bound once."""
    key = (host, port)
    if port == 0 and _ENDPOINTS:
        return next(iter(_ENDPOINTS.values()))
    if key not in _ENDPOINTS:
        _ENDPOINTS[key] = Endpoint(host, port, token)
    return _ENDPOINTS[key]


class AgentRolloutEngine:
    """The loop's RolloutEngine for env.harness (see the module docstring)."""

    def __init__(
        self, cfg: Any, tokenizer: Any, decode: AgentDecoder, row_of: Any, rank: int
    ) -> None:
        env = cfg.env
        self.cfg, self.tokenizer = cfg, tokenizer
        self.decode = decode
        self.row_of = row_of
        """Prompt -> the row dict the harness gets."""
        self.harness_spec = env.harness
        self.harness = load_harness(env.harness)
        self.limits = Limits(
            max_new_tokens=cfg.rollout.max_new_tokens,
            max_total_tokens=env.max_total_tokens,
            max_turns=env.max_turns,
            eos_ids=tuple(tokenizer.eos_ids),
            template=ChatTemplate(cfg.data.chat_template),
            tool_parser=ToolParser(env.agent.tool_parser),
            on_divergence=OnDivergence(env.agent.on_divergence),
        )
        port = env.agent.port + rank if env.agent.port else 0
        self.endpoint = shared_endpoint(env.agent.host, port, env.agent.auth_token)
        for name in ("httpx", "httpx2"):  # the clients' per-call lines
            logging.getLogger(name).setLevel(logging.WARNING)
        self.loop = _Loop()
        self.source = getattr(getattr(self.harness, "__code__", None), "co_filename", "")
        """The harness's file: where the loop watchdog looks for the line that blocks."""
        self.restarts = 0
        self.version = -1

    def take_figures(self) -> dict[str, float]:
        """The decoder's ``rollout/*`` counters (a backend with its own weights: its syncs)."""
        return self.decode.take_figures()

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        rows = group_rows(prompts, num_generations)
        if not rows:
            return []
        self.version = policy_version
        seeds = row_seeds(seed, len(rows))
        episodes = {f"{seed:x}-{i}": Episode(i, p, s) for i, ((_, p), s) in enumerate(zip(rows, seeds, strict=True))}  # fmt: skip
        session = AgentSession(self.limits, self.tokenizer, episodes, self.cfg.env.timeout_s)
        self.endpoint.session = session
        env = self.cfg.env
        waves = -(-len(episodes) // max(1, env.max_concurrency))
        # the round waits on the harnesses, each bounded by its own deadline: the watchdog
        # (trainer.timeout_s) must let the deadline score a late episode, not stop the run
        bound = waves * (env.agent.episode_timeout_s + 5.0) + self.cfg.trainer.timeout_s
        try:
            with progress.user_call(f"{len(episodes)} harness episodes ({env.harness})", bound):
                outcomes = self._run(session, list(episodes.items()))
        finally:
            session.fail_waiting(RuntimeError("the episode's round is over"))
            self.endpoint.session = None
            self.decode.release(session.keys())
        return [
            self._sample(g, ep, outcome, policy_version)
            for (g, _), (ep, outcome) in zip(rows, outcomes, strict=True)
        ]

    def _run(
        self, session: AgentSession, episodes: list[tuple[str, Episode]]
    ) -> list[tuple[Episode, Any]]:
        """Every episode's (Episode, (value, error text, seconds)) in the round's order,
        decoding their calls meanwhile; a harness that holds the loop past
        env.agent.block_timeout_s is an error of its own episode (:meth:`_unblock`)."""
        env = self.cfg.env
        queue = list(episodes)
        running: dict[str, _Running] = {}
        outcomes: dict[str, tuple[Episode, Any]] = {}
        while queue or running:
            while queue and len(running) < env.max_concurrency:
                key, ep = queue.pop(0)
                running[key] = self._start(key, key, ep)
            self._collect(running, outcomes)
            if running and self.loop.lag() > env.agent.block_timeout_s:
                self._unblock(session, running, outcomes)
            self._decode(session, running)
        return [outcomes[key] for key, _ in episodes]

    def _start(self, key: str, slot: str, ep: Episode) -> _Running:
        ep.idle_since = time.monotonic()
        return _Running(slot, ep, self.loop.submit(self._episode(key, ep)), time.monotonic())

    def _collect(self, running: dict[str, _Running], outcomes: dict[str, Any]) -> None:
        """Move the ended and the late episodes of ``running`` to ``outcomes``. Nobody is late
        while the loop is held (the watchdog names who holds it)."""
        deadline = self.cfg.env.agent.episode_timeout_s + 5.0
        held = self.loop.lag() > 1.0
        for key, r in list(running.items()):
            seconds = time.monotonic() - r.started
            late = seconds > deadline and not held
            if r.future.done() or late:
                result = _outcome(r.future, late, seconds, deadline - 5.0)
                outcomes[r.slot] = (r.episode, result)
                del running[key]

    def _unblock(
        self, session: AgentSession, running: dict[str, _Running], outcomes: dict[str, Any]
    ) -> None:
        """The loop has not run for env.agent.block_timeout_s: the episode whose harness holds
        it is an error naming it and the line. raise_error stops the run; zero_reward scores
        it 0 and restarts the other running episodes from their start on a fresh loop (a
        call's seed is its episode's and its index, so they sample what they would have)."""
        lag = self.loop.lag()
        key, where = self.loop.holder(self.source)
        problem = (
            f"held the rank's event loop {lag:.0f} s without awaiting (at {where}), and every"
            " episode of the rank waited: await slow work (`await asyncio.to_thread(f, ...)`,"
            " an async client), or raise env.agent.block_timeout_s"
        )
        culprit = running.pop(key, None) if key is not None else None
        if culprit is None:  # a task the harness started, a callback: no episode to score
            raise EnvCallError(f"harness {self.harness_spec}: code outside a run call {problem}")
        if EnvOnError(self.cfg.env.on_error) == EnvOnError.raise_error:
            raise EnvCallError(f"{self._where(culprit.episode)} {problem}")
        log.warning("%s %s", self._where(culprit.episode), problem)
        seconds = time.monotonic() - culprit.started
        outcomes[culprit.slot] = (culprit.episode, (None, problem, seconds))
        gone = RuntimeError("the episode restarts on a fresh event loop")
        session.retire(str(key), gone)
        self.loop, self.restarts = _Loop(), self.restarts + 1
        for old, r in list(running.items()):
            fresh = Episode(r.episode.row, r.episode.prompt, r.episode.seed)
            new = f"{r.slot}-r{self.restarts}"
            session.retire(old, gone)
            session.episodes[new] = fresh
            del running[old]
            running[new] = self._start(new, r.slot, fresh)

    def _decode(self, session: AgentSession, running: dict[str, _Running]) -> None:
        """Decode the waiting calls once every live episode has one (AgentSession.take)."""
        live = [r.episode for r in running.values() if not r.future.done()]
        jobs = session.take(live, timeout=0.05)
        if not jobs:
            return
        try:
            decoded = self.decode(
                [j.prompt_ids for j in jobs],
                [j.seed for j in jobs],
                [j.max_tokens for j in jobs],
                self.version,
                [j.key for j in jobs],
            )
        except BaseException as err:
            for job in jobs:
                job.future.set_exception(err)
            raise
        for job, row in zip(jobs, decoded, strict=True):
            job.episode.idle_since = time.monotonic()
            job.future.set_result((row, self.version))

    async def _episode(self, key: str, ep: Episode) -> Any:
        import openai

        agent = self.cfg.env.agent
        client = openai.AsyncOpenAI(
            base_url=self.endpoint.base_url(key),
            api_key=agent.auth_token or "rlbatch",
            max_retries=0,
            timeout=agent.episode_timeout_s,
        )
        try:
            call = _harness_call(key, self.harness, client, "policy", self.row_of(ep.prompt))
            return await asyncio.wait_for(call, agent.episode_timeout_s)
        finally:
            await client.close()

    def _where(self, ep: Episode) -> str:
        return f"harness {self.harness_spec} on sample {ep.row} (prompt index {ep.prompt.index})"

    def _sample(self, group: int, ep: Episode, outcome: Any, version: int) -> Sample:
        value, error, seconds = outcome
        reward, problem = 0.0, None
        parts: dict[str, float] = {}
        if ep.diverged:  # env.agent.on_divergence=error stops the run, whatever env.on_error
            raise EnvCallError(f"{self._where(ep)}: {ep.errors[0]}")
        try:
            if ep.errors:
                raise EnvCallError(f"{self._where(ep)}: {ep.errors[0]}")
            if error is not None:
                raise EnvCallError(f"{self._where(ep)} {error}")
            if not any(c.completion_ids for c in ep.calls):
                raise EnvCallError(
                    f"{self._where(ep)} made no call to the endpoint: an episode must sample at"
                    " least one completion through the client it is given"
                )
            reward, parts = episode_reward(value, self._where(ep))
        except EnvCallError as err:
            if EnvOnError(self.cfg.env.on_error) == EnvOnError.raise_error:
                raise
            problem = str(err)
        segments = assemble(ep.calls)
        eos = self.tokenizer.eos_ids[0]
        record = {
            "turns": [c.record() for c in ep.calls],
            "num_turns": sum(1 for c in ep.calls if c.completion_ids),
            "rewards": [reward],
            "reward": reward,
            "end": "error" if problem else "done",
            "error": problem,
            "truncated": bool(ep.calls) and ep.calls[-1].truncated,
            "env_seconds": seconds,
            "observation_tokens": sum(len(s.ids) - sum(s.mask) for s in segments),
            "observations_cut": 0,
            "reached_env": True,
            "splits": sum(1 for s in segments[1:] if not s.branch),
            "branches": sum(1 for s in segments[1:] if s.branch),
            "segment": max(0, len(segments) - 1),
            "calls": segments[-1].calls if segments else [],
        }
        metrics = {f"reward/harness.{k}": v for k, v in parts.items()}  # the logged parts
        if not segments:  # a failed episode with nothing sampled: one masked token, no loss
            return Sample(ep.prompt, group, [eos], [0.0], False, version, loss_mask=[0], episode=record, metrics=metrics)  # fmt: skip
        *earlier, last = [self._segment_sample(ep, group, seg, version) for seg in segments]
        last.episode, last.metrics = record, metrics
        last.earlier_segments = earlier
        for k, part in enumerate(earlier):  # what logging.samples shows of an earlier segment
            part.episode = {"segment": k, "calls": segments[k].calls, "end": "split"}
        return last

    def _segment_sample(self, ep: Episode, group: int, seg: Any, version: int) -> Sample:
        """One segment as a training sample: its own prompt (the prompt its first call sent;
        logged samples show its text), its tokens, mask and behaviour logps."""
        prompt = dataclasses.replace(
            ep.prompt,
            prompt_ids=tuple(seg.prompt_ids),
            text=self.tokenizer.decode(list(seg.prompt_ids)),
        )
        return Sample(
            prompt,
            group,
            seg.ids,
            seg.logps,
            seg.truncated,
            version,
            loss_mask=seg.mask,
            token_versions=[version] * len(seg.ids),
        )


def _outcome(
    future: Future, late: bool, seconds: float, deadline: float
) -> tuple[Any, Optional[str], float]:
    """(value, error text or None, seconds) of an episode's future; ``deadline``:
    env.agent.episode_timeout_s."""
    late_text = (
        f"took longer than env.agent.episode_timeout_s={deadline:g} s (it awaited something"
        " that did not answer in time: a tool, a sandbox, a call of its own): raise"
        " env.agent.episode_timeout_s if its episodes need longer"
    )
    if late and not future.done():
        return None, late_text, seconds
    try:
        return future.result(), None, seconds
    except TimeoutError:
        return None, late_text, seconds
    except Exception as err:  # noqa: BLE001 - the user's harness: any exception
        return None, f"raised {type(err).__name__}: {err}", seconds


# ------------------------------------------------------------------------------ building
def build_agent_engine(cfg: Any, model: Any, tokenizer: Any) -> AgentRolloutEngine:
    """The agent engine of env.harness on the run's built-in engine (rollout.backend=megatron,
    KV cache on) or on its vLLM servers (vllm_server), tp = pp = cp = 1 (config rules refuse
    the rest before launch), sampling with ``cfg.rollout`` (evaluation passes its own) over
    ``cfg.data``'s rows."""
    from rlbatch import distributed
    from rlbatch.rollout.builtin import build_rollout_engine

    inner = build_rollout_engine(
        cfg,
        model,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        chunked=False,
        extra_eos_ids=tokenizer.eos_ids,
    )
    decode = build_decoder(cfg, inner, tokenizer.pad_id)
    data = cfg.data

    def row_of(prompt: Prompt) -> dict[str, Any]:
        raw = prompt.raw if prompt.raw is not None else prompt.text
        return {**prompt.fields, data.prompt_key: raw, data.answer_key: prompt.answer}

    return AgentRolloutEngine(cfg, tokenizer, decode, row_of, distributed.dp_rank())
