"""LCM aggregation of training micro-batches (after Tunix's aggregator, with the fixes in docs/lcm_aggregation.md).

Vocabulary (docs/lcm_aggregation.md): a *training micro-batch* here is the aggregator's input
unit, a list of prompts; ``sample_repeat`` = grpo.num_generations; ``batch_repeat`` =
grpo.num_iterations; ``service_target_bs`` = lcm of the stage chunk sizes, in prompts.

Flow of one round: buffer micro-batches until the buffered prompt count >= service_target_bs
(or a forced flush) -> merge -> repeat each prompt sample_repeat times contiguously -> rollout
in chunks -> teacher logps (on-policy distillation: the per-token teacher advantages) ->
rewards -> group advantages on the merged batch -> ref logps (skipped at beta 0) -> old logps -> split back at the original micro-batch boundaries (x sample_repeat).

A row is one sample, or one agent episode split into several (env.agent.on_divergence=split):
the row's sample is the episode's last segment and carries the earlier ones
(``Sample.earlier_segments``). Rewards and advantages are computed per row (per episode,
within its group) and handed to every segment (rlbatch.grpo.types.trained_samples); the logp
passes cover every segment; the split back and the rows' counts are the rows'.
``run`` then enqueues each produced example batch_repeat times in the order a a b b.

The stages are injected callables (:class:`Stages`), so the bookkeeping is testable with
deterministic fakes and the same class drives the real Megatron engine.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from rlbatch.config.schema import (
    AdvantageEstimator,
    RolloutCorrection,
    RunConfig,
    ScaleRewards,
)
from rlbatch.grpo.advantages import compute_advantages
from rlbatch.grpo.distill import DistillSettings, apply_teacher
from rlbatch.grpo.types import Prompt, Sample, trained_samples

RolloutFn = Callable[[list[Prompt], int], list[Sample]]
"""(rows: prompts already repeated, seed) -> one Sample per row, in row order."""
RewardBatchFn = Callable[[list[Sample]], list[float]]
LogpsFn = Callable[[list[Sample]], list[list[float]]]
"""samples -> per-response-token logprobs, one list per sample."""
CollateFn = Callable[[list[Sample]], dict[str, Any]]
"""merged samples -> row-indexed arrays (leading dim = rows), sliced by rows on split."""


@dataclass(frozen=True)
class AggregationPlan:
    """Chunk sizes (in prompts) and repeats of the aggregator; see plan_aggregation."""

    rollout_micro: int
    ref_micro: int
    old_micro: int
    train_micro: int
    sample_repeat: int
    batch_repeat: int
    logps_use_infer_budget: bool = False
    proceed_num_steps: Optional[int] = None
    ref_pass: bool = True
    """The reference-logprob pass runs (grpo.beta > 0)."""
    old_pass: bool = True
    """The old-logprob pass runs (rounds of several steps under a rollout correction:
    :func:`old_pass_runs`)."""
    teacher_micro: int = 4
    teacher_pass: bool = False
    """The in-process teacher-logprob pass runs in chunks (grpo.distill.teacher set; a served
    teacher, grpo.distill.teacher_url, gets every sample at once and plans nothing here)."""

    @property
    def service_target_bs(self) -> int:
        """lcm of the rollout, train and (fixed-size) ref/old chunk sizes, in prompts.

        The train micro size is included (Tunix leaves it out, so a merged batch split
        back raggedly); the ref/old sizes count only for a pass that runs, and not when those
        passes use the infer token budget (then no fixed chunk size needs to divide the batch).
        The config validator applies this same rule.
        """
        sizes = [self.rollout_micro, self.train_micro]
        if not self.logps_use_infer_budget:
            sizes += [self.ref_micro] if self.ref_pass else []
            sizes += [self.old_micro] if self.old_pass else []
            sizes += [self.teacher_micro] if self.teacher_pass else []
        return math.lcm(*[max(1, s) for s in sizes])


class OldSource(str, Enum):
    """Where the loss's pi_old (the clip's anchor) comes from: :func:`pi_old_source`."""

    behaviour = "behaviour"
    """The rollout's own logprobs (pi_old = pi_behaviour, no weight)."""
    forward = "forward"
    """The step's training forward, detached (the policy of a round of one step)."""
    old_pass = "old_pass"
    """The old-logprob pass at the round's first step (rlbatch.grpo.proximal)."""


