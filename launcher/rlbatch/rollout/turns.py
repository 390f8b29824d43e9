"""Multi-turn rollouts on a ``TokenBackend`` (vLLM): one decode call per assistant turn.

The environment side is the same turn driver the built-in engine calls (rlbatch.env.driver
through the ``TurnDriver`` protocol of rlbatch.rollout.multiturn): ``submit`` when a turn ends with
EOS, ``collect`` for the observations, ``end`` when a limit cuts the episode. What differs is
the decoding: the backend keeps no per-row cache between calls, so every turn is a new request
whose prompt is the row's exact ids so far (prompt, every sampled token with its EOS, every
observation's ids as the driver returned them: nothing is re-tokenized); vLLM's prefix cache
reuses the KV blocks of the earlier turns (the cache is reset at every weight sync, so a hit is
always the current weights' own).

All rows still in an episode decode a turn together, then the environment answers them all:
turns are a pure function of (seed, data), never of how long an environment took. Turn k of a
row samples from ``segment_seed(row seed, k)``. The episode rules are the built-in engine's,
the same functions (rlbatch.rollout.multiturn: ``turn_end``, ``close_turn``,
``take_observation``): ``max_new_tokens`` per assistant turn and ``max_response[row]`` tokens
per trajectory; a turn cut by either, or an observation that leaves no room for another
assistant token, ends the episode as truncated. A turn the backend ended short of every limit
without EOS is an error, never a truncated row.

In a model-parallel group (tp x pp ranks) every turn is decoded once, on the group's first
rank, and its rows broadcast (rlbatch.rollout.engines.vllm_engine); the environment is stepped once, on
that rank too, and its answers and episode records are broadcast (:class:`SharedTurns`), so no
rank can see another turn than its peers, whatever the engine or the environment does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Optional

from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.multiturn import (
    Trajectory,
    TurnDriver,
    close_turn,
    episode_samples,
    take_observation,
    turn_end,
)
from rlbatch.rollout.protocol import TokenBackend, TokenSampling, segment_seed


def decode_turns_on(
    backend: TokenBackend,
    prompt_ids: Sequence[Sequence[int]],
    seeds: Sequence[int],
    sampling: TokenSampling,
    driver: TurnDriver,
    max_response: Sequence[int],
) -> list[Trajectory]:
    """Every row's trajectory (see the module docstring); the driver's episodes have begun.
    On rollout servers (a backend that pins episodes: ``release``) every turn of a row's
    episode goes to the server of its first turn, whose prefix cache holds the conversation;
    each turn's server is in ``servers`` (one per decoded turn)."""
    trajs = [Trajectory() for _ in prompt_ids]
    pinned = hasattr(backend, "release")
    keys = [f"turns-{next(_EPISODES)}" for _ in prompt_ids] if pinned else []
    try:
        return _decode_turns(backend, prompt_ids, seeds, sampling, driver, max_response, trajs, keys)  # fmt: skip
    finally:
        if keys:
            backend.release(keys)  # type: ignore[attr-defined]


_EPISODES = itertools.count()
"""The keys the servers pin an env.path episode's turns by (unique in this process)."""


def _decode_turns(
    backend: TokenBackend,
    prompt_ids: Sequence[Sequence[int]],
    seeds: Sequence[int],
    sampling: TokenSampling,
    driver: TurnDriver,
    max_response: Sequence[int],
    trajs: list[Trajectory],
    keys: list[str],
) -> list[Trajectory]:
    live = list(range(len(prompt_ids)))
    turn = 0
    while live:
        limits = [min(sampling.max_new_tokens, max_response[r] - len(trajs[r].ids)) for r in live]
        pinned = {"episodes": [keys[r] for r in live]} if keys else {}
        decoded = backend.decode(
            [[*prompt_ids[r], *trajs[r].ids] for r in live],
            [segment_seed(seeds[r], turn) for r in live],
            sampling,
            limits,
            **pinned,
        )
        waiting = []
        for r, d in zip(live, decoded, strict=True):
            traj = trajs[r]
            traj.servers.append(d.server)
            for token, logp in zip(d.tokens, d.logps, strict=True):
                traj.add_sampled(token, logp)
            eos = bool(d.tokens) and d.tokens[-1] in sampling.eos_ids
            why = turn_end(traj, eos, sampling.max_new_tokens, max_response[r])
            if why == "":
                raise RuntimeError(
                    f"the rollout backend ended a turn after {len(d.tokens)} tokens, short of"
                    " every limit and without EOS: the row would train a turn the policy never"
                    " ended"
                )
            if close_turn(driver, r, traj, why):
                waiting.append(r)
        answers = driver.collect() if waiting else {}
        live = [
            r for r in waiting if take_observation(driver, r, trajs[r], answers[r], max_response[r])
        ]
        turn += 1
    return trajs


