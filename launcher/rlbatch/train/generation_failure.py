"""A rollout server failing during a step's generation (rollout.backend=vllm_server, the one
backend whose generation can be unavailable: RolloutUnavailableError).

Before each step the loop keeps the last completed step's state (:func:`unsaved_state`) when
no checkpoint holds it yet; the step's generation outcome is agreed on by every rank
(:func:`agreed_batch`), so a failure on one rank stops all of them together, each saving the
kept state, if any, before the error is raised (trainer.resume=auto continues from it).
"""

from __future__ import annotations

from typing import Any

from rlbatch.config.schema import RolloutBackend, RunConfig
from rlbatch.rollout.protocol import RolloutUnavailableError
from rlbatch.train.checkpoint import TrainState, capture_train_state
from rlbatch.train.producer import RunAheadProducer, StepBatch


def on_servers(cfg: RunConfig) -> bool:
    """Generation runs on rollout servers, which can be down (RolloutUnavailableError): only
    then does each step keep the last completed step's state and agree on the outcome."""
    return RolloutBackend(cfg.rollout.backend) == RolloutBackend.vllm_server


def unsaved_state(
    producer: RunAheadProducer, planner: Any, aggregator: Any, step: int, last_saved: int
) -> TrainState | None:
    """The state of the last completed step (step - 1) when no checkpoint holds it yet and the
    producer does not generate ahead: what a failed generation saves before the run stops
    (the model and optimizer are still that step's; the producer, the aggregator, the planner
    and the RNG streams are taken here, before the step's generation moves them). None
    otherwise."""
    if step - 1 <= max(last_saved, 0) or producer.lag > 0:
        return None
    return capture_train_state(step - 1, producer, planner, aggregator, detached=True)


def agreed_batch(producer: RunAheadProducer, dist: Any, step: int) -> StepBatch:
    """The step's batch, once every rank has its own: a generation that failed on one rank (a
    rollout server down) is raised on every rank, so all of them save the last completed step
    and stop together, none left waiting in the training pass's collectives. With generation
    overlapping training the failure comes from the generation worker's process, passed on as
    the same error type (rlbatch.rollout.generation_worker, rlbatch.train.producer)."""
    batch, failure = None, None
    try:
        batch = producer.batch_for_step(step)
    except RolloutUnavailableError as err:
        failure = ("rollout failed", str(err))
    votes = dist.all_gather_object(failure)
    failed = [(r, v[1]) for r, v in enumerate(votes) if v is not None]
    if failed:
        rank, text = failed[0]
        raise RolloutUnavailableError(f"step {step}: generation failed on rank {rank}: {text}")
    assert batch is not None
    return batch