def off_policy(cfg: RunConfig) -> bool:
    """Some optimizer step trains samples that a policy other than its own generated: a round
    of more than one step (grpo.steps_per_generation > 1, generation_batch_size >
    global_batch_size, or grpo.num_iterations > 1: steps 2.. of the round train the samples of
    the round's first policy) or generation ahead (grpo.num_steps_async > 0)."""
    g = cfg.grpo
    return steps_per_round(cfg) > 1 or min(g.num_steps_async, g.max_staleness) > 0


def steps_per_round(cfg: RunConfig) -> int:
    """Optimizer steps that train one generation round: steps per generation (from
    grpo.steps_per_generation or grpo.generation_batch_size / grpo.global_batch_size) times
    grpo.num_iterations (the loop's schedule, rlbatch.rollout.schedule, derives the same)."""
    g = cfg.grpo
    steps = g.steps_per_generation or 1
    if g.generation_batch_size and g.global_batch_size > 0:
        steps = max(1, g.generation_batch_size // g.global_batch_size)
    return steps * g.num_iterations


def pi_old_source(cfg: RunConfig) -> OldSource:
    """Which policy the loss takes as pi_old, the one rule (docs/grpo_loss.md, "Where pi_old
    comes from"). S = :func:`steps_per_round`; pi_behaviour = the policy that sampled the
    tokens (the rollout's logprobs); w = grpo.rollout_correction applied to pi_old /
    pi_behaviour.

    | rollout_correction | S   | pi_old                        | w                 | old pass |
    | none               | any | pi_behaviour                  | 1                 | no       |
    | any other          | 1   | this step's forward, detached | pi_old / pi_behav | no       |
    | any other          | > 1 | the round's first-step policy | pi_old / pi_behav | yes      |

    With S > 1 the ratio pi / pi_old is 1 on the round's first step and moves on steps 2..S,
    where epsilon_low / epsilon_high (or the objective's own gate) act: the policy loss acts
    only off-policy. With S = 1 the proximal policy is the step's own (ratio exactly 1, plain
    policy gradient) and w alone corrects the rollout mismatch and any run-ahead staleness
    (grpo.num_steps_async, partial rollouts: per token). Under ``none`` the ratio is taken
    against the behaviour policy itself, so staleness and mismatch both enter the clip."""
    if RolloutCorrection(cfg.grpo.rollout_correction) == RolloutCorrection.none:
        return OldSource.behaviour
    return OldSource.old_pass if steps_per_round(cfg) > 1 else OldSource.forward


def old_from_forward(cfg: RunConfig) -> bool:
    """pi_old's logps are the step's training forward's, detached (:func:`pi_old_source`)."""
    return pi_old_source(cfg) == OldSource.forward


def behaviour_weighted(cfg: RunConfig) -> bool:
    """The loss sees behaviour logps apart from pi_old (the weight pi_old / pi_behaviour and
    its maximum exist): pi_old from the forward or the old pass (:func:`pi_old_source`)."""
    return pi_old_source(cfg) != OldSource.behaviour


def old_pass_runs(cfg: RunConfig) -> bool:
    """The old-logprob (proximal policy) pass runs at each round's first step: rounds of more
    than one optimizer step under a rollout correction (:func:`pi_old_source`)."""
    return pi_old_source(cfg) == OldSource.old_pass


def aggregation_plan(cfg: RunConfig) -> AggregationPlan:
    """The aggregation plan ``grpo.aggregation`` / ``rollout`` / ``grpo`` describe (unchecked:
    the validator reads its service_target_bs; :func:`plan_aggregation` checks it)."""
    agg = cfg.grpo.aggregation
    return AggregationPlan(
        rollout_micro=agg.rollout_micro_batch_size or cfg.rollout.micro_batch_size,
        ref_micro=agg.ref_logps_micro_batch_size,
        old_micro=agg.old_logps_micro_batch_size,
        teacher_micro=agg.teacher_logps_micro_batch_size,
        train_micro=agg.train_micro_batch_size,
        sample_repeat=cfg.grpo.num_generations,
        batch_repeat=cfg.grpo.num_iterations,
        logps_use_infer_budget=agg.logps_use_infer_budget,
        proceed_num_steps=agg.proceed_num_steps,
        ref_pass=cfg.grpo.beta > 0,
        old_pass=old_pass_runs(cfg),
        teacher_pass=bool(cfg.grpo.distill.teacher),  # a served teacher needs no chunks
    )


def plan_aggregation(cfg: RunConfig) -> AggregationPlan:
    """:func:`aggregation_plan`, checked: a ValueError lists every problem."""
    plan = aggregation_plan(cfg)
    errors = aggregation_errors(plan)
    if errors:
        raise ValueError("invalid LCM aggregation config:\n  " + "\n  ".join(errors))
    return plan


MAX_SERVICE_TARGET_BS = 4096
"""An lcm above this many prompts is almost certainly a configuration mistake."""


def aggregation_errors(plan: AggregationPlan) -> list[str]:
    """Every problem of `plan`, each naming the config key, the value and the fix."""
    keys = {
        "grpo.aggregation.rollout_micro_batch_size": plan.rollout_micro,
        "grpo.aggregation.ref_logps_micro_batch_size": plan.ref_micro,
        "grpo.aggregation.old_logps_micro_batch_size": plan.old_micro,
        "grpo.aggregation.teacher_logps_micro_batch_size": plan.teacher_micro,
        "grpo.aggregation.train_micro_batch_size": plan.train_micro,
        "grpo.num_generations": plan.sample_repeat,
        "grpo.num_iterations": plan.batch_repeat,
    }
    errors = [f"{k}={v} must be >= 1" for k, v in keys.items() if v < 1]
    if plan.proceed_num_steps is not None and plan.proceed_num_steps < 1:
        errors.append(
            f"grpo.aggregation.proceed_num_steps={plan.proceed_num_steps} must be >= 1 or null"
        )
    if not errors and plan.service_target_bs > MAX_SERVICE_TARGET_BS:
        errors.append(
            f"service_target_bs = lcm of the grpo.aggregation micro sizes = "
            f"{plan.service_target_bs} prompts (> {MAX_SERVICE_TARGET_BS}): choose micro sizes"
            " that divide each other (e.g. all powers of two)"
        )
    return errors


@dataclass
class Stages:
    """The computations the aggregator drives (real engine or test fakes)."""

    rollout_fn: RolloutFn
    reward_fn: RewardBatchFn
    old_logps_fn: Optional[LogpsFn] = None
    """None: no old-logp pass (the loss uses the behaviour logps)."""
    ref_logps_fn: Optional[LogpsFn] = None
    """Required when beta > 0; never called when beta == 0."""
    collate_fn: Optional[CollateFn] = None
    """Optional row-indexed arrays built once on the merged batch."""
    teacher_logps_fn: Optional[LogpsFn] = None
    """The teacher pass (on-policy distillation); None = no teacher."""


@dataclass
class TrainExample:
    """One training micro-batch after aggregation: its prompts' groups, whole and contiguous."""

    index: int
    """Consumption index of the source micro-batch (0, 1, ... over the aggregator's life)."""
    prompts: list[Prompt]
    samples: list[Sample]
    """len(prompts) * sample_repeat rows; rows [g*G, (g+1)*G) are prompt g's group."""
    fields: dict[str, Any] = field(default_factory=dict)
    """collate_fn's arrays, sliced to this example's rows."""
    iteration: int = 0
    """Which of the batch_repeat copies this is (0-based)."""


@dataclass
class RoundRecord:
    """What one aggregation round did (for tests, metrics and the benchmark)."""

    num_micro_batches: int
    num_prompts: int
    forced: bool
    rollout_chunks: list[int] = field(default_factory=list)
    """Rows (samples) per rollout call."""
    ref_chunks: list[int] = field(default_factory=list)
    old_chunks: list[int] = field(default_factory=list)
    teacher_chunks: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)


