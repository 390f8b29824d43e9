"""What runs at the first optimizer step of a generation round, on the training side.

A round's samples may have been generated ahead of time (``grpo.num_steps_async``) and are
trained ``steps_per_generation * num_iterations`` times. Two things need the whole round and
the policy at the round's first step, so they run there (docs/training_loop.md):

- ``scale_rewards=batch``: the std of the rewards of the whole generation batch, over every DP
  rank (one gather of the rewards), divides the group-centred rewards;
- REINFORCE++ (``grpo.advantage_estimator=reinforce_pp[_baseline]``): the aggregator's values
  normalized by their mean and std over the loss tokens of the whole generation batch, over every
  DP rank (one gather of (value, tokens) pairs): the same advantages at any DP size;
- the old-logprob pass (proximal policy pi_old, when :func:`rlbatch.grpo.lcm.old_pass_runs`:
  a round of more than one optimizer step under a rollout correction, synchronous or not):
  this rank's round samples through the policy as it is at the round's first step, in the
  aggregation plan's chunks (or under the infer token budget). The loss clips against pi_old,
  so steps 2.. of the round, which train samples of the round's first policy, see their ratio
  move, and weights each token by pi_old / pi_behaviour, truncated (docs/grpo_loss.md). A round
  trained in one step needs no pass: its training forward is pi_old
  (:func:`rlbatch.grpo.lcm.old_from_forward`). The rule: :func:`rlbatch.grpo.lcm.pi_old_source`.

Both act in place on the round's ``Sample`` objects, which the producer keeps (and checkpoints)
for the rest of the round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from rlbatch.grpo.advantages import normalize_over_tokens, unbiased_std
from rlbatch.grpo.lcm import AggregationPlan, LogpsFn, logps_in_chunks
from rlbatch.grpo.types import Sample

GatherFn = Callable[[Any], list[Any]]
"""One object per DP rank, in DP-rank order (rlbatch.distributed.dp_gather_object)."""


def scale_by_batch_std(samples: Sequence[Sample], eps: float, gather: GatherFn) -> float:
    """Divide each sample's group-centred advantage by (std + eps), std = the unbiased std of
    the rewards of the whole generation batch (every DP rank's round samples; an episode left
    out, env.on_error=skip, neither counts nor moves from its advantage 0). Returns std."""
    shares = gather([s.reward for s in samples if not s.skipped])
    rewards = [r for share in shares for r in share]
    std = unbiased_std(rewards)
    for s in samples:
        s.advantage = s.advantage / (std + eps)
    return std


def normalize_over_batch(samples: Sequence[Sample], eps: float, gather: GatherFn) -> float:
    """REINFORCE++'s global normalization: each sample's advantage (the estimator's value)
    becomes (value - mean) / (std + eps), mean and std over the loss tokens of every DP rank's
    round samples (a split agent episode weighs with all of its segments' tokens; an episode
    left out, env.on_error=skip, has none, and keeps its advantage 0). Returns the std."""
    shares = gather([(s.advantage, _episode_loss_tokens(s)) for s in samples if not s.skipped])
    pairs = [p for share in shares for p in share]
    mean, std = normalize_over_tokens([v for v, _ in pairs], [n for _, n in pairs], eps)
    for s in samples:
        s.advantage = 0.0 if s.skipped else (s.advantage - mean) / (std + eps)
    return std


def _episode_loss_tokens(sample: Sample) -> int:
    """Loss tokens of a row's episode: a split agent episode's advantage reaches every one of
    its segments' tokens."""
    return sum(p.num_loss_tokens for p in (sample, *sample.earlier_segments))


def compute_old_logps(
    samples: list[Sample],
    logps_fn: LogpsFn,
    plan: AggregationPlan,
    chunks: Optional[list[int]] = None,
) -> None:
    """Set ``Sample.old_logps`` of every sample from ``logps_fn`` (the policy now), chunked
    like the aggregator's logprob passes (``grpo.aggregation.old_logps_micro_batch_size``)."""
    logps = logps_in_chunks(logps_fn, samples, plan, plan.old_micro, chunks)
    for s, lp in zip(samples, logps, strict=True):
        s.old_logps = lp
