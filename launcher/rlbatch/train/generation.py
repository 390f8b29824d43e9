"""The generation side of a GRPO run: the LCM aggregator over prompts, rewards and the
reference / old-logprob passes, and the producer's generate_fn on top of a rollout engine.

Built in the trainer's processes (``rlbatch.train.build``) and, for async overlap, in each
generation worker process (``rlbatch.train.generation_worker``), so neither imports the other.
:func:`make_generate_fn` is pure orchestration and unit-tested with fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlbatch.config.schema import RunConfig, ScaleRewards
from rlbatch.grpo.lcm import LCMAggregator
from rlbatch.grpo.rewards import (
    RewardComponent,
    RewardFn,
    RewardSet,
    reward_input,
)
from rlbatch.grpo.rollout import RolloutEngine, as_rollout_fn
from rlbatch.grpo.types import Prompt, Sample
from rlbatch.train.producer import GenerateFn, PolicySnapshot
from rlbatch.train.sampler import GenerationRequest


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
    for i, s in enumerate(samples):
        rng = np.random.default_rng([_PERTURB_TAG, seed, s.group_id, i % group])
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

    from rlbatch.engine.model import unwrap

    return [
        {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in sd.items()}
        for sd in (unwrap(c).state_dict() for c in model)
    ]


def make_reward_batch_fn(
    fn: RewardFn | RewardSet, tokenizer: Any
) -> Callable[[list[Sample]], list[float]]:
    """The aggregator's reward_fn: decode responses (EOS excluded) and score them; each
    component's value goes to the sample's metrics as ``reward/<name>``. A multi-turn sample
    adds the sum of its environment's step rewards (``reward/env``); an episode ended by an
    environment error (env.on_error=zero_reward) gets a total of 0, and every part 0."""
    rewards = fn if isinstance(fn, RewardSet) else RewardSet((single_component(fn),))

    def reward_batch(samples: list[Sample]) -> list[float]:
        inputs = [reward_input(s, tokenizer) for s in samples]
        totals, parts, failures = rewards.score_detailed(inputs)
        for name, values in parts.items():
            for s, v in zip(samples, values, strict=True):
                s.metrics[f"reward/{name}"] = v
        for s, found in zip(samples, failures, strict=True):
            record_failures(s, found)
        return add_episode_rewards(samples, totals)

    return reward_batch


def record_failures(sample: Sample, failures: Sequence[tuple[str, Any]]) -> None:
    """A sample's brought-reward failures: one line each in ``reward_failures`` (the logged
    sample) and a count per reason in its metrics (``reward_fail/<reason>``)."""
    sample.reward_failures = [f"{name}: {f}" for name, f in failures]
    for _, f in failures:
        key = f"reward_fail/{f.reason}"
        sample.metrics[key] = sample.metrics.get(key, 0.0) + 1.0


def add_episode_rewards(samples: Sequence[Sample], totals: list[float]) -> list[float]:
    """Each multi-turn sample's total plus the sum of its environment's step rewards
    (``reward/env`` in its metrics); an episode ended by an environment error
    (env.on_error=zero_reward) totals 0 and so does each of its parts (``reward/<name>``, what
    ``reward/<name>_mean`` and the samples' ``reward_parts`` show: what was trained).
    Single-turn samples keep their total."""
    out = list(totals)
    for i, s in enumerate(samples):
        if s.episode is None:
            continue
        s.metrics["reward/env"] = s.episode["reward"]
        if s.episode["end"] == "error":
            for key in [k for k in s.metrics if k.startswith("reward/")]:
                s.metrics[key] = 0.0
            out[i] = 0.0
        else:
            out[i] += s.episode["reward"]
    return out


def build_engine(
    cfg: RunConfig, model: list[Any], tokenizer: Any, *, chunked: bool = False
) -> RolloutEngine:
    """The rollout engine of a run (a training run's LCM aggregator chunks, so by default no
    chunk size; evaluation chunks by rollout.micro_batch_size), multi-turn through the
    environment env.path names when it is set."""
    from rlbatch.grpo.rollout import build_rollout_engine

    driver = None
    if cfg.env.path:
        from rlbatch.env.driver import EnvDriver
        from rlbatch.env.loader import build_environment

        driver = EnvDriver(build_environment(cfg.env.path, cfg.env.kwargs), cfg, tokenizer)
    return build_rollout_engine(
        cfg, model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, chunked=chunked, driver=driver
    )


def single_component(fn: RewardFn) -> RewardComponent:
    from rlbatch.grpo.rewards import score

    return RewardComponent("reward", 1.0, lambda inputs: score(fn, inputs))


def make_logps_fn(model: list[Any], cfg: RunConfig) -> Callable[[list[Sample]], list]:
    """Logprobs of the response tokens under ``model`` (the reference model, or the policy for
    the old pass) at ``rollout.temperature``, chunked by an infer plan (batching.infer) over this
    rank's samples (every DP rank scores its own samples: plan dp = 1)."""
    from rlbatch.batching.cost import cost_model_for
    from rlbatch.batching.planner import plan_pass
    from rlbatch.engine.logprobs import compute_logprobs

    infer = cfg.batching.infer
    cost = cost_model_for(cfg.model, infer)

    def ref_logps(samples: list[Sample]) -> list[list[float]]:
        sequences = [s.input_ids for s in samples]
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
            plan,
            round_to=infer.sequence_length_round,
            temperature=cfg.rollout.temperature,
            # log p(token j+1 | ..j): the response starts at position len(prompt) - 1; the
            # prompt's positions are not projected to the vocabulary at all
            score_from=[len(s.prompt.prompt_ids) - 1 for s in samples],
            # observation tokens of multi-turn samples carry no loss: not projected either
            score_mask=[s.loss_mask or [] for s in samples] if any_masked(samples) else None,
        )
        return [lp.tolist() for lp in logps]

    return ref_logps


def any_masked(samples: Sequence[Sample]) -> bool:
    """Whether any sample has tokens outside its loss (multi-turn observations)."""
    return any(s.loss_mask is not None and 0 in s.loss_mask for s in samples)


def build_reference(cfg: RunConfig, policy: list[Any]) -> list[Any] | None:
    """A frozen copy of the initial policy (grpo.beta > 0), rebuilt identically on resume.
    None with LoRA adapters (model.lora.rank > 0): the reference is then the policy itself with
    its adapters switched off (:func:`reference_logps_fn`), no second copy of the weights."""
    if cfg.grpo.beta <= 0 or cfg.model.lora.rank > 0:
        return None
    from rlbatch.engine.model import build_model, unwrap

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

    stages = Stages(
        rollout_fn=no_rollout,
        reward_fn=make_reward_batch_fn(build_run_rewards(cfg), tokenizer),
        old_logps_fn=None,  # the old pass runs at the round's first step (make_round_start)
        ref_logps_fn=reference_logps_fn(cfg, ref, policy),
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
    )