def chunk_slices(n: int, size: int) -> list[slice]:
    """[0, size), [size, 2 size), ... covering range(n); the last may be shorter."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def repeat_in_order(examples: Sequence[TrainExample], batch_repeat: int) -> list[TrainExample]:
    """Each example batch_repeat times, consecutively: a a b b (the order invariant of docs/lcm_aggregation.md)."""
    return [dataclasses.replace(ex, iteration=k) for ex in examples for k in range(batch_repeat)]


def slice_rows(value: Any, rows: slice) -> Any:
    """Rows `rows` of a list, numpy array or torch tensor (first dimension)."""
    return value[rows]


def logps_in_chunks(
    fn: LogpsFn,
    samples: list[Sample],
    plan: AggregationPlan,
    micro: int,
    chunks: Optional[list[int]] = None,
) -> list[list[float]]:
    """A logprob pass (ref, old or teacher) over ``samples`` in chunks of ``micro`` prompts (x
    sample_repeat rows), or one call on all of them when the pass plans its own micro-batches
    under the infer token budget (``logps_use_infer_budget``). Appends each call's rows to
    ``chunks``."""
    size = len(samples) if plan.logps_use_infer_budget else micro * plan.sample_repeat
    out: list[list[float]] = []
    for sl in chunk_slices(len(samples), max(size, 1)):
        part = fn(samples[sl])
        if chunks is not None:
            chunks.append(len(samples[sl]))
        for s, lp in zip(samples[sl], part, strict=True):
            if len(lp) != len(s.response_ids):
                raise RuntimeError(
                    f"logps_fn returned {len(lp)} logprobs for {len(s.response_ids)} tokens"
                )
        out.extend(list(lp) for lp in part)
    return out


class LCMAggregator:
    """Buffers training micro-batches and computes their GRPO examples in merged rounds."""

    def __init__(
        self,
        plan: AggregationPlan,
        stages: Stages,
        *,
        beta: float,
        scale_rewards: ScaleRewards,
        advantage_eps: float,
        seed: int = 0,
        estimator: AdvantageEstimator = AdvantageEstimator.grpo,
        distill: Optional[DistillSettings] = None,
    ) -> None:
        if beta > 0 and stages.ref_logps_fn is None:
            raise ValueError(f"grpo.beta={beta} > 0 needs a reference-logp pass (ref_logps_fn)")
        if (distill is None) != (stages.teacher_logps_fn is None):
            raise ValueError("distillation needs both its settings and the teacher pass")
        self.distill = distill
        self.plan = plan
        self.stages = stages
        self.beta = beta
        self.scale_rewards = ScaleRewards(scale_rewards)
        self.advantage_eps = advantage_eps
        self.estimator = AdvantageEstimator(estimator)
        self.seed = seed
        self.records: list[RoundRecord] = []
        self._buffer: list[list[Prompt]] = []
        self._num_consumed = 0
        self._next_group_id = 0
        self._num_rollout_calls = 0

    # ---------------------------------------------------------------- buffering
    @property
    def buffered_prompts(self) -> int:
        return sum(len(mb) for mb in self._buffer)

    def push(self, micro_batch: Sequence[Prompt]) -> list[TrainExample]:
        """Buffer one training micro-batch; returns the examples of a round when one ran."""
        if len(micro_batch) == 0:
            raise ValueError(
                "an empty training micro-batch reached the LCM aggregator: every micro-batch"
                " needs >= 1 prompt (grpo.aggregation.train_micro_batch_size >= 1)"
            )
        self._buffer.append(list(micro_batch))
        if self.buffered_prompts >= self.plan.service_target_bs:
            return self._aggregate(forced=False)
        return []

    def flush(self) -> list[TrainExample]:
        """Force a round on whatever is buffered (a partial buffer is never dropped)."""
        return self._aggregate(forced=True) if self._buffer else []

    def run(self, micro_batches: Iterable[Sequence[Prompt]]) -> list[TrainExample]:
        """Consume micro-batches (at most proceed_num_steps), flush, return the a a b b queue."""
        produced: list[TrainExample] = []
        consumed = 0
        for mb in micro_batches:
            produced.extend(self.push(mb))
            consumed += 1
            if self.plan.proceed_num_steps is not None and consumed >= self.plan.proceed_num_steps:
                break
        produced.extend(self.flush())
        return repeat_in_order(produced, self.plan.batch_repeat)

    # ---------------------------------------------------------------- one round
    def _aggregate(self, forced: bool) -> list[TrainExample]:
        buffer, self._buffer = self._buffer, []
        sizes = [len(mb) for mb in buffer]
        merged = [p for mb in buffer for p in mb]
        G = self.plan.sample_repeat
        record = RoundRecord(num_micro_batches=len(buffer), num_prompts=len(merged), forced=forced)
        rows = [p for p in merged for _ in range(G)]  # each prompt G times, contiguous
        samples = self._rollout(rows, record)
        self._assign_groups(samples, merged)
        trained = trained_samples(samples)  # + the earlier segments of split agent episodes
        self._teach(trained, record)
        self._score(samples, record)
        trained_samples(samples)  # each episode's advantage to all of its samples
        if self.beta > 0:
            logps = self._logps(
                self.stages.ref_logps_fn, trained, self.plan.ref_micro, record.ref_chunks
            )
            for s, lp in zip(trained, logps, strict=True):
                s.ref_logps = lp
        if self.stages.old_logps_fn is not None:
            logps = self._logps(
                self.stages.old_logps_fn, trained, self.plan.old_micro, record.old_chunks
            )
            for s, lp in zip(trained, logps, strict=True):
                s.old_logps = lp
        fields = self.stages.collate_fn(samples) if self.stages.collate_fn else {}
        self.records.append(record)
        return self._split(buffer, sizes, samples, fields)

    def _rollout(self, rows: list[Prompt], record: RoundRecord) -> list[Sample]:
        samples: list[Sample] = []
        for sl in chunk_slices(len(rows), self.plan.rollout_micro * self.plan.sample_repeat):
            chunk = rows[sl]
            seed = self.seed * 1_000_003 + self._num_rollout_calls
            self._num_rollout_calls += 1
            out = self.stages.rollout_fn(chunk, seed)
            if len(out) != len(chunk) or any(
                # an agent episode's sample carries the prompt its harness sent (same row)
                s.prompt.index != p.index
                for s, p in zip(out, chunk, strict=True)
            ):
                raise RuntimeError("rollout_fn must return one Sample per row, in row order")
            samples.extend(out)
            record.rollout_chunks.append(len(chunk))
        return samples

    def _assign_groups(self, samples: list[Sample], merged: list[Prompt]) -> None:
        G = self.plan.sample_repeat
        for g in range(len(merged)):
            for s in samples[g * G : (g + 1) * G]:
                s.group_id = self._next_group_id + g
        self._next_group_id += len(merged)

    def _teach(self, samples: list[Sample], record: RoundRecord) -> None:
        """The teacher pass, before the advantages: each sample's per-token teacher advantage
        (rlbatch.grpo.distill.apply_teacher)."""
        if self.stages.teacher_logps_fn is None:
            return
        assert self.distill is not None
        started = time.perf_counter()
        if self.plan.teacher_pass:
            logps = self._logps(
                self.stages.teacher_logps_fn,
                samples,
                self.plan.teacher_micro,
                record.teacher_chunks,
            )
        else:  # a served teacher: one call, its requests concurrent
            logps = logps_in_chunks(self.stages.teacher_logps_fn, samples, self.plan, len(samples))
            record.teacher_chunks.append(len(samples))
        apply_teacher(samples, logps, self.distill, time.perf_counter() - started)

    def _score(self, samples: list[Sample], record: RoundRecord) -> None:
        rewards = [float(r) for r in self.stages.reward_fn(samples)]
        if len(rewards) != len(samples):
            raise RuntimeError(
                f"reward_fn returned {len(rewards)} rewards for {len(samples)} samples"
            )
        advantages = compute_advantages(
            rewards,
            self.plan.sample_repeat,
            self.scale_rewards,
            self.advantage_eps,
            self.estimator,
            members=[not s.skipped for s in samples],  # env.on_error=skip: left out
        )
        for s, r, a in zip(samples, rewards, advantages, strict=True):
            s.reward, s.advantage = r, a
        record.rewards = rewards

    def _logps(
        self, fn: Optional[LogpsFn], samples: list[Sample], micro: int, chunks: list[int]
    ) -> list[list[float]]:
        assert fn is not None
        return logps_in_chunks(fn, samples, self.plan, micro, chunks)

    def _split(
        self,
        buffer: list[list[Prompt]],
        sizes: list[int],
        samples: list[Sample],
        fields: dict[str, Any],
    ) -> list[TrainExample]:
        G = self.plan.sample_repeat
        produced, offset = [], 0
        for mb, n in zip(buffer, sizes, strict=True):
            rows = slice(offset * G, (offset + n) * G)  # group boundaries: multiples of G
            produced.append(
                TrainExample(
                    index=self._num_consumed,
                    prompts=mb,
                    samples=samples[rows],
                    fields={k: slice_rows(v, rows) for k, v in fields.items()},
                )
            )
            self._num_consumed += 1
            offset += n
        return produced

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Pending buffer and counters (prompts are picklable dataclasses)."""
        return {
            "buffer": [list(mb) for mb in self._buffer],
            "num_consumed": self._num_consumed,
            "next_group_id": self._next_group_id,
            "num_rollout_calls": self._num_rollout_calls,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buffer = [list(mb) for mb in state["buffer"]]
        self._num_consumed = int(state["num_consumed"])
        self._next_group_id = int(state["next_group_id"])
        self._num_rollout_calls = int(state["num_rollout_calls"])
