"""Rollouts through agent harnesses (env.harness): the loop's RolloutEngine for them.

``generate`` runs one episode per row: the harness's ``run(client, model, row)`` on the rank's
harness loop (rlbatch.rollout.agent.loop), its client pointed at the episode's address on this
rank's endpoint (rlbatch.rollout.agent.endpoint). The endpoint's threads hand each call to the
round's :class:`~rlbatch.rollout.agent.session.AgentSession`; this thread decodes the waiting
calls (rlbatch.rollout.agent.decoders) at the current weights once every running episode has
one (or has ended, or has worked on its own longer than env.timeout_s since its last answer),
and answers them. Each call samples from ``segment_seed(row seed, call index)`` (or the
client's ``seed``): a deterministic harness gives the same episodes again (resume included).
At most env.max_concurrency episodes run at once; each is bounded by
env.agent.episode_timeout_s, and a harness that holds the loop past env.agent.block_timeout_s
is an error of its own episode (:meth:`AgentRolloutEngine._unblock`).

Each episode's calls become samples by rlbatch.rollout.agent.episodes (exact sampled ids,
splice, divergence, branches): one per segment. The row's sample is the segment where the
episode ended (the one holding its last call, :func:`~rlbatch.rollout.agent.episodes.final_segment`,
whichever order branches created the segments in) and carries the others
(``Sample.earlier_segments``: a split episode trains every segment, with the episode's reward,
advantage and truncation, its last call's). The harness's return value is the episode's reward
(``Sample.episode`` carries it and the calls, as an environment's episode record does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

from rlbatch.config.enums import ChatTemplate, EnvOnError, OnDivergence, ToolParser
from rlbatch.env.protocol import EnvCallError
from rlbatch.grpo.types import Prompt, Sample, group_rows
from rlbatch.rollout.agent.decoders import AgentDecoder, build_decoder
from rlbatch.rollout.agent.endpoint import Endpoint
from rlbatch.rollout.agent.episodes import assemble, final_segment
from rlbatch.rollout.agent.harness import build_harness, ended_truncated, episode_reward
from rlbatch.rollout.agent.loop import HarnessLoop, run_harness
from rlbatch.rollout.agent.session import AgentSession, Episode, Limits
from rlbatch.rollout.protocol import row_seeds
from rlbatch.runtime import progress

log = logging.getLogger(__name__)


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


def shared_endpoint(
    host: str, port: int, token: Optional[str], advertise: Optional[str] = None
) -> Endpoint:
    """This process's endpoint at (host, port): training's engine and evaluation's share it
    (they never generate at once), so a fixed env.agent.port is bound once. Bound to every
    interface without a token, anyone who reaches the port can call into a running episode:
    a warning says so."""
    key = (host, port)
    if port == 0 and _ENDPOINTS:
        return next(iter(_ENDPOINTS.values()))
    if key not in _ENDPOINTS:
        if host in ("0.0.0.0", "::", "") and not token:
            log.warning(
                "env.agent.host=%s without env.agent.auth_token: anything that reaches port %s"
                " of this machine can call into the running episodes; set"
                " env.agent.auth_token",
                host,
                port or "(any)",
            )
        _ENDPOINTS[key] = Endpoint(host, port, token, advertise)
    return _ENDPOINTS[key]


class AgentRolloutEngine:
    """The loop's RolloutEngine for env.harness (see the module docstring)."""

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any,
        decode: AgentDecoder,
        row_of: Any,
        rank: int,
        meet: bool = False,
    ) -> None:
        env = cfg.env
        self.cfg, self.tokenizer = cfg, tokenizer
        self.decode = decode
        self.row_of = row_of
        """Prompt -> the row dict the harness gets."""
        self.harness, self.harness_spec, self.source = build_harness(cfg)
        """The harness (env.harness, or OpenEnv's for env.agent.openenv_url), how errors name
        it, and its file: where the loop watchdog looks for the line that blocks."""
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
        self.endpoint = shared_endpoint(
            env.agent.host, port, env.agent.auth_token, env.agent.advertise_host
        )
        for name in ("httpx", "httpx2"):  # the clients' per-call lines
            logging.getLogger(name).setLevel(logging.WARNING)
        self.loop = HarnessLoop()
        self.restarts = 0
        self.version = -1
        self.meet = meet
        """Wait for the other ranks' rounds at the end of each round (:meth:`_meet_peers`)."""
        self.rounds = 0

    def take_figures(self) -> dict[str, float]:
        """The decoder's ``rollout/*`` counters (a backend with its own weights: its syncs)."""
        return self.decode.take_figures()

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        rows = group_rows(prompts, num_generations)
        self.decode.prepare(policy_version)  # every rank, every round: a sync may be collective
        if not rows:
            return []
        self.version = policy_version
        seeds = row_seeds(seed, len(rows))
        # an episode's address is a random key: calls reach an episode only from its client
        # (seeds, not keys, make the samples)
        tag = secrets.token_hex(8)
        episodes = {f"{tag}-{i}": Episode(i, p, s) for i, ((_, p), s) in enumerate(zip(rows, seeds, strict=True))}  # fmt: skip
        session = AgentSession(self.limits, self.tokenizer, episodes, self.cfg.env.timeout_s)
        self.endpoint.session = session
        env = self.cfg.env
        waves = -(-len(episodes) // max(1, env.max_concurrency))
        # the round waits on the harnesses, each bounded by its own deadline: the watchdog
        # (trainer.timeout_s) must let the deadline score a late episode, not stop the run
        bound = waves * (env.agent.episode_timeout_s + 5.0) + self.cfg.trainer.timeout_s
        started = time.monotonic()
        with progress.user_call(f"{len(episodes)} harness episodes ({self.harness_spec})", bound):
            try:
                outcomes = self._run(session, list(episodes.items()))
            finally:
                session.fail_waiting(RuntimeError("the episode's round is over"))
                self.endpoint.session = None
                self.decode.release(session.keys())
            self._meet_peers(bound - (time.monotonic() - started))
        return [
            self._sample(g, ep, outcome, policy_version)
            for (g, _), (ep, outcome) in zip(rows, outcomes, strict=True)
        ]

    def _meet_peers(self, seconds: float) -> None:
        """At dp > 1, wait (up to ``seconds``, what is left of the round's bound) until every
        rank has ended its round: the first collective after the round would give up on a peer
        still running its harnesses after trainer.timeout_s, while the peer's episodes may run to
        their deadlines (env.agent.episode_timeout_s). Training's rounds only: every rank runs
        them in lockstep (evaluation's blocks are uneven across ranks)."""
        if not self.meet:
            return
        from rlbatch import distributed

        self.rounds += 1
        distributed.meet(f"agent-round-{self.rounds}", seconds)

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
        while True:
            # the ended episodes leave first and their slots' next episodes start before any
            # decode, so a batch never depends on when an episode ended
            self._collect(session, running, outcomes)
            self._refill(queue, running)
            holder = self._holder(running, env.agent.block_timeout_s) if running else None
            if holder is not None:
                self._unblock(session, running, outcomes, *holder)
                self._refill(queue, running)  # the culprit's slot too
            if not self._decode(session, running, bool(queue or running)):
                break
        return [outcomes[key] for key, _ in episodes]

    def _refill(self, queue: list[tuple[str, Episode]], running: dict[str, _Running]) -> None:
        """Start the round's next episodes in the free slots of env.max_concurrency."""
        while queue and len(running) < self.cfg.env.max_concurrency:
            key, ep = queue.pop(0)
            running[key] = self._start(key, key, ep)

    def _start(self, key: str, slot: str, ep: Episode) -> _Running:
        ep.idle_since = time.monotonic()
        return _Running(slot, ep, self.loop.submit(self._episode(key, ep)), time.monotonic())

    def _collect(
        self, session: AgentSession, running: dict[str, _Running], outcomes: dict[str, Any]
    ) -> None:
        """Move the ended and the late episodes of ``running`` to ``outcomes``, their calls
        closed (AgentSession.end: a call after its harness returned is refused, never trained).
        Nobody is late while the loop is held (the watchdog names who holds it)."""
        deadline = self.cfg.env.agent.episode_timeout_s + 5.0
        held = self._holder(running, 1.0) is not None
        for key, r in list(running.items()):
            seconds = time.monotonic() - r.started
            late = seconds > deadline and not held
            if r.future.done() or late:
                session.end(key)
                result = _outcome(r.future, late, seconds, deadline - 5.0)
                outcomes[r.slot] = (r.episode, result)
                del running[key]

    def _holder(self, running: dict[str, _Running], seconds: float) -> Optional[tuple[str, str]]:
        """(key, where) of the running episode whose harness has held the loop for longer
        than ``seconds``, or None. A loop that lags with no episode's harness on its stack (a task
        a harness started; its thread not scheduled on a loaded machine) is nobody's fault
        here: the episodes' deadlines and the hang detector still bound it."""
        if self.loop.lag() <= seconds:
            return None
        key, where = self.loop.holder(self.source)
        return (key, where) if key in running else None

    def _unblock(
        self,
        session: AgentSession,
        running: dict[str, _Running],
        outcomes: dict[str, Any],
        key: str,
        where: str,
    ) -> None:
        """The loop has not run for env.agent.block_timeout_s: the episode whose harness holds
        it is an error naming it and the line. raise_error stops the run; zero_reward scores
        it 0 and restarts the other running episodes from their start on a fresh loop (a
        call's seed is its episode's and its index, so they sample what they would have)."""
        lag = self.loop.lag()
        problem = (
            f"held the rank's event loop {lag:.0f} s without awaiting (at {where}), and every"
            " episode of the rank waited: await slow work (`await asyncio.to_thread(f, ...)`,"
            " an async client), or raise env.agent.block_timeout_s"
        )
        culprit = running.pop(key)
        if EnvOnError(self.cfg.env.on_error) == EnvOnError.raise_error:
            raise EnvCallError(f"{self._where(culprit.episode)} {problem}")
        log.warning("%s %s", self._where(culprit.episode), problem)
        seconds = time.monotonic() - culprit.started
        outcomes[culprit.slot] = (culprit.episode, (None, problem, seconds))
        gone = RuntimeError("the episode restarts on a fresh event loop")
        session.retire(key, gone)
        self.loop, self.restarts = HarnessLoop(), self.restarts + 1
        for old, r in list(running.items()):
            fresh = Episode(r.episode.row, r.episode.prompt, r.episode.seed)
            new = f"{r.slot}-r{self.restarts}"
            session.retire(old, gone)
            session.episodes[new] = fresh
            del running[old]
            running[new] = self._start(new, r.slot, fresh)

    def _decode(self, session: AgentSession, running: dict[str, _Running], going: bool) -> bool:
        """Decode the waiting calls once every live episode has one (AgentSession.take; a call
        of an episode that ended was refused when it was collected).
        Returns whether the round goes on: this rank's episodes (``going``), or, with a decoder
        whose forwards its expert-parallel group runs together (``decode.lockstep``: an MoE
        policy at parallel.ep > 1 on the built-in engine), any peer's. Then every rank of the
        group agrees once an iteration whether any of them goes on and whether any decodes, and
        decodes together: a rank with no call of its own keeps the peers' all-to-alls fed
        (BuiltinDecoder)."""
        if any(r.future.done() for r in running.values()):
            # one ended after the collection: its slot is refilled before the next decode
            jobs = []
        else:
            jobs = session.take([r.episode for r in running.values()], timeout=0.05)
        if self.decode.lockstep:
            going, decoding = self.decode.agree([going, bool(jobs)])
            if decoding and not jobs:
                self.decode([], [], [], self.version, [])
        if not jobs:
            return going
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
        return going

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
            call = run_harness(key, self.harness, client, "policy", self.row_of(ep.prompt))
            return await asyncio.wait_for(call, agent.episode_timeout_s)
        finally:
            await client.close()

    def _where(self, ep: Episode) -> str:
        return f"harness {self.harness_spec} on sample {ep.row} (prompt index {ep.prompt.index})"

    def _unsampled(self, ep: Episode) -> str:
        """Why an episode sampled no token: it made no call, or every call it made was answered
        empty by the run's limits (its prompt left nothing of env.max_total_tokens)."""
        if not ep.calls:
            return (
                f"{self._where(ep)} made no call to the endpoint: an episode must sample at"
                " least one completion through the client it is given"
            )
        return (
            f"{self._where(ep)} sampled no token: its first call's prompt is"
            f" {len(ep.calls[0].prompt_ids)} tokens (what the harness sent: its messages, system"
            " prompt and tool schemas through the chat template), which leaves no room under"
            f" env.max_total_tokens={self.cfg.env.max_total_tokens}, and the endpoint answered"
            f" each of its {len(ep.calls)} call(s) with no tokens: raise env.max_total_tokens or"
            " send a shorter prompt"
        )

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
                raise EnvCallError(self._unsampled(ep))
            reward, parts = episode_reward(value, self._where(ep))
        except EnvCallError as err:
            if EnvOnError(self.cfg.env.on_error) == EnvOnError.raise_error:
                raise
            problem = str(err)
        segments, splits, branches = _segments(ep)
        # cut by the endpoint (its last call answered `length`), or by the harness's own
        # limits (it returned truncated=True: verifiers ending the exchange at env.max_turns)
        truncated = bool(ep.calls) and ep.calls[-1].truncated
        truncated = truncated or (problem is None and ended_truncated(value))
        eos = self.tokenizer.eos_ids[0]
        record = {
            "turns": [c.record() for c in ep.calls],
            "num_turns": sum(1 for c in ep.calls if c.completion_ids),
            "rewards": [reward],
            "reward": reward,
            "end": "error" if problem else "done",
            "error": problem,
            "truncated": truncated,
            "env_seconds": seconds,
            "observation_tokens": sum(len(s.ids) - sum(s.mask) for s in segments),
            "observations_cut": 0,
            "reached_env": True,
            "splits": splits,
            "branches": branches,
            "late_calls": ep.late_calls,
            "segment": max(0, len(segments) - 1),
            "calls": segments[-1].calls if segments else [],
        }
        metrics = {f"reward/harness.{k}": v for k, v in parts.items()}  # the logged parts
        if not segments:  # a failed episode with nothing sampled: one masked token, no loss
            # (truncated as its record: its calls the run's limits answered with no tokens)
            return Sample(ep.prompt, group, [eos], [0.0], truncated, version, loss_mask=[0], episode=record, metrics=metrics)  # fmt: skip
        samples = [self._segment_sample(ep, group, seg, version, truncated) for seg in segments]
        *earlier, last = samples
        last.episode, last.metrics = record, metrics
        last.earlier_segments = earlier
        for k, part in enumerate(earlier):  # what logging.samples shows of an earlier segment
            part.episode = {"segment": k, "calls": segments[k].calls, "end": "split"}
        return last

    def _segment_sample(
        self, ep: Episode, group: int, seg: Any, version: int, truncated: bool
    ) -> Sample:
        """One segment as a training sample: its own prompt (the prompt its first call sent;
        logged samples show its text), its tokens, mask and behaviour logps, and the episode's
        truncation (its last call's: grpo.mask_truncated_completions masks an episode whole)."""
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
            truncated,
            version,
            loss_mask=seg.mask,
            token_versions=[version] * len(seg.ids),
        )