class SharedTurns:
    """The turn driver of every rank of one model-parallel group: the group's first rank (the
    one given ``driver``) steps the environment; ``collect`` and ``records`` hand its answers to
    every rank through ``share`` (a broadcast from that rank), and an environment error raised
    there is raised on every rank."""

    def __init__(self, driver: Optional[Any], share: Callable[[Any], Any]) -> None:
        self.driver = driver
        self.share = share

    def _shared(self, call: Callable[[], Any]) -> Any:
        outcome: Any = None
        if self.driver is not None:
            try:
                outcome = ("ok", call())
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                outcome = ("error", err)
        kind, value = self.share(outcome)
        if kind == "error":
            raise value
        return value

    def begin(self, prompts: Sequence[Any]) -> None:
        self._shared(lambda: self.driver.begin(prompts))  # type: ignore[union-attr]

    def submit(self, row: int, turn_ids: list[int]) -> None:
        if self.driver is not None:
            self.driver.submit(row, turn_ids)

    def end(self, row: int, reason: str, turn_ids: list[int]) -> None:
        if self.driver is not None:
            self.driver.end(row, reason, turn_ids)

    def collect(self) -> dict[int, Optional[list[int]]]:
        answers: dict[int, Optional[list[int]]] = self._shared(lambda: self.driver.collect())  # type: ignore[union-attr]
        return answers

    def records(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self._shared(lambda: self.driver.records())  # type: ignore[union-attr]
        return records

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()


class TurnSamples:
    """The multi-turn rollouts of a SyncedRolloutEngine (its ``turns``): each row's episode
    through ``driver`` (build_turn_driver's), a turn per request, within ``max_total_tokens`` (env.max_total_tokens,
    prompt included); model tokens train, observation tokens do not."""

    def __init__(self, driver: Any, max_total_tokens: int) -> None:
        self.driver = driver
        self.max_total_tokens = max_total_tokens

    def __call__(
        self,
        backend: TokenBackend,
        sampling: TokenSampling,
        rows: list[tuple[int, Prompt]],
        seeds: list[int],
        version: int,
    ) -> list[Sample]:
        prompt_ids = [p.prompt_ids for _, p in rows]
        budget = [self.max_total_tokens - len(p) for p in prompt_ids]
        self.driver.begin([p for _, p in rows])
        trajs = decode_turns_on(backend, prompt_ids, seeds, sampling, self.driver, budget)
        records = self.driver.records()
        for traj, record in zip(trajs, records, strict=True):
            if any(traj.servers):  # each assistant turn's server, as an agent call names its own
                said = [t for t in record.get("turns", []) if t.get("role") == "assistant"]
                for t, server in zip(said, traj.servers, strict=False):
                    t["server"] = server
        return episode_samples(rows, trajs, records, version)


def build_turn_driver(cfg: Any, tokenizer: Any) -> Any:
    """This rank's turn driver for env.path: the environment's EnvDriver, shared over the
    model-parallel group (:class:`SharedTurns`, the environment built on its first rank only)
    when the group has more than one rank."""
    from rlbatch import distributed
    from rlbatch.env.driver import EnvDriver
    from rlbatch.env.loader import build_environment

    rank, size, _ = distributed.model_parallel_group()
    if size == 1:
        return EnvDriver(build_environment(cfg.env.path, cfg.env.kwargs), cfg, tokenizer)
    driver = None
    if rank == 0:
        driver = EnvDriver(build_environment(cfg.env.path, cfg.env.kwargs), cfg, tokenizer)
    return SharedTurns(driver, distributed.broadcast_object_in_model_parallel_group)
