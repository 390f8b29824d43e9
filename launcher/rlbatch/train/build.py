"""Assemble the real components of the loop (Megatron engine, GRPO parts) from a RunConfig.

:func:`make_generate_fn` (the producer's generate_fn on top of the LCM aggregator and a rollout
engine) is pure orchestration and unit-tested with fakes; :func:`build_components` wires the
engine (rlbatch.engine.*), rlbatch.distributed and the GRPO train step per docs/interfaces.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
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
from rlbatch.train.loop import Components, train
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
) -> GenerateFn:
    """generate_fn(request, snapshot): this rank's prompts of a round through the aggregator.

    The request's prompts are pushed as training micro-batches of ``train_micro_batch_size``
    prompts, then flushed (a round never leaves a partial buffer behind); the examples come back
    in push order, so sample ``g*G + j`` is completion j of the request's prompt g. Group ids
    are set to the sampler's (unique over the run and across ranks). With
    ``grpo.aggregation.proceed_num_steps`` = k, every k micro-batches end with a flush (an
    aggregation round never spans more). ``batch_repeat`` is not applied here: the producer
    repeats each mini-batch in the same a a b b order (docs/training_loop.md).
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
        return samples

    return generate


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


def overlaps_generation(cfg: RunConfig) -> bool:
    """Generation of the next round runs in a worker process while training runs
    (grpo.num_steps_async > 0; rlbatch.train.generation_worker), when generation issues no
    collective: tp = pp = cp = 1. Other layouts generate the due rounds inline (the same
    samples and versions, no overlap). docs/training_loop.md, "Async run-ahead"."""
    p, g = cfg.parallel, cfg.grpo
    ahead = min(g.num_steps_async, g.max_staleness) > 0
    return g.overlap_generation and ahead and p.tp == p.pp == p.cp == 1


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
    component's value goes to the sample's metrics as ``reward/<name>``."""
    rewards = fn if isinstance(fn, RewardSet) else RewardSet((single_component(fn),))

    def reward_batch(samples: list[Sample]) -> list[float]:
        totals, parts = rewards.score([reward_input(s, tokenizer) for s in samples])
        for name, values in parts.items():
            for s, v in zip(samples, values, strict=True):
                s.metrics[f"reward/{name}"] = v
        return totals

    return reward_batch


def single_component(fn: RewardFn) -> RewardComponent:
    from rlbatch.grpo.rewards import score

    return RewardComponent("reward", 1.0, lambda inputs: score(fn, inputs))


def reward_means(samples: Sequence[Sample], names: Sequence[str], dist: Any) -> dict[str, float]:
    """``reward/<name>_mean`` of each reward component over the step's samples (all ranks)."""
    local = [float(len(samples))] + [
        sum(s.metrics.get(f"reward/{n}", 0.0) for s in samples) for n in names
    ]
    total = dist.all_reduce_sum(local)
    count = max(total[0], 1.0)
    return {f"reward/{n}_mean": v / count for n, v in zip(names, total[1:], strict=True)}


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
        )
        # logps[i][j] = log p(token j+1 | ..j): the response starts at len(prompt) - 1
        return [
            lp[len(s.prompt.prompt_ids) - 1 :].tolist()
            for s, lp in zip(samples, logps, strict=True)
        ]

    return ref_logps


def build_reference(cfg: RunConfig, policy: list[Any]) -> list[Any] | None:
    """A frozen copy of the initial policy (grpo.beta > 0), rebuilt identically on resume."""
    if cfg.grpo.beta <= 0:
        return None
    from rlbatch.engine.model import build_model, unwrap

    ref = build_model(cfg, wrap_ddp=False)
    for dst, src in zip(ref, policy, strict=True):
        dst.load_state_dict(unwrap(src).state_dict())
        dst.eval()
        for p in dst.parameters():
            p.requires_grad_(False)
    return ref


def build_aggregator(cfg: RunConfig, tokenizer: Any, ref: list[Any] | None, dp_rank: int):
    """The LCM aggregator of this rank (rollout_fn is set per round by make_generate_fn)."""
    from rlbatch.grpo.lcm import Stages, plan_aggregation
    from rlbatch.grpo.rewards import build_rewards

    def no_rollout(rows: list[Prompt], seed: int) -> list[Sample]:
        raise RuntimeError("rollout_fn is set by the producer's generate_fn for each round")

    stages = Stages(
        rollout_fn=no_rollout,
        reward_fn=make_reward_batch_fn(build_rewards(cfg.data), tokenizer),
        old_logps_fn=None,  # the old pass runs at the round's first step (make_round_start)
        ref_logps_fn=make_logps_fn(ref, cfg) if ref is not None else None,
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
    )


