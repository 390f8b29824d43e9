"""What the agent engine decodes its calls on (rlbatch.rollout.agent.engine): the built-in
engine's continuous batch at its live weights (:class:`BuiltinDecoder`), or a backend with its
own copy of the weights, synced to the call's policy version first (:class:`SyncedDecoder`,
rollout.backend=vllm_server). Either way each call is sampled from its own seed alone, so its
tokens do not depend on which calls share its batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rlbatch.rollout.expert_step import Ticking, drain
from rlbatch.rollout.protocol import DecodedRow


class AgentDecoder(Protocol):
    """What the agent engine decodes its calls on: the built-in engine
    (:class:`BuiltinDecoder`) or a backend with its own weights (:class:`SyncedDecoder`)."""

    lockstep: bool
    """The ranks of an expert-parallel group decode together: the agent engine agrees with
    them once an iteration (:meth:`agree`) and calls with no row when only peers decode."""

    def agree(self, flags: Sequence[bool]) -> list[bool]:
        """Per flag, whether it holds on some rank of the group (``lockstep`` only)."""
        ...

    def prepare(self, version: int) -> None:
        """At the start of every round, on every rank, before any episode runs: make ready
        to decode at policy ``version`` (a backend with its own weights syncs them here)."""
        ...

    def __call__(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_tokens: Sequence[int],
        version: int,
        episodes: Sequence[str],
    ) -> list[DecodedRow]:
        """One row per call, sampled from its seed alone at policy ``version``, at most
        max_tokens[i] tokens; ``episodes``: each call's episode (a server backend keeps an
        episode's calls on one server)."""
        ...

    def release(self, episodes: Sequence[str]) -> None:
        """The round's ``episodes`` ended."""
        ...

    def take_figures(self) -> dict[str, float]:
        """The backend's ``rollout/*`` counters since the last call (weight syncs, servers)."""
        ...


class BuiltinDecoder:
    """Calls decoded on the built-in engine's continuous batch (its live weights are the
    policy's current version): each call sampled from its own key, so its tokens are those of
    the same call decoded alone; a call asking fewer tokens than the longest keeps its first
    ``max_tokens``.

    An MoE policy at parallel.ep > 1 (``lockstep``): every forward exchanges tokens with the
    rank's expert-parallel group, whose harnesses make their calls on their own schedules. The
    agent engine then agrees with the group once an iteration whether any rank decodes
    (:meth:`agree`), and they all decode together: before each forward of its own a rank says
    so to the group (one all-reduce), and a rank with no forward at that tick (no call this
    time, or its calls ended first) runs the decoder's idle forward (each MoE layer on one
    zero token) until no rank of the group has one. The samples do not change."""

    def __init__(self, engine: Any, rollout: Any, pad_id: int) -> None:
        from rlbatch import distributed
        from rlbatch.engine import generation

        self.engine, self.rollout, self.pad_id = engine, rollout, pad_id
        self.lockstep = generation.is_moe(engine.chunks[0]) and distributed.expert_group()[0] > 1

    def agree(self, flags: Sequence[bool]) -> list[bool]:
        """Per flag, whether it holds on some rank of the expert-parallel group."""
        from rlbatch import distributed

        return distributed.any_in_expert_group_each(flags)

    def prepare(self, version: int) -> None:
        return None  # the live weights are the policy's

    def __call__(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_tokens: Sequence[int],
        version: int,
        episodes: Sequence[str],
    ) -> list[DecodedRow]:
        import torch

        from rlbatch.engine import generation
        from rlbatch.rollout.engines.builtin import decode_continuous
        from rlbatch.rollout.sampling import SamplingParams, row_keys

        engine, rollout = self.engine, self.rollout
        if not prompt_ids:  # lockstep: only peers have calls
            with generation.inference_mode(engine.chunks), torch.inference_mode():
                drain(generation.LeanDecoder(engine.chunks[0], 1, 1))
            return []
        eos = engine.params.eos_ids
        params = SamplingParams(
            max(max_tokens),
            eos[0],
            rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            pad_id=self.pad_id,
            extra_eos_ids=tuple(eos[1:]),
        )
        keys = torch.cat([row_keys(s, 1) for s in seeds])
        longest = max(len(p) for p in prompt_ids) + params.max_new_tokens
        with generation.inference_mode(engine.chunks), torch.inference_mode():
            decoder = generation.LeanDecoder(engine.chunks[0], len(prompt_ids), longest)
            if decoder.expert_parallel != self.lockstep:  # internal invariant
                raise AssertionError("an expert-parallel decoder outside the lockstep")
            stepped = Ticking(decoder) if self.lockstep else decoder
            out = decode_continuous(stepped, prompt_ids, params, keys, len(prompt_ids), [])
            if self.lockstep:
                drain(decoder)
        rows = []
        for ids, logps, limit in zip(out.response_ids, out.logps, max_tokens, strict=True):
            ids, logps = ids[:limit], logps[:limit]
            ended = bool(ids) and ids[-1] in eos
            rows.append(DecodedRow(ids, logps, not ended and len(ids) >= limit))
        return rows

    def release(self, episodes: Sequence[str]) -> None:
        return None

    def take_figures(self) -> dict[str, float]:
        return {}


class SyncedDecoder:
    """Calls decoded on a backend with its own copy of the weights (rollout.backend=
    vllm_server): the weights synced to the call's policy version first (a no-op when the
    backend holds it), each call sampled from its own seed, an episode's calls kept on one
    server (its prefix cache holds the conversation), a new episode on the server with the
    fewest (rlbatch.rollout.servers.backend)."""

    lockstep = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        """The run's SyncedRolloutEngine (its backend, sampling and sync figures)."""

    def agree(self, flags: Sequence[bool]) -> list[bool]:
        return list(flags)

    def prepare(self, version: int) -> None:
        """The sync to ``version``, at the round's start on every rank: with an MoE policy at
        parallel.ep > 1 it is collective over the expert-parallel group (the first replica's
        stream gathers every rank's experts, the probe's forward exchanges tokens over the
        group), which a rank's first call would reach at a time of its harness's choosing, or
        never when its episodes make none."""
        self.engine.ensure_version(version)

    def __call__(
        self,
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_tokens: Sequence[int],
        version: int,
        episodes: Sequence[str],
    ) -> list[DecodedRow]:
        self.engine.ensure_version(version)
        rows: list[DecodedRow] = self.engine.backend.decode(
            prompt_ids, seeds, self.engine.sampling, max_tokens, episodes
        )
        return rows

    def release(self, episodes: Sequence[str]) -> None:
        self.engine.backend.release(episodes)

    def take_figures(self) -> dict[str, float]:
        figures: dict[str, float] = self.engine.take_figures()
        return figures


def build_decoder(cfg: Any, inner: Any, pad_id: int) -> AgentDecoder:
    """The decoder over the run's rollout engine ``inner``: the built-in engine
    (rollout.backend=megatron) or a SyncedRolloutEngine (vllm_server)."""
    from rlbatch.config.enums import RolloutBackend

    if RolloutBackend(cfg.rollout.backend) == RolloutBackend.megatron:
        return BuiltinDecoder(inner, cfg.rollout, pad_id)
    return SyncedDecoder(inner)
