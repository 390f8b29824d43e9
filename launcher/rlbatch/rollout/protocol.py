"""The contract between the GRPO loop and an engine that holds its own copy of the weights.

A ``TokenBackend`` decodes token ids only (no text, no GRPO types) and is told when the policy
changed; ``SyncedRolloutEngine`` turns it into the loop's ``RolloutEngine``
(rlbatch.rollout.engines.builtin): rows of a prompt contiguous, one seed per row, ``Sample``s with the
version of the weights that produced them. A server-based backend (an engine on other GPUs,
weights broadcast over NCCL) implements the same two methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from rlbatch.grpo.types import Prompt, Sample, group_rows


@dataclass(frozen=True)
class GenerationRequest:
    """One rank's share of one round: what the generator must produce."""

    round_index: int
    prompt_indices: tuple[int, ...]
    """Dataset indices of this rank's prompts, in order (one group each)."""
    group_ids: tuple[int, ...]
    """Global stream position of each prompt: unique over the run, shared by siblings."""
    num_generations: int
    stream_start: int = 0
    """Global stream position of the round's first prompt (equal on every rank)."""

    def repeated(self) -> list[int]:
        """Prompt indices with each repeated num_generations times contiguously (a a b b)."""
        return [p for p in self.prompt_indices for _ in range(self.num_generations)]


@dataclass(frozen=True)
class PolicySnapshot:
    """The policy a round is generated with: its version and (threaded use) its weights.

    ``weights is None`` means "the live model, which is at ``version`` right now".
    """

    version: int
    weights: Any = None


GenerateFn = Callable[[GenerationRequest, PolicySnapshot], list[Sample]]
"""Produce one rank's samples for a request: num_generations per prompt, siblings contiguous,
rewards/advantages filled, each ``Sample.policy_version == snapshot.version``."""


@dataclass(frozen=True)
class TokenSampling:
    """What a backend samples with (the rollout.* settings it needs), per request: one engine
    serves training's rollouts and evaluation's own settings."""

    max_new_tokens: int
    temperature: float
    eos_id: int
    top_k: int = 0
    """0 = off; 1 = greedy (evaluation's temperature 0). Training keeps it 0 (vllm_rules)."""
    top_p: float = 1.0
    """1 = off. Training keeps it 1: the behaviour logprobs are the full vocabulary's."""
    extra_eos_ids: tuple[int, ...] = ()
    """Ids that also end a response besides eos_id (the tokenizer's ``eos_ids[1:]``)."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a response (eos_id first): the backend stops at any of them."""
        return (self.eos_id, *self.extra_eos_ids)


def token_sampling(rollout: Any, eos_ids: Sequence[int]) -> TokenSampling:
    """The TokenSampling of a rollout config (rollout.*, or evaluation's from
    rlbatch.eval.settings.eval_rollout); ``eos_ids``: the tokenizer's, primary first."""
    return TokenSampling(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        eos_id=eos_ids[0],
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        extra_eos_ids=tuple(i for i in eos_ids[1:] if i != eos_ids[0]),
    )


@dataclass
class DecodedRow:
    """One completion: response tokens (EOS kept when produced), the behaviour log-probability
    of each (log_softmax(logits / temperature) of the sampled token over the full vocabulary)
    and whether it stopped at max_new_tokens without EOS."""

    tokens: list[int]
    logps: list[float]
    truncated: bool
    routing: Any = None
    """MoE, recorded by the built-in engine: the ``[prompt + response length, num_moe_layers,
    k]`` experts of every token (rlbatch.engine.routing); None elsewhere."""
    server: Optional[str] = None
    """The rollout server that decoded it (rollout.backend=vllm_server); None elsewhere."""


class TokenBackend(Protocol):
    """An engine with its own copy of the policy's weights."""

    version: Optional[int]
    """The policy version of the weights it holds (None: none pushed yet)."""

    def sync_weights(self, version: int) -> None:
        """Take the policy's current weights, policy ``version`` (every rank of a model-parallel
        group calls it at the same point: the transfer may be collective)."""
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


def row_samples(
    rows: Sequence[tuple[int, Prompt]], decoded: Sequence[DecodedRow], version: int
) -> list[Sample]:
    """The ``Sample`` of each single-turn row (``group_rows``' (group id, prompt) pairs) from
    its decoded completion, generated by policy ``version``: every engine makes its samples
    here (multi-turn episodes: rlbatch.rollout.multiturn.episode_samples)."""
    return [
        Sample(
            prompt=p,
            group_id=g,
            response_ids=d.tokens,
            behaviour_logps=d.logps,
            truncated=d.truncated,
            policy_version=version,
            routing=d.routing,
        )
        for (g, p), d in zip(rows, decoded, strict=True)
    ]


def decode_on_group_leader(
    generate: Callable[[], list[DecodedRow]], group_size: int, leader: bool
) -> list[DecodedRow]:
    """A backend's decode in a model-parallel group of ``group_size`` ranks: only the group's
    first rank (``leader``) calls ``generate``; every rank gets its rows (or the error it
    raised), so tp / pp ranks never sample tokens of their own that could differ."""
    if group_size == 1:
        return generate()
    from rlbatch.distributed import from_first_in_model_parallel_group

    rows: list[DecodedRow] = from_first_in_model_parallel_group(generate if leader else None)
    return rows


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