def make_round_start(cfg: RunConfig, model: list[Any]) -> Callable[[list[Sample]], dict]:
    """round_start(round samples) -> metrics: what a round's first step runs before training,
    with the policy at the round's start version (rlbatch.grpo.proximal): the batch reward std
    over all DP ranks (scale_rewards=batch) and the old-logprob pass (off-policy samples)."""
    import time

    from rlbatch import distributed
    from rlbatch.grpo.lcm import aggregation_plan
    from rlbatch.grpo.proximal import compute_old_logps, scale_by_batch_std

    plan = aggregation_plan(cfg)
    old_fn = make_logps_fn(model, cfg) if plan.old_pass else None
    batch_scale = ScaleRewards(cfg.grpo.scale_rewards) == ScaleRewards.batch

    def round_start(samples: list[Sample]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if batch_scale:
            std = scale_by_batch_std(samples, cfg.grpo.advantage_eps, distributed.dp_gather_object)
            metrics["reward_batch_std"] = std
        if old_fn is not None:
            started = time.perf_counter()
            compute_old_logps(samples, old_fn, plan)
            metrics["old_logps_seconds"] = time.perf_counter() - started
        return metrics

    return round_start


def make_plan_writer(cfg: RunConfig) -> Callable[[int, list[int], Any], None]:
    """write(step, lengths, plan): <run_dir>/plans/step_NNNNN.json with the mini-batch's lengths
    and rlbatch-plan's JSON of the train pass (logging.plans)."""
    import json
    from pathlib import Path

    assert cfg.run_dir is not None
    folder = Path(cfg.run_dir) / "plans"

    def write(step: int, lengths: list[int], plan: Any) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        doc = {"step": step, "lengths": lengths, "plan": plan.to_json()}
        (folder / f"step_{step:05d}.json").write_text(json.dumps(doc))

    return write


def make_train_step(cfg: RunConfig, model: list[Any], optimizer: Any, scheduler: Any, ps: Any):
    """The loop's TrainStepFn: the round's first step prepares the round
    (:func:`make_round_start`), then rlbatch.grpo.step.run_train_step."""
    from rlbatch import distributed
    from rlbatch.distributed import WorldDist
    from rlbatch.grpo.rewards import component_names
    from rlbatch.grpo.step import Reducers, run_train_step

    names = component_names(cfg.data)
    world = WorldDist()

    layout = ps
    reducers = Reducers(
        reduce_dp=distributed.reduce_dp,
        reduce_step=distributed.reduce_step,
        gather_samples=distributed.dp_gather_object,
    )

    round_start = make_round_start(cfg, model)
    write_plan = make_plan_writer(cfg) if cfg.logging.plans and ps.rank == 0 else None

    def train_step(batch: Any, step: int, inject_nan: bool) -> dict[str, Any]:
        prepared = round_start(batch.round_samples) if batch.new_round else {}
        metrics = run_train_step(
            cfg,
            model,
            optimizer,
            scheduler,
            batch.samples,
            step=step - 1,
            layout=layout,
            reducers=reducers,
            inject_nan=inject_nan,
            plan_sink=None if write_plan is None else partial(write_plan, step),
        )
        return {
            **reward_means(batch.samples, names, world),
            **metrics,
            **prepared,
            "batch_seconds": batch.batch_seconds,
        }

    return train_step


def run(cfg: RunConfig) -> None:
    """Worker entry of rlbatch-train (inside each torchrun process): build, then train; the
    producer (and its generation worker, if any) is closed at the end."""
    components = build_components(cfg)
    try:
        train(cfg, components)
    finally:
        components.producer.close()


def build_components(cfg: RunConfig) -> Components:
    """The loop's Components for a real run: engine, data, GRPO stages, producer."""
    from rlbatch.distributed import WorldDist
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_optimizer
    from rlbatch.engine.setup import set_up_model
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.data import load_prompts
    from rlbatch.grpo.rollout import build_rollout_engine
    from rlbatch.train.producer import RunAheadProducer
    from rlbatch.train.sampler import PromptSampler, schedule_from_config

    setup = set_up_model(cfg, wrap_ddp=True)  # cfg.model: the architecture of model.hf_path
    cfg, model, ps = setup.cfg, setup.model, setup.state
    optimizer, scheduler = build_optimizer(cfg, model)
    tokenizer = build_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tokenizer, cfg.trainer.seed)
    ref = build_reference(cfg, model)
    schedule = schedule_from_config(cfg.grpo, ps.dp)
    sampler = PromptSampler(
        len(prompts), schedule, dp_rank=ps.dp_rank, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
    )
    threaded = overlaps_generation(cfg)
    if threaded:  # a worker process generates; the cores are shared: half the threads each
        import torch

        from rlbatch.train.generation_worker import GenerationWorker

        threads = max(1, torch.get_num_threads() // 2)
        torch.set_num_threads(threads)
        generate: Any = GenerationWorker(
            cfg,
            dp_rank=ps.dp_rank,
            threads=threads,
            ref_weights=weights_snapshot(ref) if ref is not None else None,
        )
        aggregator: Any = generate  # its state_dict is the worker aggregator's
    else:
        aggregator = build_aggregator(cfg, tokenizer, ref, ps.dp_rank)
        engine: RolloutEngine = build_rollout_engine(
            cfg, model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, chunked=False
        )
        if cfg.parallel.sequence_parallel and cfg.parallel.tp > 1:
            engine = SequenceParallelOffEngine(engine, model)
        generate = make_generate_fn(
            prompts,
            aggregator,
            engine,
            train_micro_batch_size=cfg.grpo.aggregation.train_micro_batch_size,
        )
    producer = RunAheadProducer(
        sampler,
        generate,
        num_steps_async=cfg.grpo.num_steps_async,
        max_staleness=cfg.grpo.max_staleness,
        seed=cfg.trainer.seed,
        threaded=threaded,
        snapshot_fn=(lambda: weights_snapshot(model)) if threaded else None,
        timeout_s=float(cfg.trainer.timeout_s),
    )
    layout = ps.sizes()
    return Components(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        producer=producer,
        train_step=make_train_step(cfg, model, optimizer, scheduler, ps),
        dist=WorldDist(),
        aggregator=aggregator,
        export_hf=lambda path: hf.export_hf(model, cfg.model, path),
        meta={"parallel": layout, "rank_coords": _rank_coords(ps)},
    )


def _rank_coords(ps: Any) -> list[dict[str, int]]:
    """(tp, pp, dp, cp) rank of every global rank, for meta.json."""
    from rlbatch.distributed import all_gather_object

    mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank, "cp": ps.cp_rank}
    return all_gather_object(mine)
