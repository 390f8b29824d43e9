"""Assemble the real components of the loop (Megatron engine, GRPO parts) from a RunConfig.

:func:`make_generate_fn` (the producer's generate_fn on top of the LCM aggregator and a rollout
engine) is pure orchestration and unit-tested with fakes; :func:`build_components` wires the
engine (rlbatch.engine.*), rlbatch.distributed and the GRPO train step per docs/interfaces.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlbatch.config.schema import RunConfig
from rlbatch.grpo.lcm import LCMAggregator
from rlbatch.grpo.rewards import RewardFn, RewardInput, score
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
) -> GenerateFn:
    """generate_fn(request, snapshot): this rank's prompts of a round through the aggregator.

    The request's prompts are pushed as training micro-batches of ``train_micro_batch_size``
    prompts, then flushed (a round never leaves a partial buffer behind); the examples come back
    in push order, so sample ``g*G + j`` is completion j of the request's prompt g. Group ids
    are set to the sampler's (unique over the run and across ranks). ``batch_repeat`` is not
    applied here: the producer reuses rounds (docs/training_loop.md).
    """

    def generate(request: GenerationRequest, snapshot: PolicySnapshot) -> list[Sample]:
        aggregator.stages.rollout_fn = as_rollout_fn(engine, snapshot.version)
        batch = [prompts[i] for i in request.prompt_indices]
        examples = []
        for start in range(0, len(batch), train_micro_batch_size):
            examples.extend(aggregator.push(batch[start : start + train_micro_batch_size]))
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


def make_reward_batch_fn(fn: RewardFn, tokenizer: Any) -> Callable[[list[Sample]], list[float]]:
    """The aggregator's reward_fn: decode responses (EOS excluded) and score them."""

    def reward_batch(samples: list[Sample]) -> list[float]:
        inputs = []
        for s in samples:
            ids = list(s.response_ids)
            if ids and ids[-1] == tokenizer.eos_id:
                ids = ids[:-1]
            inputs.append(
                RewardInput(
                    prompt=s.prompt.text,
                    response=tokenizer.decode(ids),
                    answer=s.prompt.answer,
                    num_response_tokens=len(ids),
                )
            )
        return score(fn, inputs)

    return reward_batch


def make_ref_logps_fn(ref_model: list[Any], cfg: RunConfig) -> Callable[[list[Sample]], list]:
    """Reference-model logprobs of the response tokens, chunked by an infer plan (batching.infer)
    over this rank's samples (every DP rank scores its own samples: plan dp = 1)."""
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
        logps = compute_logprobs(ref_model, sequences, plan, round_to=infer.sequence_length_round)
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
    from rlbatch.grpo.rewards import build_reward_fn

    def no_rollout(rows: list[Prompt], seed: int) -> list[Sample]:
        raise RuntimeError("rollout_fn is set by the producer's generate_fn for each round")

    stages = Stages(
        rollout_fn=no_rollout,
        reward_fn=make_reward_batch_fn(build_reward_fn(cfg.data), tokenizer),
        old_logps_fn=None,  # old = behaviour logps (rollout); the loss corrects the lag
        ref_logps_fn=make_ref_logps_fn(ref, cfg) if ref is not None else None,
    )
    return LCMAggregator(
        plan_aggregation(cfg),
        stages,
        beta=cfg.grpo.beta,
        scale_rewards=cfg.grpo.scale_rewards,
        advantage_eps=cfg.grpo.advantage_eps,
        seed=rank_seed(cfg.trainer.seed, dp_rank),
    )


def make_train_step(cfg: RunConfig, model: list[Any], optimizer: Any, scheduler: Any, ps: Any):
    """The loop's TrainStepFn on rlbatch.grpo.step.run_train_step."""
    from rlbatch import distributed
    from rlbatch.grpo.step import Layout, Reducers, run_train_step

    layout = Layout(dp=ps.dp, dp_rank=ps.dp_rank, cp=ps.cp, pp=ps.pp, vpp=ps.vpp, rank=ps.rank)
    reducers = Reducers(
        reduce_dp=distributed.reduce_dp,
        reduce_step=distributed.reduce_step,
        gather_samples=distributed.dp_gather_object,
    )

    def train_step(batch: Any, step: int, inject_nan: bool) -> dict[str, Any]:
        return run_train_step(
            cfg,
            model,
            optimizer,
            scheduler,
            batch.samples,
            step=step - 1,
            layout=layout,
            reducers=reducers,
            current_version=step - 1,
            inject_nan=inject_nan,
        )

    return train_step


def build_components(cfg: RunConfig) -> Any:
    """The loop's Components for a real run: engine, data, GRPO stages, producer."""
    import logging

    from rlbatch.distributed import WorldDist
    from rlbatch.engine import hf, parallel
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.data import load_prompts
    from rlbatch.grpo.rollout import build_rollout_engine
    from rlbatch.train.loop import Components
    from rlbatch.train.producer import RunAheadProducer
    from rlbatch.train.sampler import PromptSampler, schedule_from_config

    ps = parallel.initialize(cfg)
    cfg.model, changed = hf.resolve_model_config(cfg.model)
    for note in changed:
        logging.getLogger("rlbatch.train").warning("from %s: %s", cfg.model.hf_path, note)
    model = build_model(cfg)
    if cfg.model.hf_path:
        hf.load_hf_into(model, cfg.model.hf_path)
    optimizer, scheduler = build_optimizer(cfg, model)
    tokenizer = build_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tokenizer, cfg.trainer.seed)
    aggregator = build_aggregator(cfg, tokenizer, build_reference(cfg, model), ps.dp_rank)
    engine = build_rollout_engine(
        cfg, model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, chunked=False
    )
    schedule = schedule_from_config(cfg.grpo, ps.dp)
    sampler = PromptSampler(
        len(prompts), schedule, dp_rank=ps.dp_rank, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
    )
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
    )
    layout = {k: getattr(ps, k) for k in ("tp", "pp", "vpp", "cp", "dp")}
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
