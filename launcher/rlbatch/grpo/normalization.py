"""Loss normalization across micro-batches and DP ranks (docs/normalization.md; the problem is Fast-LLM issue #510).

Three modes, all built on the loss's (numerator, local count) pair (:mod:`rlbatch.grpo.loss`):

- ``eager_global``: prepare every micro-batch of the step first, all-reduce the summed count
  over DP -> D, and scale each numerator by 1/D inside the loss. Exact, not lazy.
- ``per_micro_batch`` (Fast-LLM #510's option B): lazy; micro-batch i is scaled by
  1 / (DP-sum of its own count x M). Exact across DP; across micro-batches exact only when
  every micro-batch has the same count, per-micro-batch weighted otherwise (biased).
- ``deferred_global`` (Option A): lazy; every micro-batch is scaled by the same constant 1/c
  known before any data; at the end of the step ONE bundled all-reduce of the counts and all
  metric sums gives D; gradients are multiplied by c/D before clipping and the grad-norm
  metric. Exact.

Megatron's own scaling is cancelled: with ``calculate_per_token_loss=False`` the schedule
divides each loss by num_microbatches and DDP averages over the DP x CP group; with ``True``
neither happens (and the count this module hands Megatron is 0, so ``finalize_model_grads``
never rescales). :class:`MegatronScaling` is that factor; each loss is divided by it.

Nothing here talks to torch.distributed: the two reductions are passed in (``reduce_dp``:
sum over DP x CP of a float64 vector; ``reduce_step``: the same summed over the pipeline
stages too, with the result on every stage), built by :mod:`rlbatch.grpo.step` from :mod:`rlbatch.distributed`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlbatch.config.schema import BatchingMode, NormalizationMode, RunConfig
from rlbatch.grpo.loss import (
    STAT_KEYS,
    GRPOBatch,
    LossSettings,
    LossTerms,
    divisor_count,
    summarize_stats,
)

ReduceFn = Callable[[torch.Tensor], torch.Tensor]
"""Sum of a 1-D float64 tensor over the data-parallel replicas (returns a new tensor)."""

LAZY_MODES = frozenset({NormalizationMode.per_micro_batch, NormalizationMode.deferred_global})


def identity_reduce(x: torch.Tensor) -> torch.Tensor:
    """The reduction of a single replica (dp == 1, pp == 1)."""
    return x.clone()


@dataclass(frozen=True)
class MegatronScaling:
    """The factor Megatron's schedule and DDP multiply each micro-batch's loss gradient by."""

    calculate_per_token_loss: bool
    num_micro_batches: int
    dp_cp_size: int = 1

    @property
    def factor(self) -> float:
        if self.calculate_per_token_loss:
            return 1.0  # 3-tuple loss: no 1/M in the schedule; DDP sums
        return 1.0 / (self.num_micro_batches * self.dp_cp_size)

    @property
    def stage_factor(self) -> float:
        """The factor for a term back-propagated from a chunk that computes no loss (a pipeline
        stage before the last): DDP's averaging applies to it, the schedule's division by
        num_microbatches (which acts on the loss only) does not."""
        return 1.0 if self.calculate_per_token_loss else 1.0 / self.dp_cp_size

    def count_for_megatron(self) -> torch.Tensor:
        """The middle element of the 3-tuple loss_func return (int tensor).

        per-token mode: 0, so finalize_model_grads skips its own 1/num_tokens scaling
        (``if num_tokens > 0``); otherwise 1, so the schedule's division by it is a no-op.
        """
        return torch.tensor(0 if self.calculate_per_token_loss else 1, dtype=torch.int)


def default_constant(cfg: RunConfig, settings: LossSettings) -> float:
    """deferred_global's c: normalization.constant, or a budget known before any data."""
    if cfg.normalization.constant is not None:
        return float(cfg.normalization.constant)
    train = cfg.batching.train
    if settings.token_level:
        return float(train.max_tokens)
    if BatchingMode(train.mode) == BatchingMode.fixed:
        return float(train.micro_batch_size)
    # the most sequences a micro-batch can hold: each takes at least `round` tokens
    return float(max(1, train.max_tokens // max(1, train.sequence_length_round)))


# ------------------------------------------------------------------------------------------
# Per-step state
# ------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """What the end of a step's normalization reports."""

    divisor: float
    """Global D: tokens or sequences of the whole step (all micro-batches, all DP ranks)."""
    grad_multiplier: float
    """Applied to the gradients before clipping (c / D for deferred_global, else 1)."""
    metrics: dict[str, float]
    extra: list[float] = field(default_factory=list)
    """The reduced ``Normalizer.extra_sums`` (flags the step adds to the same bundle)."""


def _inverse(x: torch.Tensor) -> torch.Tensor:
    """1 / x, and 0 where x == 0 (an all-filler micro-batch or step carries no loss)."""
    return torch.where(x > 0, 1.0 / x.clamp(min=1e-300), torch.zeros_like(x))


@dataclass
class Normalizer:
    """One step's normalization: scales each micro-batch's loss, then finishes the step.

    Use: ``for batch in normalizer.iterate(prepare, M)`` feeds the schedule (lazy in the lazy
    modes); the Megatron loss function calls :meth:`loss_for_backward`; after the schedule,
    :meth:`finish` does the one bundled reduction and returns the gradient multiplier.
    Accumulators stay on the loss's device: nothing synchronizes with the host before finish.
    """

    mode: NormalizationMode
    settings: LossSettings
    scaling: MegatronScaling
    constant: float = 1.0
    reduce_dp: ReduceFn = identity_reduce
    reduce_step: ReduceFn = identity_reduce
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_prepared: int = 0
    """Micro-batches prepared so far (the lazy-preparation test reads it)."""
    extra_sums: list[float] = field(default_factory=list)
    """More local values summed in the same bundle (e.g. non-finite flags); set before finish."""
    _eager_divisor: Optional[torch.Tensor] = None
    _mb_counts: list[torch.Tensor] = field(default_factory=list)
    """per_micro_batch: the DP-summed count of each micro-batch (for the bias report)."""
    _sums: Optional[torch.Tensor] = None
    """[3 + len(STAT_KEYS)] float64: numerator, count, optimized loss, stats."""

    # ---- data side ------------------------------------------------------------------------

    def iterate(
        self, prepare: Callable[[int], GRPOBatch], num_micro_batches: int
    ) -> Iterator[GRPOBatch]:
        """Yield the step's micro-batches with ``loss_scale`` set.

        eager_global prepares all M first (one DP all-reduce of the summed count); the lazy
        modes prepare exactly one micro-batch per yield.
        """
        if self.mode == NormalizationMode.eager_global:
            return iter(self._eager(prepare, num_micro_batches))
        return self._lazy(prepare, num_micro_batches)

    def _prepare(self, prepare: Callable[[int], GRPOBatch], index: int) -> GRPOBatch:
        batch = prepare(index)
        batch.index = index
        self.num_prepared += 1
        return batch

    def _count(self, batch: GRPOBatch) -> torch.Tensor:
        return divisor_count(batch, self.settings).to(self.device).reshape(1)

    def _eager(self, prepare: Callable[[int], GRPOBatch], m: int) -> list[GRPOBatch]:
        batches = [self._prepare(prepare, i) for i in range(m)]
        zero = torch.zeros(1, dtype=torch.float64, device=self.device)
        local = sum((self._count(b) for b in batches), zero)
        total = self.reduce_dp(local.to(self.device))[0]
        self._eager_divisor = total
        for b in batches:
            b.loss_scale = _inverse(total)
        return batches

    def _lazy(self, prepare: Callable[[int], GRPOBatch], m: int) -> Iterator[GRPOBatch]:
        for i in range(m):
            batch = self._prepare(prepare, i)
            if self.mode == NormalizationMode.per_micro_batch:
                dp_count = self.reduce_dp(self._count(batch))[0]  # one scalar over DP only
                self._mb_counts.append(dp_count)
                batch.loss_scale = _inverse(dp_count * m)
            else:
                batch.loss_scale = 1.0 / self.constant
            yield batch

    # ---- loss side ------------------------------------------------------------------------

    def loss_for_backward(self, terms: LossTerms, batch: GRPOBatch) -> torch.Tensor:
        """The scalar Megatron back-propagates: numerator x loss_scale / Megatron's factor.
        Also records the micro-batch's local sums for :meth:`finish`."""
        numerator = terms.numerator.detach().to(torch.float64)
        scale = torch.as_tensor(batch.loss_scale, dtype=torch.float64, device=numerator.device)
        row = torch.cat([torch.stack([numerator, terms.count, numerator * scale]), terms.stats])
        self._sums = row if self._sums is None else self._sums + row.to(self._sums.device)
        loss_scale = scale.to(terms.numerator.dtype) / self.scaling.factor
        return terms.numerator * loss_scale

    def stage_loss_for_backward(
        self, numerator: torch.Tensor, batch: GRPOBatch, stats: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """A term of the loss computed on a chunk that computes no loss (an MoE policy's
        load-balancing loss of an earlier pipeline stage's routers), aggregated like the loss's
        numerator: scaled as :meth:`loss_for_backward` scales the loss (so its gradient is the
        one the same term gets on the loss's stage), for :func:`rlbatch.engine.schedule.
        attach_loss`. The numerator and ``stats`` (its metric sums, ``STAT_KEYS`` names) join
        this stage's share of the step's bundle, which :meth:`finish` sums over the pipeline
        stages: the step's loss is the whole objective's (its count is the loss stage's)."""
        value = numerator.detach().to(torch.float64).to(self.device)
        scale = torch.as_tensor(batch.loss_scale, dtype=torch.float64, device=self.device)
        row = torch.zeros(3 + len(STAT_KEYS), dtype=torch.float64, device=self.device)
        row[0], row[2] = value, value * scale
        for key, stat in stats.items():
            row[3 + STAT_KEYS.index(key)] = stat.detach().to(torch.float64).to(self.device)
        self._sums = row if self._sums is None else self._sums + row.to(self._sums.device)
        return numerator * scale.to(numerator.dtype) / self.scaling.stage_factor

    # ---- end of step ----------------------------------------------------------------------

    def finish(self) -> StepResult:
        """ONE bundled reduction of [numerator, count, optimized, stats...] -> D, metrics and
        the gradient multiplier (c / D for deferred_global)."""
        local = self._sums
        if local is None:  # a rank (or pipeline stage) that computed no loss
            local = torch.zeros(3 + len(STAT_KEYS), dtype=torch.float64, device=self.device)
        extra = torch.tensor(self.extra_sums, dtype=torch.float64, device=self.device)
        total = self.reduce_step(torch.cat([local.to(self.device), extra])).cpu()
        n_extra = len(self.extra_sums)
        extra_out = [float(v) for v in total[len(total) - n_extra :]] if n_extra else []
        total = total[: len(total) - n_extra]
        numerator, divisor, optimized = (float(v) for v in total[:3])
        if self._eager_divisor is not None and float(self._eager_divisor) != divisor:
            if self._sums is not None:  # stages without a loss only know the eager value
                raise AssertionError(
                    f"eager divisor {float(self._eager_divisor)} != loss-side count {divisor}"
                )
        multiplier = 1.0
        if self.mode == NormalizationMode.deferred_global:
            multiplier = self.constant / divisor if divisor > 0 else 0.0
        metrics = summarize_stats(total[3:], numerator, divisor)
        metrics["loss_optimized"] = optimized * multiplier
        metrics["divisor"] = divisor
        metrics["grad_multiplier"] = multiplier
        counts = [float(c) for c in self._mb_counts if float(c) > 0]
        if counts and divisor > 0:  # per_micro_batch: weight relative to exact, D / (M c_i)
            m = len(self._mb_counts)
            metrics["pmb_weight_min"] = divisor / (m * max(counts))
            metrics["pmb_weight_max"] = divisor / (m * min(counts))
        return StepResult(divisor, multiplier, metrics, extra_out)


def build_normalizer(
    cfg: RunConfig,
    settings: LossSettings,
    scaling: MegatronScaling,
    *,
    reduce_dp: ReduceFn = identity_reduce,
    reduce_step: ReduceFn = identity_reduce,
    device: Optional[torch.device] = None,
) -> Normalizer:
    """The step's normalizer from the config (mode, deferred constant)."""
    device = device or torch.device("cpu")
    mode = NormalizationMode(cfg.normalization.mode)
    return Normalizer(
        device=device,
        mode=mode,
        settings=settings,
        scaling=scaling,
        constant=default_constant(cfg, settings),
        reduce_dp=reduce_dp,
        reduce_step=reduce_step,
    )


def scale_gradients(model_chunks: Iterable[Any], multiplier: float) -> None:
    """Multiply every gradient by ``multiplier`` (Megatron DDP: its main-grad buffers)."""
    if multiplier == 1.0:
        return
    for chunk in model_chunks:
        if hasattr(chunk, "scale_gradients"):
            chunk.scale_gradients(multiplier)
            continue
        for p in chunk.parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is not None:
                grad.mul_(multiplier)


def micro_batch_bias(counts: list[float], sums: list[float]) -> dict[str, float]:
    """per_micro_batch vs exact value for given per-micro-batch counts and numerator sums
    (DP already summed): the relative deviation of the loss (docs/normalization.md)."""
    m = len(counts)
    exact = sum(sums) / sum(counts)
    per_mb = sum(s / (c * m) for s, c in zip(sums, counts, strict=True) if c > 0)
    rel = abs(per_mb - exact) / abs(exact) if exact != 0 else math.inf
    return {"exact": exact, "per_micro_batch": per_mb, "rel_deviation": rel}
