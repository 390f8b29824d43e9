"""The training half of one GRPO optimizer step, read as the algorithm.

    gather the mini-batch -> plan the train pass -> run it (GRPO loss, normalization) ->
    finalize grads -> one bundled reduction (+ deferred correction) -> NaN check ->
    clip + optimizer step -> LR schedule -> metrics

The rollout / LCM side produces the Samples (tokens, behaviour / old / ref logps, advantages);
the training loop calls :func:`run_train_step` once per optimizer step. Megatron is reached only
through :mod:`rlbatch.engine` and reductions only through :mod:`rlbatch.distributed`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlbatch.batching.plan import MicroBatch, PassPlan, RankPlan
from rlbatch.config.schema import RunConfig
from rlbatch.grpo.balance import LoadBalance
from rlbatch.grpo.lcm import behaviour_weighted, old_from_forward
from rlbatch.grpo.loss import GRPOBatch, LossSettings, build_grpo_batch, grpo_loss
from rlbatch.grpo.normalization import (
    MegatronScaling,
    Normalizer,
    ReduceFn,
    StepResult,
    build_normalizer,
    identity_reduce,
    scale_gradients,
)
from rlbatch.grpo.types import Sample, trained_samples
from rlbatch.layout import ParallelLayout


@dataclass
class Reducers:
    """The step's reductions, from rlbatch.distributed (identity on one process).

    reduce_dp: sum of a float64 vector over DP x CP (per_micro_batch counts, eager divisor).
    reduce_step: the same, and over the pipeline stages, the result on every stage (the
        end-of-step bundle; a stage before the last adds only what it computes itself).
    gather_samples: every DP replica's samples, in DP-rank order.
    reduce_max: the largest of a float over every rank (all stages and replicas).
    """

    reduce_dp: ReduceFn = identity_reduce
    reduce_step: ReduceFn = identity_reduce
    gather_samples: Callable[[list[Sample]], list[list[Sample]]] = lambda s: [s]
    reduce_max: Callable[[float], float] = lambda x: x

    @classmethod
    def from_distributed(cls) -> Reducers:
        """The real ones (rlbatch.distributed: Megatron's DP x CP group, last-stage broadcast)."""
        from rlbatch import distributed

        return cls(
            reduce_dp=distributed.reduce_dp,
            reduce_step=distributed.reduce_step,
            gather_samples=distributed.dp_gather_object,
            reduce_max=distributed.reduce_max,
        )


@dataclass
class StepState:
    """What the loss function records while the schedule runs."""

    finite: list[torch.Tensor] = field(default_factory=list)
    """Per micro-batch (debug.detect_nan): a 0-d bool on the device, read once at the end."""
    micro_batches: int = 0
    weight_max: list[torch.Tensor] = field(default_factory=list)
    """Per micro-batch with off-policy samples: the largest raw pi_old / pi_behaviour."""

    def first_nonfinite(self) -> Optional[int]:
        """Index of the first micro-batch whose loss was NaN/inf (one host sync)."""
        if not self.finite:
            return None
        bad = (~torch.stack(self.finite)).nonzero()
        return int(bad[0, 0]) if bad.numel() else None

    def importance_weight_max(self, reduce_max: Callable[[float], float], stale: bool) -> float:
        """The largest raw behaviour importance weight of the step over every rank (one host
        sync, one collective, when the run is off-policy: ``stale``, the same on every rank);
        1.0 without off-policy samples anywhere."""
        if not stale:
            return 1.0
        local = float(torch.stack(self.weight_max).max()) if self.weight_max else -math.inf
        best = reduce_max(local)
        return 1.0 if best == -math.inf else best


# ------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------


def gather_mini_batch(samples: list[Sample], reducers: Reducers) -> list[Sample]:
    """The global mini-batch (every DP replica's share, in DP-rank order): every rank plans
    the same global pass from the same global lengths (docs/interfaces.md)."""
    shares = reducers.gather_samples(samples)
    return [s for share in shares for s in share]


def plan_train_pass(
    cfg: RunConfig, samples: Sequence[Sample], layout: ParallelLayout, step: int
) -> PassPlan:
    """The train pass over the mini-batch: cfg.batching.train, the model's cost model, and the
    dp / pp / vpp layout (megatron's interleaving rule on the micro-batch count)."""
    from rlbatch.batching import planner
    from rlbatch.batching.cost import cost_model_for

    train = cfg.batching.train
    return planner.plan_pass(
        [s.length for s in samples],
        train,
        dp=layout.dp,
        pp=layout.pp,
        vpp=layout.vpp,
        microbatch_group_size=cfg.parallel.microbatch_group_size_per_vp_stage,
        group_size=cfg.grpo.num_generations,
        cost=cost_model_for(cfg.model, train),
        seed=cfg.trainer.seed,
        step=step,
    )


def make_prepare(
    cfg: RunConfig,
    samples: Sequence[Sample],
    rank_plan: RankPlan,
) -> Callable[[int], GRPOBatch]:
    """prepare(i): the GRPO fields and tokens of this rank's i-th micro-batch (called lazily,
    once per micro-batch, by the normalizer's iterator). An MoE policy's micro-batch also gets
    its samples' routing laid out for it (:func:`attach_routing`)."""
    round_to = cfg.batching.train.sequence_length_round
    device = _device()
    with_behaviour = old_from_forward(cfg)
    moe = cfg.model.num_moe_experts is not None

    def prepare(i: int) -> GRPOBatch:
        mb: MicroBatch = rank_plan.micro_batches[i]
        batch, tokens = build_grpo_batch(
            [samples[j] for j in mb.samples],
            mb,
            round_to=round_to,
            mask_truncated=cfg.grpo.mask_truncated_completions,
            with_behaviour=with_behaviour,
        )
        batch.tokens, batch.micro_batch = tokens, mb
        batch = batch.to(device)
        if moe:
            attach_routing(cfg, batch, [samples[j] for j in mb.samples], round_to)
        return batch

    return prepare


def attach_routing(
    cfg: RunConfig, batch: GRPOBatch, samples: Sequence[Sample], round_to: int
) -> None:
    """The micro-batch's MoE routing in megatron's token order (rlbatch.engine.routing):
    ``rollout_routing`` (what ``moe/routing_mismatch`` compares the routers' own choice with)
    and ``replay_routing`` (what the forward and backward replay: the rollout's under r3, the
    old-logprob pass's under r2, none under none)."""
    from rlbatch.config.enums import RoutingReplay
    from rlbatch.config.moe import num_moe_layers
    from rlbatch.engine import routing, schedule

    mb = batch.micro_batch
    assert mb is not None
    segs = schedule.segments(mb, round_to)
    shape = (
        max(1, mb.num_rows),
        mb.padded_len,
        num_moe_layers(cfg.model),
        cfg.model.moe_router_topk,
    )

    def laid_out(arrays: list[Any]) -> Optional[torch.Tensor]:
        if all(a is None for a in arrays):
            return None
        return routing.micro_batch_routing(arrays, segs, *shape)

    rollout = laid_out([s.routing for s in samples])
    mode = RoutingReplay(cfg.grpo.routing_replay)
    batch.rollout_routing = rollout  # type: ignore[attr-defined]
    batch.replay_routing = (  # type: ignore[attr-defined]
        rollout
        if mode == RoutingReplay.r3
        else laid_out([s.old_routing for s in samples])
        if mode == RoutingReplay.r2
        else None
    )
    if mode != RoutingReplay.none and batch.replay_routing is None and samples:  # type: ignore[attr-defined]
        raise RuntimeError(
            f"grpo.routing_replay={mode.value}: a training micro-batch has no recorded routing"
        )


class RoutingMismatch:
    """What the training forward's routers did, counted per step: ``moe/routing_mismatch``
    (per MoE layer, the tokens with rollout routing and those whose expert set the routers
    chose differently, before any replay) and, with a capacity factor (``count_drops``; it
    needs tensor parallelism 1, so each rank counts its own tokens), the token-to-expert
    assignments of real tokens (padding excluded) and how many of them the capacity dropped."""

    def __init__(self, num_layers: int, topk: int, count_drops: bool = False) -> None:
        self.counts = torch.zeros(2, num_layers, dtype=torch.float64)
        self.drops = torch.zeros(2, dtype=torch.float64)
        self.topk, self.count_drops = topk, count_drops

    def sink(self, chunk: Any, natural: dict, inputs: Any) -> None:
        from rlbatch.engine import routing

        if self.count_drops:
            self.drops += routing.drop_counts(chunk, inputs, self.topk)
        rollout = getattr(inputs.payload, "rollout_routing", None)
        if rollout is None or not natural:
            return
        local = routing.local_routing(chunk, rollout)
        self.counts += routing.mismatch_counts(natural, local, self.counts.shape[1])

    def take(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def take_drops(self) -> torch.Tensor:
        drops, self.drops = self.drops, torch.zeros_like(self.drops)
        return drops


def _current_layout() -> ParallelLayout:
    """The engine's (megatron's) layout of this process; a single process without it."""
    from rlbatch.engine import parallel

    return parallel.current_layout()


def _device() -> torch.device:
    """The engine's device (cuda:<local_rank> on GPU, else cpu)."""
    from rlbatch.engine import parallel

    return parallel.device() if parallel.is_initialized() else torch.device("cpu")


def make_loss_fn(
    settings: LossSettings,
    normalizer: Normalizer,
    state: StepState,
    *,
    detect_nan: bool,
    inject_nan: bool = False,
    balance: Optional[Callable[[GRPOBatch], Optional[torch.Tensor]]] = None,
) -> Callable[[Any, GRPOBatch], tuple[torch.Tensor, torch.Tensor, dict]]:
    """Megatron's loss_func contract: (loss to back-propagate, count for Megatron, metrics).
    The first argument is the last stage's output (rlbatch.engine.lm_head.LMOutput).
    ``balance(batch)``: an MoE policy's per-sample load-balancing loss of the micro-batch the
    loss chunk just ran (rlbatch.grpo.balance.LoadBalance.for_loss)."""

    def loss_fn(output: Any, batch: GRPOBatch):
        aux = balance(batch) if balance is not None else None
        terms = grpo_loss(output, batch, settings, aux=aux)
        if inject_nan and state.micro_batches == 0:  # debug.fail_kind=nan_loss
            terms.numerator = terms.numerator * float("nan")
        if detect_nan:  # no host sync here: flags are read once, after the schedule
            state.finite.append(torch.isfinite(terms.numerator.detach()))
        state.micro_batches += 1
        if terms.weight_max is not None:
            state.weight_max.append(terms.weight_max)
        loss = normalizer.loss_for_backward(terms, batch)
        return loss, normalizer.scaling.count_for_megatron(), {}

    return loss_fn


def run_train_pass(
    model: list[Any],
    plan: PassPlan,
    layout: ParallelLayout,
    prepare: Callable[[int], GRPOBatch],
    normalizer: Normalizer,
    loss_fn: Callable,
    round_to: int,
    routing_sink: Optional[Callable] = None,
    stage_loss: Optional[Callable] = None,
) -> None:
    """Forward/backward over this rank's micro-batches through the engine's schedule (which
    zeroes the grad buffers first and runs finalize_model_grads after the last backward); the
    data iterator is the normalizer's (lazy in the lazy modes)."""
    from rlbatch.engine import schedule

    rank_plan = plan.for_rank(layout.dp_rank)
    batches = normalizer.iterate(prepare, plan.num_micro_batches)
    schedule.run_grpo_pass(
        model,
        rank_plan,
        plan,
        batches,
        loss_fn,
        round_to=round_to,
        routing_sink=routing_sink,
        stage_loss=stage_loss,
    )


def finish_gradients(
    model: list[Any], normalizer: Normalizer, state: StepState, layout: ParallelLayout
) -> tuple[StepResult, Optional[str]]:
    """After the schedule (grads already DP-reduced by finalize_model_grads): the ONE bundled
    reduction -> D, metrics and non-finite-loss flags; the deferred correction c/D BEFORE
    clipping and the grad-norm metric. Returns the result and where a loss was non-finite."""
    bad = state.first_nonfinite()
    # [ranks with a bad micro-batch, rank * 1e6 + its first bad micro-batch] (exact in float64)
    normalizer.extra_sums = [0.0, 0.0] if bad is None else [1.0, layout.rank * 1e6 + bad]
    result = normalizer.finish()
    bad_ranks, code = result.extra
    where = None
    if bad_ranks == 1:
        where = f"micro-batch {int(code) % 1_000_000} on rank {int(code) // 1_000_000}"
    elif bad_ranks > 1:
        where = f"micro-batches on {int(bad_ranks)} ranks"
    scale_gradients(model, result.grad_multiplier)
    return result, where


def optimizer_step(
    optimizer: Any, scheduler: Any, *, clip_grad: float, check_finite: bool
) -> tuple[float, float, bool]:
    """Clip (inside the Megatron optimizer, on the corrected grads) + step + LR schedule.

    Returns (grad_norm before clipping, learning rate used, stepped). With ``check_finite`` (or
    no clipping, where Megatron computes no norm) the norm is computed first with Megatron's
    model-parallel-aware ``get_grad_norm`` (every stage's grads); a NaN/inf norm skips the update.
    """
    lr = float(optimizer.param_groups[0]["lr"]) if hasattr(optimizer, "param_groups") else math.nan
    norm = None
    if (check_finite or clip_grad <= 0) and hasattr(optimizer, "get_grad_norm"):
        optimizer.prepare_grads()  # main_grad -> grad, what get_grad_norm reads
        norm = float(optimizer.get_grad_norm())
        if check_finite and not math.isfinite(norm):
            optimizer.zero_grad()
            return norm, lr, False
    out = optimizer.step()
    stepped_norm = out[1] if isinstance(out, tuple) else out
    if stepped_norm is not None:
        norm = float(stepped_norm)
    if scheduler is not None:
        scheduler.step(increment=1) if _takes_increment(scheduler) else scheduler.step()
    return (norm if norm is not None else math.nan), lr, True


def _takes_increment(scheduler: Any) -> bool:
    import inspect

    return "increment" in inspect.signature(scheduler.step).parameters


def step_metrics(
    result: StepResult, plan: PassPlan, grad_norm: float, lr: float, seconds: float
) -> dict[str, Any]:
    """The step's metrics (identical on all ranks)."""
    m = dict(result.metrics)
    stats = plan.stats
    m.update(
        grad_norm=grad_norm,
        lr=lr,
        num_micro_batches=plan.num_micro_batches,
        padding_efficiency=stats.padding_efficiency,
        dp_imbalance=stats.cost_imbalance,
        token_imbalance=stats.token_imbalance,
        plan_lower_bound=stats.lower_bound,
        train_seconds=seconds,
        train_tokens_per_s=m["tokens"] / seconds if seconds > 0 else 0.0,
    )
    return m


# ------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------


def run_train_step(
    cfg: RunConfig,
    model: list[Any],
    optimizer: Any,
    scheduler: Any,
    samples: list[Sample],
    *,
    step: int,
    layout: Optional[ParallelLayout] = None,
    reducers: Optional[Reducers] = None,
    inject_nan: bool = False,
    plan_sink: Optional[Callable[[list[int], PassPlan], None]] = None,
    routing_mismatch: Optional[RoutingMismatch] = None,
) -> dict[str, Any]:
    """One GRPO optimizer step on this rank's share of the mini-batch (``samples``: one per
    episode; a split agent episode trains each of its segments: rlbatch.grpo.types.trained_samples,
    after the gather, so every rank plans the same global list); returns metrics that
    are identical on every rank. A non-finite loss or gradient (debug.detect_nan) skips the
    update and reports ``nonfinite_micro_batch`` / NaN loss and grad_norm. ``plan_sink(lengths,
    plan)`` receives the mini-batch's lengths and the train pass's plan (logging.plans);
    ``routing_mismatch`` (MoE) counts the tokens whose routing moved since the rollout."""
    started = time.perf_counter()
    # Megatron's optimizer leaves param.grad aliased to main_grad after step(); without clearing
    # it, the next backward adds the first micro-batch's gradient twice (Megatron's own
    # train_step calls optimizer.zero_grad() before its schedule too).
    optimizer.zero_grad()
    layout = layout or _current_layout()
    reducers = reducers or Reducers.from_distributed()
    mini_batch = trained_samples(gather_mini_batch(samples, reducers))
    plan = plan_train_pass(cfg, mini_batch, layout, step)
    if plan_sink is not None:
        plan_sink([s.length for s in mini_batch], plan)
    result, nonfinite, state = _accumulate_gradients(
        cfg, model, mini_batch, plan, layout, reducers, inject_nan, routing_mismatch
    )
    if nonfinite is not None and cfg.debug.detect_nan:
        optimizer.zero_grad()
        metrics = step_metrics(result, plan, math.nan, math.nan, time.perf_counter() - started)
        metrics.update(loss=math.nan, nonfinite_micro_batch=nonfinite)
        return metrics
    grad_norm, lr, stepped = optimizer_step(
        optimizer,
        scheduler,
        clip_grad=cfg.trainer.optim.clip_grad,
        check_finite=cfg.debug.detect_nan,
    )
    metrics = step_metrics(result, plan, grad_norm, lr, time.perf_counter() - started)
    metrics["is_weight_max"] = state.importance_weight_max(
        reducers.reduce_max, behaviour_weighted(cfg)
    )
    if not stepped:
        metrics["nonfinite_micro_batch"] = f"gradients (grad norm {grad_norm})"
    return metrics


def _accumulate_gradients(
    cfg: RunConfig,
    model: list[Any],
    mini_batch: list[Sample],
    plan: PassPlan,
    layout: ParallelLayout,
    reducers: Reducers,
    inject_nan: bool,
    routing_mismatch: Optional[RoutingMismatch],
) -> tuple[StepResult, Optional[str], StepState]:
    """The train pass over ``plan``: every micro-batch's normalized loss backward, then the
    gradients finished (the normalizer's cancellation, the DP reduction); returns the step's
    result, the first non-finite micro-batch (or None) and the loss's state."""
    settings = LossSettings.from_config(cfg)
    normalizer = build_normalizer(
        cfg,
        settings,
        megatron_scaling(model, plan, layout),
        reduce_dp=reducers.reduce_dp,
        reduce_step=reducers.reduce_step,
        device=_device(),
    )
    state = StepState()
    balance = LoadBalance.build(cfg, model)  # an MoE policy's, on every stage
    loss_fn = make_loss_fn(
        settings,
        normalizer,
        state,
        detect_nan=cfg.debug.detect_nan,
        inject_nan=inject_nan,
        balance=None if balance is None else balance.for_loss,
    )
    if cfg.model.num_moe_experts is not None:  # the routers' logits and routing maps
        from rlbatch.engine import routing

        routing.attach(model)
        routing.capturing(model, True)  # until the pass ends (schedule.run_pass clears it)
    run_train_pass(
        model,
        plan,
        layout,
        make_prepare(cfg, mini_batch, plan.for_rank(layout.dp_rank)),
        normalizer,
        loss_fn,
        cfg.batching.train.sequence_length_round,
        routing_sink=None if routing_mismatch is None else routing_mismatch.sink,
        stage_loss=None if balance is None else balance.for_stage(settings, normalizer),
    )
    result, nonfinite = finish_gradients(model, normalizer, state, layout)
    return result, nonfinite, state


def megatron_scaling(model: list[Any], plan: PassPlan, layout: ParallelLayout) -> MegatronScaling:
    """What Megatron's schedule and DDP will do to each micro-batch's loss (cancelled by the
    normalizer): read from the model's TransformerConfig."""
    config = getattr(model[0], "config", None)
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    return MegatronScaling(per_token, plan.num_micro_batches, dp_cp_size=layout.dp * layout.cp)
