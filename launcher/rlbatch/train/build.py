"""Assemble the real components of the loop (Megatron engine, GRPO parts) from a RunConfig.

The generation side (aggregator, rewards, generate_fn) is :mod:`rlbatch.rollout.generation`;
:func:`build_components` wires it, the engine (rlbatch.engine.*), rlbatch.distributed and the
GRPO train step per docs/interfaces.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from rlbatch.config.distill import distill_on, pure_distillation
from rlbatch.config.enums import RewardKind
from rlbatch.config.env import multi_turn
from rlbatch.config.schema import (
    AdvantageEstimator,
    FilterGroups,
    RolloutBackend,
    RunConfig,
    ScaleRewards,
)
from rlbatch.config.streaming import overlaps_generation
from rlbatch.grpo.stages import build_aggregator, build_reference, make_logps_fn
from rlbatch.grpo.teacher_identity import read_identity
from rlbatch.grpo.types import Sample, trained_samples
from rlbatch.rollout.generation import weights_snapshot
from rlbatch.train.components import Components
from rlbatch.train.loop import train

log = logging.getLogger("rlbatch.train")


def reward_means(samples: Sequence[Sample], names: Sequence[str], dist: Any) -> dict[str, float]:
    """``reward/<name>_mean`` of each reward component over the step's samples (all ranks)."""
    local = [float(len(samples))] + [
        sum(s.metrics.get(f"reward/{n}", 0.0) for s in samples) for n in names
    ]
    total = dist.all_reduce_sum(local)
    count = max(total[0], 1.0)
    return {f"reward/{n}_mean": v / count for n, v in zip(names, total[1:], strict=True)}


def failure_counts(samples: Sequence[Sample], dist: Any, iteration: int = 0) -> dict[str, float]:
    """``reward_fail/<reason>``: failures of the step's samples by reason (every reason of
    rlbatch.rewards.base.FAILURE_REASONS, all ranks), for runs with a brought reward; 0 at
    ``iteration`` > 0 (grpo.num_iterations: the round's samples, scored once, trained again),
    so summed over steps each failure counts once (data.served.max_error_fraction reads its
    own per-sample flag, rlbatch.train.build.served_failures)."""
    from rlbatch.rewards.base import FAILURE_REASONS

    keys = [f"reward_fail/{r}" for r in FAILURE_REASONS]
    if iteration > 0:  # every rank is at the same iteration: no collective on any
        return dict.fromkeys(keys, 0.0)
    local = [sum(s.metrics.get(k, 0.0) for s in samples) for k in keys]
    return dict(zip(keys, dist.all_reduce_sum(local), strict=True))


def served_failures(samples: Sequence[Sample], dist: Any) -> tuple[float, float, str]:
    """(samples with a served reward failure, samples) of the step over every rank, and the
    failures of one such sample of this rank ("" when none: an example for the message)."""
    from rlbatch.grpo.stages import SERVED_FAILED

    failed = [s for s in samples if s.metrics.get(SERVED_FAILED)]
    count, total = dist.all_reduce_sum([float(len(failed)), float(len(samples))])
    example = "; ".join(failed[0].reward_failures)[:300] if failed else ""
    return count, total, example


def make_served_check(cfg: RunConfig, dist: Any) -> Callable[[Any, int], dict[str, float]] | None:
    """check(step batch, step) for runs with a served reward (http, judge; else None): it
    stops the run before the step trains when more than data.served.max_error_fraction of the
    samples had a served failure, and returns their fraction (``reward_served_fail_frac``).
    Under dynamic sampling a round's first step also counts the samples the round drew and
    does not train (its dropped groups: one whose every reward failed has zero variance)."""
    from rlbatch.grpo.rewards import brought_kinds
    from rlbatch.rewards.served import check_error_fraction
    from rlbatch.train.filtering import UNTRAINED, UNTRAINED_FAILED

    kinds = brought_kinds(cfg.data)
    if RewardKind.http not in kinds and RewardKind.judge not in kinds:
        return None

    def check(batch: Any, step: int) -> dict[str, float]:
        failed, total, example = served_failures(batch.samples, dist)
        dropped = 0.0
        if batch.new_round:  # dynamic sampling's dropped groups count on the round's first step
            dropped = batch.filter_metrics.get(UNTRAINED_FAILED, 0.0)
            failed, total = failed + dropped, total + batch.filter_metrics.get(UNTRAINED, 0.0)
        if total > 0 and failed / total > cfg.data.served.max_error_fraction:
            # every rank stops here (the counts are the step's): each names the same example,
            # the first rank's that has one, not its own (none when its samples all scored)
            example = next((e for e in dist.all_gather_object(example) if e), "")
            if dropped and not example:
                example = f"{dropped:.0f} in groups grpo.filter_groups dropped, not trained"
        check_error_fraction(failed, total, cfg.data.served, step, example)
        return {"reward_served_fail_frac": failed / max(total, 1.0)}

    return check


