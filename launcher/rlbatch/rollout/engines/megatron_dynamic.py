"""``rollout.backend=megatron_dynamic``: megatron-core's ``DynamicInferenceEngine`` on the
policy's own chunks (rlbatch.engine.dynamic_inference, which decodes token ids) as the loop's
``RolloutEngine``: the samples are made here, so the engine package never sees the GRPO types.
CUDA only, pp = 1; no weight sync (the engine runs on the policy's own weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlbatch.config.schema import RunConfig
from rlbatch.grpo.types import Prompt, Sample, group_rows
from rlbatch.rollout.protocol import DecodedRow, row_samples
from rlbatch.rollout.sampling import SamplingParams


def build_megatron_dynamic(
    cfg: RunConfig, model: Any, *, eos_id: int, pad_id: int, extra_eos_ids: Sequence[int] = ()
) -> Any:
    """The megatron_dynamic RolloutEngine on this rank's policy chunks."""
    from rlbatch.engine.dynamic_inference import DynamicRolloutEngine

    params = SamplingParams.from_config(
        cfg.rollout, eos_id=eos_id, pad_id=pad_id, extra_eos_ids=extra_eos_ids
    )
    return TokenRolloutEngine(DynamicRolloutEngine(model, params))


class TokenRolloutEngine:
    """A RolloutEngine over an engine that decodes token ids only (``decode(prompt_ids, seed)
    -> [(tokens, behaviour logprobs, truncated)]``, e.g. megatron_dynamic's): the samples are
    made here, so the engine package never imports the GRPO types."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        rows = group_rows(prompts, num_generations)
        decoded = self.decoder.decode([p.prompt_ids for _, p in rows], seed)
        return row_samples(
            rows,
            [DecodedRow(tokens, logps, truncated) for tokens, logps, truncated in decoded],
            policy_version,
        )
