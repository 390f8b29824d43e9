"""The generation side of a GRPO run: the rollout engine of a run and the producer's
generate_fn, which pushes a round's prompts through the LCM aggregator (its reward and
reference stages come from :mod:`rlbatch.grpo.stages`) with that engine as the rollout stage.

Built in the trainer's processes (``rlbatch.train.build``) and, for async overlap, in each
generation worker process (``rlbatch.rollout.generation_worker``), so neither imports the other.
:func:`make_generate_fn` is pure orchestration and unit-tested with fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbatch.config.env import harness_spec
from rlbatch.config.schema import RunConfig
from rlbatch.grpo.lcm import LCMAggregator
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.engines.builtin import RolloutEngine, as_rollout_fn
from rlbatch.rollout.protocol import GenerateFn, GenerationRequest, PolicySnapshot


def rank_seed(seed: int, *parts: int) -> int:
    """A 31-bit seed derived from (seed, parts) without collisions of seed * k + part."""
    return int(np.random.SeedSequence([seed, *parts]).generate_state(1)[0] & 0x7FFFFFFF)


def make_generate_fn(
    prompts: Sequence[Prompt],
    aggregator: LCMAggregator,
    engine: RolloutEngine,
    *,
    train_micro_batch_size: int,
    perturb_logps: float = 0.0,
    seed: int = 0,
) -> GenerateFn:
    """generate_fn(request, snapshot): this rank's prompts of a round through the aggregator.

    The request's prompts are pushed as training micro-batches of ``train_micro_batch_size``
    prompts, then flushed (a round never leaves a partial buffer behind); the examples come back
    in push order, so sample ``g*G + j`` is completion j of the request's prompt g. Group ids
    are set to the sampler's (unique over the run and across ranks). With
    ``grpo.aggregation.proceed_num_steps`` = k, every k micro-batches end with a flush (an
    aggregation round never spans more). ``batch_repeat`` is not applied here: the producer
    repeats each mini-batch in the same a a b b order (docs/training_loop.md).
    ``perturb_logps`` (debug.perturb_behaviour_logps) adds seeded noise to the behaviour logps.
    """

    def generate(request: GenerationRequest, snapshot: PolicySnapshot) -> list[Sample]:
        aggregator.stages.rollout_fn = as_rollout_fn(engine, snapshot.version)
        batch = [prompts[i] for i in request.prompt_indices]
        micro = [
            batch[i : i + train_micro_batch_size]
            for i in range(0, len(batch), train_micro_batch_size)
        ]
        bound = aggregator.plan.proceed_num_steps or max(len(micro), 1)
        examples = []
        for start in range(0, len(micro), bound):
            for mb in micro[start : start + bound]:
                examples.extend(aggregator.push(mb))
            examples.extend(aggregator.flush())
        samples = [s for ex in examples for s in ex.samples]
        group = request.num_generations
        for g, gid in enumerate(request.group_ids):
            for s in samples[g * group : (g + 1) * group]:
                if s.prompt.index != request.prompt_indices[g]:
                    raise RuntimeError("aggregator returned samples out of request order")
                s.group_id = gid
        if perturb_logps > 0:
            perturb_behaviour_logps(samples, perturb_logps, seed, group)
        return samples

    return generate


_PERTURB_TAG = 0x5EED_0B5E


def perturb_behaviour_logps(samples: Sequence[Sample], std: float, seed: int, group: int) -> None:
    """debug.perturb_behaviour_logps: add N(0, std^2) noise to each sampled token's behaviour
    logprob, seeded by (seed, group id, sibling index): the same noise on any layout and after
    a resume. The rollout-mismatch correction and its diagnostics then act visibly on CPU, where
    the rollout engine and the trainer agree to ~1e-6."""
    for i, row in enumerate(samples):
        # a split agent episode's earlier segments: their own streams, after the row's
        for k, s in enumerate([row, *row.earlier_segments]):
            key = [_PERTURB_TAG, seed, row.group_id, i % group] + ([k] if k else [])
            rng = np.random.default_rng(key)
            noise = rng.normal(0.0, std, size=len(s.behaviour_logps))
            assert s.loss_mask is not None
            s.behaviour_logps = [
                lp + float(z) if m else lp
                for lp, z, m in zip(s.behaviour_logps, noise, s.loss_mask, strict=True)
            ]


class SequenceParallelOffEngine:
    """A RolloutEngine that generates with sequence parallelism switched off on the policy
    (rlbatch.engine.model.sequence_parallel_off): decoding feeds one token per step, which
    cannot be split over the tensor-parallel ranks. Training keeps it on."""

    def __init__(self, engine: RolloutEngine, model: list[Any]) -> None:
        self.engine = engine
        self.model = model

    def generate(
        self, prompts: Sequence[Prompt], num_generations: int, policy_version: int, seed: int
    ) -> list[Sample]:
        from rlbatch.engine.model import sequence_parallel_off

        with sequence_parallel_off(self.model):
            return self.engine.generate(prompts, num_generations, policy_version, seed)


def weights_snapshot(model: list[Any]) -> list[dict[str, Any]]:
    """A clone of the weights of every model chunk (the hand-over to the generation worker,
    taken by the training thread between two optimizer steps)."""
    import torch

    from rlbatch.engine.adapter import unwrap

    return [
        {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in sd.items()}
        for sd in (unwrap(c).state_dict() for c in model)
    ]


def build_engine(
    cfg: RunConfig, model: list[Any], tokenizer: Any, *, chunked: bool = False
) -> RolloutEngine:
    """The rollout engine of a run (a training run's LCM aggregator chunks, so by default no
    chunk size; evaluation chunks by rollout.micro_batch_size), multi-turn through the
    environment env.path names when it is set, or through the agent harness env.harness names."""
    from rlbatch.rollout.engines.builtin import build_rollout_engine

    if harness_spec(cfg.env):
        from rlbatch.rollout.agent.engine import build_agent_engine

        return build_agent_engine(cfg, model, tokenizer)
    driver = None
    if cfg.env.path:
        from rlbatch.rollout.turns import build_turn_driver

        driver = build_turn_driver(cfg, tokenizer)
    return build_rollout_engine(
        cfg,
        model,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        chunked=chunked,
        driver=driver,
        extra_eos_ids=tokenizer.eos_ids,
    )
