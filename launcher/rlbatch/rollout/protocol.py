"""The contract between the GRPO loop and an engine that holds its own copy of the weights.

A ``TokenBackend`` decodes token ids only (no text, no GRPO types) and is told when the policy
changed; ``SyncedRolloutEngine`` turns it into the loop's ``RolloutEngine``
(rlbatch.rollout.builtin): rows of a prompt contiguous, one seed per row, ``Sample``s with the
version of the weights that produced them. A server-based backend (an engine on other GPUs,
weights broadcast over NCCL) implements the same two methods.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from rlbatch.grpo.types import Prompt, Sample, group_rows


@dataclass(frozen=True)
class TokenSampling:
    """What a backend samples with (the rollout.* settings it needs)."""

    max_new_tokens: int
    temperature: float
    eos_id: int


@dataclass
class DecodedRow:
    """One completion: response tokens (EOS kept when produced), the behaviour log-probability
    of each (log_softmax(logits / temperature) of the sampled token over the full vocabulary)
    and whether it stopped at max_new_tokens without EOS."""

    tokens: list[int]
    logps: list[float]
    truncated: bool


class TokenBackend(Protocol):
    """An engine with its own copy of the policy's weights."""

    version: Optional[int]
    """The policy version of the weights it holds (None: none pushed yet)."""

    def sync_weights(self) -> None:
        """Take the policy's current weights (every rank of a model-parallel group calls it at
        the same point: the transfer may be collective)."""
        ...

    def decode(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: TokenSampling,
        max_tokens: Optional[Sequence[int]] = None,
    ) -> list[DecodedRow]:
        """One completion per prompt, row i sampled from seeds[i] alone: the same seed gives
        the same row whatever else is in the batch. Row i samples at most max_tokens[i] tokens
        (None: sampling.max_new_tokens each); ``truncated``: it stopped at that limit without
        EOS."""
        ...


_ROW_SEED_TAG = 0x5EED_0F_20
"""Keeps row seeds apart from the other seeds rlbatch derives from trainer.seed."""


def row_seeds(seed: int, num_rows: int) -> list[int]:
    """A 31-bit seed per row of a generate call, from (seed, row index) only."""
    return [
        int(np.random.SeedSequence([_ROW_SEED_TAG, seed, i]).generate_state(1)[0] & 0x7FFFFFFF)
        for i in range(num_rows)
    ]


_SEGMENT_SEED_TAG = 0x5E6_0F_20


def segment_seed(row_seed: int, segment: int) -> int:
    """The 31-bit seed of a row's ``segment``-th decode call (an assistant turn, or a stretch of
    a partial rollout): a row continued by a new request samples fresh noise, from (row seed,
    segment index) only."""
    state = np.random.SeedSequence([_SEGMENT_SEED_TAG, row_seed, segment]).generate_state(1)
    return int(state[0] & 0x7FFFFFFF)


@dataclass
class SyncFigures:
    """Weight syncs since the last round's figures were taken."""

    seconds: float = 0.0
    count: int = 0


class SyncedRolloutEngine:
    """The loop's RolloutEngine on a TokenBackend: before generating with a policy version the
    backend has not seen, the backend takes the weights (the first call included, so a backend
    starts from the model config alone); then each row is decoded from its own seed."""

    def __init__(
        self,
        backend: TokenBackend,
        sampling: TokenSampling,
        *,
        driver: Any = None,
        max_total_tokens: int = 0,
    ) -> None:
        self.backend = backend
        self.sampling = sampling
        self.figures = SyncFigures()
        self.driver = driver
        """Multi-turn rollouts: the turn driver (rlbatch.rollout.turns.build_turn_driver; None =
        single turn) and the longest trajectory, prompt included (env.max_total_tokens)."""
        self.max_total_tokens = max_total_tokens

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        rows = group_rows(prompts, num_generations)
        if not rows:
            return []
        self.ensure_version(policy_version)
        if self.driver is not None:
            return self._generate_turns(rows, row_seeds(seed, len(rows)), policy_version)
        decoded = self.backend.decode(
            [p.prompt_ids for _, p in rows], row_seeds(seed, len(rows)), self.sampling
        )
        return [
            Sample(
                prompt=p,
                group_id=g,
                response_ids=d.tokens,
                behaviour_logps=d.logps,
                truncated=d.truncated,
                policy_version=policy_version,
            )
            for (g, p), d in zip(rows, decoded, strict=True)
        ]

    def _generate_turns(
        self, rows: list[tuple[int, Prompt]], seeds: list[int], version: int
    ) -> list[Sample]:
        """Multi-turn rollouts through the turn driver (rlbatch.rollout.turns)."""
        from rlbatch.rollout.turns import decode_turns_on

        prompt_ids = [p.prompt_ids for _, p in rows]
        budget = [self.max_total_tokens - len(p) for p in prompt_ids]
        self.driver.begin([p for _, p in rows])
        trajs = decode_turns_on(self.backend, prompt_ids, seeds, self.sampling, self.driver, budget)
        return [
            Sample(
                prompt=p,
                group_id=g,
                response_ids=t.ids,
                behaviour_logps=t.logps,
                truncated=t.truncated or ep["truncated"],
                policy_version=version,
                loss_mask=t.mask,
                episode=ep,
            )
            for (g, p), t, ep in zip(rows, trajs, self.driver.records(), strict=True)
        ]

    def ensure_version(self, version: int) -> None:
        """Sync the backend's weights unless it already holds ``version``."""
        if self.backend.version == version:
            return
        started = time.perf_counter()
        self.backend.sync_weights()
        self.figures.seconds += time.perf_counter() - started
        self.figures.count += 1
        self.backend.version = version

    def take_figures(self) -> dict[str, float]:
        """This rank's ``rollout/*`` counters since the last call (the loop sums them over
        ranks: rollout/weight_sync_s is their ratio)."""
        f, self.figures = self.figures, SyncFigures()
        if not f.count:
            return {}
        return {"rollout/weight_sync_seconds": f.seconds, "rollout/weight_syncs": float(f.count)}


SYNCED_BACKENDS = {"vllm": "rlbatch.rollout.vllm_engine:build_vllm_engine"}
"""rollout.backend -> the factory (module:function) of a backend with its own copy of the
weights; the module is imported only when its backend is chosen (vLLM's import is heavy)."""


def build_synced_engine(
    cfg: Any, model: Any, *, eos_id: int, driver: Any = None
) -> SyncedRolloutEngine:
    """The RolloutEngine of ``cfg.rollout.backend`` (one of :data:`SYNCED_BACKENDS`): the loop
    reaches every such backend through this call and the protocol, never by its module.
    ``driver``: multi-turn rollouts through this turn driver (env.path)."""
    import importlib

    backend = getattr(cfg.rollout.backend, "value", cfg.rollout.backend)
    module, name = SYNCED_BACKENDS[backend].split(":")
    factory = getattr(importlib.import_module(module), name)
    engine: SyncedRolloutEngine = factory(cfg, model, eos_id=eos_id)
    if driver is not None:
        engine.driver, engine.max_total_tokens = driver, cfg.env.max_total_tokens
    return engine