def make_round_start(cfg: RunConfig, model: list[Any]) -> Callable[[list[Sample]], dict]:
    """round_start(round samples) -> metrics: what a round's first step runs before training,
    with the policy at the round's start version (rlbatch.grpo.proximal): the batch reward std
    over all DP ranks (scale_rewards=batch) and the old-logprob pass (rounds of several steps,
    synchronous or not: rlbatch.grpo.lcm.old_pass_runs)."""
    import time

    from rlbatch import distributed
    from rlbatch.grpo.advantages import GLOBALLY_NORMALIZED
    from rlbatch.grpo.lcm import aggregation_plan
    from rlbatch.grpo.proximal import compute_old_logps, normalize_over_batch, scale_by_batch_std

    plan = aggregation_plan(cfg)
    old_fn = make_logps_fn(model, cfg, old_pass=True) if plan.old_pass else None
    estimator = AdvantageEstimator(cfg.grpo.advantage_estimator)
    batch_scale = (
        ScaleRewards(cfg.grpo.scale_rewards) == ScaleRewards.batch
        and estimator == AdvantageEstimator.grpo
    )
    global_norm = estimator in GLOBALLY_NORMALIZED

    def round_start(samples: list[Sample]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if batch_scale:
            std = scale_by_batch_std(samples, cfg.grpo.advantage_eps, distributed.dp_gather_object)
            metrics["reward_batch_std"] = std
        if global_norm:
            std = normalize_over_batch(
                samples, cfg.grpo.advantage_eps, distributed.dp_gather_object
            )
            metrics["advantage_batch_std"] = std
        if old_fn is not None:
            started = time.perf_counter()
            compute_old_logps(trained_samples(samples), old_fn, plan)
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


def make_train_step(
    cfg: RunConfig,
    model: list[Any],
    optimizer: Any,
    scheduler: Any,
    ps: Any,
    constants: dict[str, Any] | None = None,
):
    """The loop's TrainStepFn: the round's first step prepares the round
    (:func:`make_round_start`), then rlbatch.grpo.step.run_train_step. ``constants``: fields
    added to every step's metrics (trainable_params)."""
    from rlbatch import distributed
    from rlbatch.distributed import WorldDist
    from rlbatch.engine.moe_stats import ExpertLoad
    from rlbatch.grpo.step import Reducers, run_train_step
    from rlbatch.train.episodes import make_sample_writer

    world = WorldDist()
    check_served = make_served_check(cfg, world)
    reducers = Reducers(
        reduce_dp=distributed.reduce_dp,
        reduce_step=distributed.reduce_step,
        gather_samples=distributed.dp_gather_object,
        reduce_max=distributed.reduce_max,
    )
    round_start = make_round_start(cfg, model)
    batch_figures = make_batch_figures(cfg, world, ps.rank)
    write_plan = make_plan_writer(cfg) if cfg.logging.plans and ps.rank == 0 else None
    write_samples = None
    if cfg.logging.samples:
        assert cfg.run_dir is not None
        write_samples = make_sample_writer(
            cfg.run_dir, distributed.dp_gather_object, ps.rank, not pure_distillation(cfg)
        )
    guard = adapter_guard(cfg, model)
    expert_load = ExpertLoad(model) if cfg.model.num_moe_experts else None
    mismatch = routing_mismatch(cfg, model)

    def train_step(batch: Any, step: int, inject_nan: bool) -> dict[str, Any]:
        checked = check_served(batch, step) if check_served is not None else {}
        prepared = round_start(batch.round_samples) if batch.new_round else {}
        if guard is not None:
            guard.before()
        with expert_load.recording() if expert_load else contextlib.nullcontext():
            metrics = run_train_step(
                cfg, model, optimizer, scheduler, batch.samples, step=step, layout=ps,
                reducers=reducers, inject_nan=inject_nan,
                plan_sink=None if write_plan is None else partial(write_plan, step),
                routing_mismatch=mismatch,
            )  # fmt: skip
        metrics.update(moe_metrics(cfg, expert_load, mismatch))
        if guard is not None:
            guard.after(metrics, step)
        if write_samples is not None:
            write_samples(step, batch.samples)
        return {
            **batch_figures(batch.samples, step, batch.iteration),
            **metrics,
            **prepared,
            **checked,
            "batch_seconds": batch.batch_seconds,
            **(constants or {}),
        }

    return train_step


def make_batch_figures(
    cfg: RunConfig, world: Any, rank: int
) -> Callable[[list[Sample], int, int], dict[str, Any]]:
    """figures(samples, step, iteration): the batch's own figures, summed over the ranks'
    samples: the reward's mean per component, failure counts (rewards brought in,
    environments; at a round's first iteration only), episode figures (multi-turn; their warnings printed once; their event
    counters counted at a round's first iteration only: grpo.num_iterations > 1 trains the same
    episodes again, rlbatch.train.episodes.episode_metrics) and the teacher's (distillation)."""
    from rlbatch.grpo.distill import distill_metrics, sample_sums
    from rlbatch.grpo.rewards import brought_kinds, run_component_names
    from rlbatch.train.episodes import check_env_errors, episode_metrics

    names = run_component_names(cfg)
    count_failures = not pure_distillation(cfg) and (  # pure distillation scores nothing
        bool(brought_kinds(cfg.data)) or multi_turn(cfg.env)
    )
    warned: set[str] = set()

    def figures(samples: list[Sample], step: int, iteration: int = 0) -> dict[str, Any]:
        episodes = episode_metrics(samples, world, iteration) if multi_turn(cfg.env) else {}
        distill = {}
        if distill_on(cfg):  # in-process or served teacher
            sums = world.all_reduce_sum(sample_sums(trained_samples(samples)))
            distill = distill_metrics(sums, cfg.parallel.dp)
        failures = failure_counts(samples, world, iteration) if count_failures else {}
        if episodes and iteration == 0:  # a later iteration trains the episodes checked then
            _warn_env(check_env_errors(episodes, samples, cfg.env, step), rank, warned)
        return {**reward_means(samples, names, world), **failures, **episodes, **distill}

    return figures


def moe_metrics(cfg: RunConfig, expert_load: Any, mismatch: Any) -> dict[str, float]:
    """The step's moe/... figures: expert load (MoE policies), routing mismatch (when counted)."""
    metrics: dict[str, float] = {}
    if expert_load is not None:
        metrics.update(expert_load_metrics(cfg, expert_load))
    if mismatch is not None:
        metrics.update(routing_mismatch_metrics(mismatch))
    return metrics


def expert_load_metrics(cfg: RunConfig, load: Any) -> dict[str, float]:
    """The step's moe/... metrics: tokens per expert of every MoE layer, summed over the world
    (each rank routed its own micro-batches through its own stage's layers; the max / mean
    ratios do not change with the copies tensor parallelism adds)."""
    import torch

    from rlbatch import distributed
    from rlbatch.engine.moe_stats import imbalance_metrics

    m = cfg.model
    counts = torch.zeros(m.num_layers, m.num_moe_experts or 0, dtype=torch.float64)
    for index, row in load.take().items():
        counts[index] = row
    (counts,) = distributed.all_reduce_sum([counts], group=None)
    return imbalance_metrics(counts)


def routing_mismatch(cfg: RunConfig, model: list[Any]) -> Any:
    """An MoE policy's routing replay slots (rlbatch.engine.routing) and the counter of
    ``moe/routing_mismatch``; None for a dense model."""
    if cfg.model.num_moe_experts is None:
        return None
    from rlbatch.engine import routing
    from rlbatch.grpo.step import RoutingMismatch

    drops = cfg.model.moe_expert_capacity_factor is not None  # needs tp = 1: every rank counts
    return RoutingMismatch(routing.attach(model), cfg.model.moe_router_topk, drops)


def routing_mismatch_metrics(mismatch: Any) -> dict[str, float]:
    """The step's moe/routing_mismatch figures, counts summed over the world (each rank counted
    its own micro-batches at its own stage's layers; tensor-parallel copies scale both counts),
    and with a capacity factor moe/dropped_tokens (token-to-expert assignments of real tokens
    the capacity dropped in the step's training forwards) and moe/dropped_fraction."""
    from rlbatch import distributed
    from rlbatch.engine.routing import mismatch_metrics

    counts, drops = distributed.all_reduce_sum([mismatch.take(), mismatch.take_drops()], group=None)
    out = mismatch_metrics(counts)
    if float(drops[0]) > 0:  # a capacity factor (counted on every rank, each its own tokens)
        out["moe/dropped_tokens"] = float(drops[1])
        out["moe/dropped_fraction"] = float(drops[1] / drops[0]) if drops[0] > 0 else 0.0
    return out


def adapter_guard(cfg: RunConfig, model: list[Any]) -> Any:
    """The check that the first optimizer steps move the LoRA adapters (None without LoRA)."""
    if cfg.model.lora.rank <= 0:
        return None
    from rlbatch import distributed
    from rlbatch.engine.lora import adapter_parameters
    from rlbatch.train.adapter_guard import AdapterGuard

    def any_rank(flag: bool) -> bool:
        return any(distributed.all_gather_object(flag))

    return AdapterGuard(adapter_parameters(model), any_rank)


def _warn_env(warnings: list[str], rank: int, warned: set[str]) -> None:
    """Rank 0 logs each environment warning; "no episode reached the environment" once."""
    import logging

    for text in warnings:
        kind = "unreached" if "no episode reached" in text else text
        if rank == 0 and kind not in warned:
            logging.getLogger("rlbatch.env").warning(text)
        if kind == "unreached":
            warned.add(kind)


def run(cfg: RunConfig) -> None:
    """Worker entry of rlbatch-train (inside each torchrun process): build, then train; the
    producer (and its generation worker, if any) and the evaluation's environment driver are
    closed at the end. The run sets the process's torch threads (trainer.num_threads; half of
    them when generation overlaps training) and gives back the count it found, however it
    ends: runs one after another in one process (tests, notebooks) each start from the same."""
    import torch

    threads = torch.get_num_threads()
    try:
        components = build_components(cfg)
        try:
            train(cfg, components)
        finally:
            components.producer.close()
            close_evaluation = getattr(components.evaluate, "close", None)
            if callable(close_evaluation):
                close_evaluation()
    finally:
        torch.set_num_threads(threads)


def build_generation(
    cfg: RunConfig, model: list[Any], ref: Any, tokenizer: Any, prompts: list[Any], dp_rank: int
) -> tuple[Any, Any]:
    """(generate_fn, aggregator): a generation worker process when generation overlaps training
    (:func:`overlaps_generation`; the cores are shared, half the threads each side), else the
    rollout engine on the policy's own chunks driven by this rank's LCM aggregator."""
    if overlaps_generation(cfg):
        import torch

        from rlbatch.rollout.generation_worker import GenerationWorker

        threads = max(1, torch.get_num_threads() // 2)
        torch.set_num_threads(threads)
        nonce, replicas = _server_run(cfg)
        worker = GenerationWorker(
            cfg,
            dp_rank=dp_rank,
            threads=threads,
            ref_weights=weights_snapshot(ref) if ref is not None else None,
            nonce=nonce,
            replicas=replicas,
        )
        return worker, worker  # its state_dict is the worker aggregator's
    from rlbatch.rollout.streaming import local_generation

    aggregator = build_aggregator(cfg, tokenizer, ref, dp_rank, policy=model)
    return local_generation(cfg, model, tokenizer, prompts, aggregator, dp_rank)


def _server_run(cfg: RunConfig) -> tuple[Any, Any]:
    """(nonce, replicas) for generation workers on rollout servers: the run's sync-label nonce,
    and at dp > 1 a gloo group over the DP ranks (tp = pp = cp = 1: every rank) whose
    generation threads meet before each new version; (None, None) on other backends. Every rank
    calls it in the same order, in the training thread."""
    if RolloutBackend(cfg.rollout.backend) != RolloutBackend.vllm_server:
        return None, None
    from datetime import timedelta

    import torch.distributed as dist

    from rlbatch.rollout.servers.backend import run_nonce

    nonce = run_nonce()
    if cfg.parallel.dp == 1:
        return nonce, None
    timeout = timedelta(seconds=cfg.trainer.timeout_s)
    return nonce, dist.new_group(backend="gloo", timeout=timeout)


def build_components(cfg: RunConfig) -> Components:
    """The loop's Components for a real run: engine, data, GRPO stages, producer."""
    from rlbatch.distributed import WorldDist
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_optimizer, count_parameters
    from rlbatch.engine.setup import set_up_model
    from rlbatch.engine.tokenizer import build_tokenizer
    from rlbatch.grpo.data import load_prompts
    from rlbatch.rollout.schedule import PromptSampler, schedule_from_config
    from rlbatch.train.producer import RunAheadProducer

    setup = set_up_model(cfg, wrap_ddp=True)  # cfg.model: the architecture of model.hf_path
    cfg, model, ps = setup.cfg, setup.model, setup.state
    optimizer, scheduler = build_optimizer(cfg, model)
    tokenizer = build_tokenizer(cfg.model)
    prompts = load_prompts(
        cfg.data,
        tokenizer,
        cfg.trainer.seed,
        need_answer=not pure_distillation(cfg),
        verifiers=cfg.env.agent.verifiers,
    )
    ref = build_reference(cfg, model)
    schedule = schedule_from_config(cfg.grpo, ps.dp)
    sampler = PromptSampler(
        len(prompts), schedule, dp_rank=ps.dp_rank, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle
    )
    threaded = overlaps_generation(cfg)
    generate, aggregator = build_generation(cfg, model, ref, tokenizer, prompts, ps.dp_rank)
    producer = RunAheadProducer(
        sampler,
        generate,
        num_steps_async=cfg.grpo.num_steps_async,
        max_staleness=cfg.grpo.max_staleness,
        seed=cfg.trainer.seed,
        threaded=threaded,
        snapshot_fn=(lambda: weights_snapshot(model)) if threaded else None,
        timeout_s=float(cfg.trainer.timeout_s),
        group_filter=build_group_filter(cfg, schedule, ps.dp_rank),
    )
    layout = ps.sizes()
    trainable, total = count_parameters(model)
    if ps.rank == 0:
        log.info(
            "trainable parameters: %s of %s (%.2f%%)%s",
            f"{trainable:,}",
            f"{total:,}",
            100.0 * trainable / max(total, 1),
            f", LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.rank > 0 else "",
        )
    return Components(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        producer=producer,
        train_step=make_train_step(
            cfg, model, optimizer, scheduler, ps, {"trainable_params": trainable}
        ),
        dist=WorldDist(),
        aggregator=aggregator,
        export_hf=lambda path: hf.export_hf(model, cfg.model, path),
        meta={
            "parallel": layout,
            "rank_coords": _rank_coords(ps),
            "config": _config_of(cfg),
            "teacher": read_identity(cfg.run_dir) if distill_on(cfg) and cfg.run_dir else None,
            "trainable_parameters": trainable,
            "total_parameters": total,
        },
        evaluate=_evaluate_fn(cfg, model, tokenizer, ps),
        release_rollout=_release_fn(cfg),
    )


def _release_fn(cfg: RunConfig) -> Any:
    """What gives the rollout engine's memory back between rounds (rollout.vllm.sleep)."""
    if RolloutBackend(cfg.rollout.backend) != RolloutBackend.vllm or not cfg.rollout.vllm.sleep:
        return None
    from rlbatch.rollout.protocol import release_synced_engines

    return release_synced_engines


def build_group_filter(cfg: RunConfig, schedule: Any, dp_rank: int) -> Any:
    """Dynamic sampling's filler (grpo.filter_groups), or None."""
    if FilterGroups(cfg.grpo.filter_groups) == FilterGroups.none:
        return None
    from rlbatch import distributed
    from rlbatch.grpo.stages import SERVED_FAILED
    from rlbatch.train.filtering import GroupFilter

    return GroupFilter(
        num_generations=schedule.num_generations,
        needed=schedule.prompts_per_round,
        max_rounds=cfg.grpo.max_generation_rounds,
        dp_rank=dp_rank,
        gather=distributed.dp_gather_object,
        failed=lambda s: bool(s.metrics.get(SERVED_FAILED)),
    )


def _evaluate_fn(cfg: RunConfig, model: list[Any], tokenizer: Any, ps: Any):
    """The loop's evaluate(step) on the policy's own chunks (None: eval.every_steps = 0)."""
    from rlbatch.eval.settings import eval_enabled

    if not eval_enabled(cfg):
        return None
    from rlbatch.eval.runner import make_evaluate_fn

    return make_evaluate_fn(cfg, model, tokenizer, ps.dp_rank, ps.dp, ps.rank)


def _config_of(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data, for meta.json (the driver's resume check)."""
    from rlbatch.config.load import to_container

    return to_container(cfg)


def _rank_coords(ps: Any) -> list[dict[str, int]]:
    """(tp, pp, dp, cp) rank of every global rank, for meta.json."""
    from rlbatch.distributed import all_gather_object

    mine = {"rank": ps.rank, "tp": ps.tp_rank, "pp": ps.pp_rank, "dp": ps.dp_rank, "cp": ps.cp_rank}
    return all_gather_object(mine)