class TurnDecoder(Protocol):
    """Multi-turn rollouts on a TokenBackend: the rows' episodes, a turn per request, as
    ``Sample``s of ``version`` (rlbatch.rollout.turns.TurnSamples)."""

    def __call__(
        self,
        backend: TokenBackend,
        sampling: TokenSampling,
        rows: list[tuple[int, Prompt]],
        seeds: list[int],
        version: int,
    ) -> list[Sample]: ...


class RolloutUnavailableError(RuntimeError):
    """Generation could not be done because a service it runs on (a rollout server) failed:
    raised before the step trains anything, so the last completed step is still whole (the
    loop saves it before stopping; rlbatch.train.generation_failure)."""


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
        turns: Optional[TurnDecoder] = None,
    ) -> None:
        self.backend = backend
        self.sampling = sampling
        self.figures = SyncFigures()
        self.turns = turns
        """Multi-turn rollouts (rlbatch.rollout.turns.TurnSamples; None = single turn)."""

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        rows = group_rows(prompts, num_generations)
        if not rows:
            return []
        self.ensure_version(policy_version)
        if self.turns is not None:
            seeds = row_seeds(seed, len(rows))
            return self.turns(self.backend, self.sampling, rows, seeds, policy_version)
        decoded = self.backend.decode(
            [p.prompt_ids for _, p in rows], row_seeds(seed, len(rows)), self.sampling
        )
        return row_samples(rows, decoded, policy_version)

    def with_sampling(
        self, sampling: TokenSampling, turns: Optional[TurnDecoder] = None
    ) -> SyncedRolloutEngine:
        """The same backend (and weights) sampling with other settings (evaluation's), its
        turns kept unless ``turns`` replaces them (evaluation's own environment driver), and
        its sync figures shared: a weight sync the derived engine makes is the run's."""
        derived = SyncedRolloutEngine(
            self.backend, sampling, turns=self.turns if turns is None else turns
        )
        derived.figures = self.figures
        return derived

    def ensure_version(self, version: int) -> None:
        """Sync the backend's weights unless it already holds ``version``."""
        if self.backend.version == version:
            return
        started = time.perf_counter()
        self.backend.sync_weights(version)
        self.figures.seconds += time.perf_counter() - started
        self.figures.count += 1
        self.backend.version = version

    def take_figures(self) -> dict[str, float]:
        """This rank's ``rollout/*`` counters since the last call (the loop sums them over
        ranks: rollout/weight_sync_s is their ratio)."""
        f = SyncFigures(self.figures.seconds, self.figures.count)
        self.figures.seconds, self.figures.count = 0.0, 0  # in place: derived engines share it
        own = getattr(self.backend, "figures", None)  # a backend's own counters, if any
        out: dict[str, float] = own() if callable(own) else {}
        if f.count:
            out["rollout/weight_sync_seconds"] = f.seconds
            out["rollout/weight_syncs"] = float(f.count)
        return out


SYNCED_BACKENDS = {
    "vllm": "rlbatch.rollout.engines.vllm_engine:build_vllm_engine",
    "vllm_server": "rlbatch.rollout.servers.backend:build_server_engine",
}
"""rollout.backend -> the factory (module:function) of a backend with its own copy of the
weights; the module is imported only when its backend is chosen (vLLM's import is heavy). The
module also has ``shutdown_engine()`` (:func:`shutdown_synced_engines`)."""


BACKEND_CHECKS = {"vllm_server": "rlbatch.rollout.servers.backend:check_servers"}
"""rollout.backend -> its checks before launch (module:function taking the config and the
error list), for backends that reach outside the run (servers that must answer)."""


def check_synced_backend(cfg: Any, errors: list[Any]) -> None:
    """The chosen backend's checks before launch (:data:`BACKEND_CHECKS`), if it has any:
    errors appended to ``errors``, none raised."""
    import importlib

    backend = getattr(cfg.rollout.backend, "value", cfg.rollout.backend)
    if backend not in BACKEND_CHECKS:
        return
    module, name = BACKEND_CHECKS[backend].split(":")
    getattr(importlib.import_module(module), name)(cfg, errors)


def shutdown_synced_engines() -> None:
    """Stop every engine a synced backend started in this process (each backend module's
    ``shutdown_engine()``; a module never imported started none): at the end of a job, before
    its process groups are destroyed."""
    import sys

    for target in SYNCED_BACKENDS.values():
        module = sys.modules.get(target.split(":")[0])
        if module is not None:
            module.shutdown_engine()


def release_synced_engines() -> None:
    """Between a generation round and training: every engine a synced backend started in this
    process gives its memory back when its settings ask for it (each backend module's
    ``release_memory()``; it wakes on its next sync or decode)."""
    import sys

    for target in SYNCED_BACKENDS.values():
        module = sys.modules.get(target.split(":")[0])
        if module is not None:
            module.release_memory()


def build_synced_engine(
    cfg: Any, model: Any, *, eos_ids: Sequence[int], turns: Optional[TurnDecoder] = None
) -> SyncedRolloutEngine:
    """The RolloutEngine of ``cfg.rollout.backend`` (one of :data:`SYNCED_BACKENDS`): the loop
    reaches every such backend through this call and the protocol, never by its module.
    ``eos_ids``: the ids that end a response (the tokenizer's, primary first); ``turns``:
    multi-turn rollouts through this turn decoder (env.path)."""
    import importlib

    backend = getattr(cfg.rollout.backend, "value", cfg.rollout.backend)
    module, name = SYNCED_BACKENDS[backend].split(":")
    factory = getattr(importlib.import_module(module), name)
    engine: SyncedRolloutEngine = factory(cfg, model, eos_ids=tuple(eos_ids), turns=turns)
    return engine
