"""What the training loop drives (:class:`Components`, built by rlbatch.train.build for real runs,
small torch fakes in the loop's tests) and the collectives it needs (:class:`DistOps`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlbatch.distributed import local_peak_memory_gb, reset_peak_memory
from rlbatch.train.producer import RunAheadProducer, StepBatch

TrainStepFn = Callable[[StepBatch, int, bool], dict[str, Any]]
"""(batch, 1-based step, inject_nan) -> metrics of one optimizer step, identical on all ranks
(loss, grad_norm, kl, clip_fraction, entropy, padding_efficiency, dp_imbalance, ...)."""


class DistOps(Protocol):
    """What the loop needs from rlbatch.distributed (the only module that reduces)."""

    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum over the DP group, one bundled collective."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """One object per global rank."""
        ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory_gb(self) -> float:
        """The largest peak memory of any rank since the last reset (GiB)."""
        ...


@dataclass
class LocalDist:
    """DistOps of a single process."""

    rank: int = 0
    world_size: int = 1

    def barrier(self) -> None:
        return None

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def reset_peak_memory(self) -> None:
        reset_peak_memory()

    def peak_memory_gb(self) -> float:
        return local_peak_memory_gb()


@dataclass
class Components:
    """Everything the loop drives; built by rlbatch.train.build for real runs."""

    model: list[Any]
    """Model chunks (one per virtual pipeline stage)."""
    optimizer: Any
    scheduler: Any
    producer: RunAheadProducer
    train_step: TrainStepFn
    dist: DistOps = field(default_factory=LocalDist)
    aggregator: Any = None
    """Object with state_dict/load_state_dict (pending LCM buffers), or None."""
    planner: Any = None
    """Object with state_dict/load_state_dict (pool batcher), or None."""
    export_hf: Callable[[Path], None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    """Written to each checkpoint's meta.json (parallel layout, ranks' coordinates)."""
    evaluate: Callable[[int], dict[str, Any]] | None = None
    """evaluate(step) -> eval/* metrics, the same on every rank (rlbatch.eval.runner); None
    when eval.every_steps is 0."""
    release_rollout: Callable[[], None] | None = None
    """Called when a generation round (or an evaluation) is done and training comes next: the
    rollout engine gives its memory back (rollout.vllm.sleep); None = nothing to release."""