def _segments(ep: Episode) -> tuple[list[Any], int, int]:
    """(segments, splits, branches) of an episode: the segment where it ended last (the row's
    sample), the others in the order the calls created them."""
    segments = assemble(ep.calls)
    splits = sum(1 for s in segments[1:] if not s.branch)
    branches = sum(1 for s in segments[1:] if s.branch)
    if segments:
        end = final_segment(segments, ep.calls)
        segments = [*segments[:end], *segments[end + 1 :], segments[end]]
    return segments, splits, branches


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
def build_agent_engine(
    cfg: Any, model: Any, tokenizer: Any, meet: bool = True
) -> AgentRolloutEngine:
    """The agent engine of env.harness on the run's built-in engine (rollout.backend=megatron,
    KV cache on) or on its vLLM servers (vllm_server), tp = pp = cp = 1 (config rules refuse
    the rest before launch), sampling with ``cfg.rollout`` (evaluation passes its own) over
    ``cfg.data``'s rows; ``meet``: the ranks meet after each round (training's rounds; not
    evaluation's, whose ranks run different numbers of rounds)."""
    from rlbatch import distributed
    from rlbatch.rollout.engines.builtin import build_rollout_engine

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

    meet = meet and distributed.world_size() > 1
    return AgentRolloutEngine(cfg, tokenizer, decode, row_of, distributed.dp_rank(), meet)
