"""The LCM aggregator of a GRPO run and the stages it runs after the rollout: rewards of the
samples (with a multi-turn episode's environment rewards), and the reference / old-logprob
passes. The rollout stage is set per round by ``rlbatch.rollout.generation.make_generate_fn``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

from rlbatch.config.distill import distill_on
from rlbatch.config.enums import EnvOnError
from rlbatch.config.schema import RoutingReplay, RunConfig, ScaleRewards
from rlbatch.grpo.lcm import LCMAggregator
from rlbatch.grpo.rewards import (
    RewardComponent,
    RewardFn,
    RewardSet,
    reward_input,
)
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rewards.base import Scored
from rlbatch.rollout.generation import rank_seed

SERVED_FAILED = "reward_served_failed"
"""Sample metric: 1 when a served reward part (http, judge) failed for the sample."""


def make_reward_batch_fn(
    fn: RewardFn | RewardSet,
    tokenizer: Any,
    abs_max: float = math.inf,
    skip_errors: bool = False,
    once_per_replica: bool = False,
) -> Callable[[list[Sample]], list[float]]:
    """The aggregator's reward_fn: decode responses (EOS excluded) and score them; each
    component's value goes to the sample's metrics as ``reward/<name>``. A multi-turn sample
    adds the sum of its environment's step rewards (``reward/env``); an episode ended by an
    environment error (env.on_error=zero_reward) gets a total of 0, and every part 0; an
    environment reward out of ``abs_max`` (data.reward_abs_max) counts as 0 (out_of_range);
    with ``skip_errors`` (env.on_error=skip) such an episode is also left out of training
    (:func:`skip_episode`).
    A sample with a failure of a served part (http, judge) gets ``SERVED_FAILED`` = 1 in its
    metrics (what data.served.max_error_fraction counts).

    ``once_per_replica``: the ranks of one model replica (its tensor- and pipeline-parallel
    ranks, which hold the same samples) call this together; the first of them calls the reward
    functions and the others get its scores. A reward that is not a pure function of the
    completion (a sampled reward, a served judge) then gives every stage of the replica the
    same rewards, advantages and dynamic-sampling decisions, and a served judge is asked once."""
    rewards = fn if isinstance(fn, RewardSet) else RewardSet((single_component(fn),))
    served = {c.name for c in rewards.components if c.served}

    def score(inputs: list[Any]) -> Any:
        if not once_per_replica:
            return rewards.score_detailed(inputs)
        from rlbatch.distributed import from_first_in_model_parallel_group, model_parallel_group

        first = model_parallel_group()[0] == 0
        return from_first_in_model_parallel_group(
            (lambda: rewards.score_detailed(inputs)) if first else None
        )

    def reward_batch(samples: list[Sample]) -> list[float]:
        inputs = [reward_input(s, tokenizer) for s in samples]
        totals, parts, failures = score(inputs)
        for name, values in parts.items():
            for s, v in zip(samples, values, strict=True):
                s.metrics[f"reward/{name}"] = v
        for s, found in zip(samples, failures, strict=True):
            record_failures(s, found)
            if any(name in served for name, _ in found):
                s.metrics[SERVED_FAILED] = 1.0
        return add_episode_rewards(samples, totals, abs_max, skip_errors)

    return reward_batch


def record_failures(sample: Sample, failures: Sequence[tuple[str, Any]]) -> None:
    """A sample's brought-reward failures: one line each in ``reward_failures`` (the logged
    sample) and a count per reason in its metrics (``reward_fail/<reason>``)."""
    sample.reward_failures = [f"{name}: {f}" for name, f in failures]
    for _, f in failures:
        key = f"reward_fail/{f.reason}"
        sample.metrics[key] = sample.metrics.get(key, 0.0) + 1.0


def add_episode_rewards(
    samples: Sequence[Sample],
    totals: list[float],
    abs_max: float = math.inf,
    skip_errors: bool = False,
) -> list[float]:
    """Each multi-turn sample's total plus the sum of its environment's step rewards
    (``reward/env`` in its metrics); an episode ended by an environment error
    (env.on_error=zero_reward or skip) totals 0 and so does each of its parts (``reward/<name>``,
    what ``reward/<name>_mean`` and the samples' ``reward_parts`` show); with ``skip_errors``
    (env.on_error=skip) it is also left out of training (:func:`skip_episode`). An
    episode reward that is not finite or is over ``abs_max`` in size counts as 0 with an
    ``env: out_of_range`` failure (``reward_fail/out_of_range``). Single-turn samples keep
    their total."""
    from rlbatch.rewards.kinds import bounded

    out = list(totals)
    for i, s in enumerate(samples):
        if s.episode is None:
            continue
        env = bounded(Scored(float(s.episode["reward"])), abs_max, "the environment's reward")
        for f in env.failures:
            key = f"reward_fail/{f.reason}"
            s.reward_failures = [*s.reward_failures, f"env: {f}"]
            s.metrics[key] = s.metrics.get(key, 0.0) + 1.0
        s.metrics["reward/env"] = env.value
        if s.episode["end"] == "error":
            for key in [k for k in s.metrics if k.startswith("reward/")]:
                s.metrics[key] = 0.0
            out[i] = 0.0
            if skip_errors:
                skip_episode(s)
        else:
            out[i] += env.value
    return out


def skip_episode(row: Sample) -> None:
    """Leave an errored episode out of training (env.on_error=skip): ``skipped`` set (the
    advantage estimators leave it out of its group's baseline and scale and give it 0), and
    every sample of it (the row and a split episode's earlier segments) carries no loss: its
    loss mask and teacher advantages are zeroed, so neither the loss, nor any normalization
    divisor (normalization.mode, grpo.loss_agg_mode), nor REINFORCE++'s token-weighted batch
    statistics, nor the zero-advantage guard counts a token of it."""
    for part in (row, *row.earlier_segments):
        part.skipped = True
        part.loss_mask = [0] * len(part.response_ids)
        if part.token_advantages is not None:
            part.token_advantages = [0.0] * len(part.response_ids)


def single_component(fn: RewardFn) -> RewardComponent:
    from rlbatch.grpo.rewards import score

    return RewardComponent("reward", 1.0, lambda inputs: score(fn, inputs))


def make_logps_fn(
    model: list[Any], cfg: RunConfig, *, old_pass: bool = False
) -> Callable[[list[Sample]], list]:
    """Logprobs of the response tokens under ``model`` (the reference model, or the policy for
    the old pass) at ``rollout.temperature``, chunked by an infer plan (batching.infer) over this
    rank's samples (every DP rank scores its own samples: plan dp = 1).

    ``old_pass`` (the policy's old-logprob pass) with an MoE policy: under
    grpo.routing_replay=r3 it replays each sample's rollout routing, under r2 it records its own
    into ``Sample.old_routing`` (what the training forward then replays). Every other pass (the
    reference, a teacher) routes for itself."""
    from rlbatch.batching.cost import cost_model_for
    from rlbatch.batching.planner import plan_pass
    from rlbatch.engine.logprobs import compute_logprobs

    infer = cfg.batching.infer
    cost = cost_model_for(cfg.model, infer)
    mode = RoutingReplay(cfg.grpo.routing_replay) if old_pass else RoutingReplay.none

    def ref_logps(samples: list[Sample]) -> list[list[float]]:
        sequences = [s.input_ids for s in samples]
        recorded: Optional[dict[int, Any]] = {} if mode == RoutingReplay.r2 else None
        plan = plan_pass(
            [len(x) for x in sequences],
            infer,
            dp=1,
            pp=cfg.parallel.pp,
            vpp=cfg.parallel.vpp,
            microbatch_group_size=cfg.parallel.microbatch_group_size_per_vp_stage,
            group_size=cfg.grpo.num_generations,
            cost=cost,
            seed=cfg.trainer.seed,
        )
        logps = compute_logprobs(
            model,
            sequences,
            in_step_with_expert_group(plan, infer.sequence_length_round),
            round_to=infer.sequence_length_round,
            temperature=cfg.rollout.temperature,
            # log p(token j+1 | ..j): the response starts at position len(prompt) - 1; the
            # prompt's positions are not projected to the vocabulary at all
            score_from=[len(s.prompt.prompt_ids) - 1 for s in samples],
            # observation tokens of multi-turn samples carry no loss: not projected either
            score_mask=[s.loss_mask or [] for s in samples] if any_masked(samples) else None,
            replay=[s.routing for s in samples] if mode == RoutingReplay.r3 else None,
            record=recorded,
        )
        if recorded is not None:
            for i, s in enumerate(samples):
                s.old_routing = recorded.get(i)
        return [lp.tolist() for lp in logps]

    return ref_logps


def in_step_with_expert_group(plan: Any, round_to: int) -> Any:
    """``plan`` (this rank's own, dp = 1) with zero-weight filler micro-batches appended up to
    the most any rank of its expert-parallel group plans: every forward of an MoE layer is an
    all-to-all over that group, so its ranks must run as many forwards each, although each
    plans its own samples' lengths (without expert parallelism: ``plan`` itself)."""
    from dataclasses import replace

    from rlbatch import distributed
    from rlbatch.batching.assemble import filler_micro_batch

    missing = distributed.max_in_expert_group(plan.num_micro_batches) - plan.num_micro_batches
    if missing <= 0:
        return plan
    (own,) = plan.ranks
    filler = filler_micro_batch(round_to, packed=any(mb.packed for mb in own.micro_batches))
    fillers = (filler,) * missing
    return replace(
        plan,
        num_micro_batches=plan.num_micro_batches + missing,
        ranks=(replace(own, micro_batches=own.micro_batches + fillers),),
    )


def any_masked(samples: Sequence[Sample]) -> bool:
    """Whether any sample has tokens outside its loss (multi-turn observations)."""
    return any(s.loss_mask is not None and 0 in s.loss_mask for s in samples)


def build_reference(cfg: RunConfig, policy: list[Any]) -> list[Any] | None:
    """A frozen copy of the initial policy (grpo.beta > 0), rebuilt identically on resume.
    None with LoRA adapters (model.lora.rank > 0): the reference is then the policy itself with
    its adapters switched off (:func:`reference_logps_fn`), no second copy of the weights."""
    if cfg.grpo.beta <= 0 or cfg.model.lora.rank > 0:
        return None
    from rlbatch.engine.adapter import unwrap
    from rlbatch.engine.model import build_model

    ref = build_model(cfg, wrap_ddp=False)
    for dst, src in zip(ref, policy, strict=True):
        dst.load_state_dict(unwrap(src).state_dict())
        dst.eval()
        for p in dst.parameters():
            p.requires_grad_(False)
    return ref


def reference_logps_fn(
    cfg: RunConfig, ref: list[Any] | None, policy: list[Any] | None
) -> Callable[[list[Sample]], list] | None:
    """The reference pass (grpo.beta > 0; None otherwise): the frozen copy ``ref``, or with
    LoRA the ``policy`` with its adapters disabled, which is the initial policy exactly (the
    base weights never train and B starts at zero)."""
    if cfg.grpo.beta <= 0:
        return None
    if ref is not None:
        return make_logps_fn(ref, cfg)
    if policy is None:
        raise ValueError("grpo.beta > 0 with LoRA: the reference pass needs the policy model")
    from rlbatch.engine.lora import adapters_disabled

    policy_logps = make_logps_fn(policy, cfg)

    def base_logps(samples: list[Sample]) -> list[list[float]]:
        with adapters_disabled(policy):
            return policy_logps(samples)

    return base_logps


def teacher_logps_fn(cfg: RunConfig) -> Callable[[list[Sample]], list] | None:
    """The teacher pass (None without a teacher): the frozen teacher's log-probs of every
    sampled response token at rollout.temperature (the behaviour log-probs'), chunked by the
    infer plan with the teacher's own cost model (rlbatch.grpo.teacher), or a served teacher's
    prompt log-probs (grpo.distill.teacher_url: rlbatch.grpo.served_teacher)."""
    if cfg.grpo.distill.teacher_url:
        from rlbatch.grpo.served_teacher import served_teacher_logps_fn

        return served_teacher_logps_fn(cfg)
    if not cfg.grpo.distill.teacher:
        return None
    from rlbatch.grpo.teacher import build_teacher

    chunks, teacher_cfg = build_teacher(cfg)
    return make_logps_fn(chunks, teacher_cfg)


def make_no_rewards(skip_errors: bool) -> Callable[[list[Sample]], list[float]]:
    """Pure distillation's reward stage (grpo.distill.reward_coef=0): 0 for every sample,
    without a reward function; with ``skip_errors`` (env.on_error=skip) an episode ended by an
    error is still left out of training (:func:`skip_episode`: its teacher advantages too)."""

    def no_rewards(samples: list[Sample]) -> list[float]:
        for s in samples:
            if skip_errors and s.episode is not None and s.episode["end"] == "error":
                skip_episode(s)
        return [0.0] * len(samples)

    return no_rewards


def build_aggregator(
    cfg: RunConfig,
    tokenizer: Any,
    ref: list[Any] | None,
    dp_rank: int,
    policy: list[Any] | None = None,
):
    """The LCM aggregator of this rank (rollout_fn is set per round by make_generate_fn);
    ``policy``: the chunks whose adapters-off forward is the reference with LoRA."""
    from rlbatch.grpo.lcm import Stages, plan_aggregation
    from rlbatch.grpo.rewards import build_run_rewards

    def no_rollout(rows: list[Prompt], seed: int) -> list[Sample]:
        raise RuntimeError("rollout_fn is set by the producer's generate_fn for each round")

    from rlbatch.grpo.distill import DistillSettings

    distill = DistillSettings.from_config(cfg) if distill_on(cfg) else None
    pure = distill is not None and distill.reward_coef == 0
    skip_errors = EnvOnError(cfg.env.on_error) == EnvOnError.skip
    stages = Stages(
        rollout_fn=no_rollout,
        # pure distillation: no reward function is built or called, every reward is 0
        reward_fn=make_no_rewards(skip_errors)
        if pure
        else make_reward_batch_fn(
            build_run_rewards(cfg),
            tokenizer,
            cfg.data.reward_abs_max,
            skip_errors=skip_errors,
            once_per_replica=True,
        ),
        old_logps_fn=None,  # the old pass runs at the round's first step (make_round_start)
        ref_logps_fn=reference_logps_fn(cfg, ref, policy),
        teacher_logps_fn=teacher_logps_fn(cfg),
    )
    # scale_rewards=batch: the aggregator only centres; the round's first step divides by the
    # std of the whole generation batch over every DP rank (make_round_start)
    scale = ScaleRewards(cfg.grpo.scale_rewards)
    return LCMAggregator(
        plan_aggregation(cfg),
        stages,
        beta=cfg.grpo.beta,
        scale_rewards=ScaleRewards.none if scale == ScaleRewards.batch else scale,
        advantage_eps=cfg.grpo.advantage_eps,
        seed=rank_seed(cfg.trainer.seed, dp_rank),
        estimator=cfg.grpo.advantage_estimator,
        distill=distill,
    )
