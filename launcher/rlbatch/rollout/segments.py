"""Partial rollouts (grpo.partial_rollouts) on an engine with its own copy of the weights (vLLM).

The partial-rollout stream (rlbatch.rollout.partial) decides which rows decode, when a round ends
and which groups it delivers; this module gives it a ``Segments`` engine on a ``TokenBackend``:
every row in a slot decodes up to ``rollout.vllm.segment_tokens`` more tokens as one request
(prompt + its tokens so far, seeded by (row key, segment index)), after which the stream may end
its round and refill free slots.

Why segments rather than aborting running requests at the weight swap: a segment's length is a
number of tokens, so where a round ends, which tokens each version samples and every seed are a
pure function of the seed and the data, whatever vLLM's scheduler does inside a call (an abort
lands wherever its steps happen to be). Every segment after a swap is a new request on the new
weights with the prefix cache reset, so the prefix (tokens of older versions included) is
recomputed under the new weights and each new token and its behaviour log-prob are exactly its
own version's, the built-in engine's cache-recompute rule. Between rounds the stream's state is
plain data (tokens, log-probs, versions, segment counts): a checkpoint continues exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from rlbatch.rollout.partial import Segments
from rlbatch.rollout.protocol import SYNCED_BACKENDS, SyncedRolloutEngine, build_synced_engine


class SegmentEngine:
    """The stream's ``Segments`` on a synced backend, and its weight sync."""

    def __init__(self, engine: SyncedRolloutEngine, length: int) -> None:
        self.engine = engine
        self.segments = Segments(engine.backend, engine.sampling, length)

    def ensure_version(self, version: int) -> None:
        """Sync the backend's weights unless it already holds ``version``."""
        self.engine.ensure_version(version)


def segment_engine(cfg: Any, model: Any, eos_ids: Sequence[int]) -> Optional[SegmentEngine]:
    """The segment engine of ``rollout.backend`` when it holds its own weights; None for the
    built-in engine (the stream decodes on the policy's per-slot decoder)."""
    backend = getattr(cfg.rollout.backend, "value", cfg.rollout.backend)
    if backend not in SYNCED_BACKENDS:
        return None
    return SegmentEngine(
        build_synced_engine(cfg, model, eos_ids=eos_ids), cfg.rollout.vllm.segment_tokens
    )
