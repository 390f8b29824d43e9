"""The training loop's checkpoints: :func:`save` the state after a step (free space checked
first, the best checkpoint kept), :func:`resume` from the checkpoint trainer.resume names (the
newest intact one every rank confirms), the run's folders."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from rlbatch.config.schema import RunConfig
from rlbatch.runtime.rng import restore_rng_state
from rlbatch.train import integrity
from rlbatch.train.checkpoint import (
    TrainState,
    apply_payload,
    build_payload,
    capture_train_state,
    latest_checkpoint,
    load_checkpoint,
    resume_candidates,
    save_checkpoint,
    verify_share,
    work_in_flight,
)
from rlbatch.train.components import Components
from rlbatch.train.metrics import MetricsLogger

log = logging.getLogger("rlbatch.train")


def checkpoint_dir(cfg: RunConfig) -> Path:
    if cfg.trainer.checkpoint.dir:
        return Path(cfg.trainer.checkpoint.dir)
    return run_dir(cfg) / "checkpoints"


def run_dir(cfg: RunConfig) -> Path:
    if cfg.run_dir is None:
        raise ValueError("run_dir is null: rlbatch-train's driver sets it; pass run_dir=PATH")
    return Path(cfg.run_dir)


# ------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------


def save(
    cfg: RunConfig,
    comps: Components,
    step: int,
    logger: MetricsLogger,
    taken: TrainState | None = None,
) -> Path:
    """Checkpoint the state after ``step`` (the live one, or ``taken`` earlier at that step)."""
    state = (
        capture_train_state(step, comps.producer, comps.planner, comps.aggregator)
        if taken is None
        else taken
    )
    state.metrics_history = list(logger.history) if comps.dist.rank == 0 else []
    _check_free_space(cfg, comps, step)
    payload = build_payload(comps.model, comps.optimizer, comps.scheduler, state)
    # every rank's: at another layout the loader reads rank 0's file alone
    shares = comps.dist.all_gather_object(work_in_flight(payload["train_state"]))
    in_flight = sorted({name for share in shares for name in share})
    path = save_checkpoint(
        checkpoint_dir(cfg),
        step,
        payload,
        rank=comps.dist.rank,
        world_size=comps.dist.world_size,
        meta={**comps.meta, "in_flight": in_flight},
        keep_last=cfg.trainer.checkpoint.keep_last,
        barrier=comps.dist.barrier,
        gather=comps.dist.all_gather_object,
        keep_best=_best_checkpoint(cfg, step, logger) if comps.dist.rank == 0 else None,
    )
    if comps.dist.rank == 0:
        log.info("checkpoint %s", path)
    return path


def _check_free_space(cfg: RunConfig, comps: Components, step: int) -> None:
    """Refuse a save the checkpoint's file system cannot hold (rank 0 decides for all), before
    writing anything: the expected size is the newest intact checkpoint's, or for the first
    save the parameters plus two Adam moments of every model-parallel rank."""
    problem = None
    if comps.dist.rank == 0:
        root = checkpoint_dir(cfg)
        newest = latest_checkpoint(root)
        needed = integrity.checkpoint_size(newest) if newest is not None else 0
        if not needed:
            params = sum(p.numel() * p.element_size() for c in comps.model for p in c.parameters())
            dp = int((comps.meta.get("parallel") or {}).get("dp", comps.dist.world_size))
            needed = 3 * params * max(1, comps.dist.world_size // max(dp, 1))
        problem = integrity.free_space_problem(root, step, needed)
    problem = comps.dist.all_gather_object(problem)[0]
    if problem:
        raise integrity.CheckpointSpaceError(errno.ENOSPC, problem)


# ------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------


def resume(cfg: RunConfig, comps: Components) -> TrainState | None:
    """Load the checkpoint trainer.resume names: rank 0 lists the candidates (newest first),
    every rank checksums its share of each until one is intact, all ranks load it."""
    found: tuple[list[str], list[str]] | str
    if comps.dist.rank == 0:
        try:
            paths, skipped = resume_candidates(cfg.trainer.resume, checkpoint_dir(cfg))
            found = (
                [str(p) for p in paths],
                [f"{f.path.name}: {', '.join(f.problems)}" for f in skipped],
            )
        except (integrity.NoIntactCheckpointError, FileNotFoundError) as err:
            found = str(err)
    else:
        found = ([], [])
    shared = comps.dist.all_gather_object(found)[0]
    if isinstance(shared, str):
        raise integrity.NoIntactCheckpointError(shared)
    candidates, skipped = shared
    path = _first_verified(comps, candidates, skipped)
    if path is None:
        if cfg.trainer.resume == "auto" and comps.dist.rank == 0:
            log.info(
                "trainer.resume=auto: no checkpoint in %s, starting fresh (to continue "
                "an earlier run pass its hydra.run.dir=DIR, or trainer.resume=DIR/checkpoints)",
                checkpoint_dir(cfg),
            )
        return None
    payload = load_checkpoint(path, rank=comps.dist.rank, world_size=comps.dist.world_size)
    state = apply_payload(payload, comps.model, comps.optimizer, comps.scheduler)
    _apply_lr_config(comps)
    comps.producer.load_state_dict(state.producer)
    if comps.planner is not None:
        comps.planner.load_state_dict(state.planner)
    if comps.aggregator is not None:
        comps.aggregator.load_state_dict(state.aggregator)
    restore_rng_state(state.rng)
    if comps.dist.rank == 0:
        log.info("resumed from %s at step %d", path, state.step)
    return state


def _apply_lr_config(comps: Components) -> None:
    """The learning rate of this run's config, not the checkpoint's: the optimizer state loads
    each parameter group's max_lr / min_lr back from the checkpoint, which would silently keep
    the old rate; set them to the scheduler's (built from trainer.optim) and recompute."""
    sched, groups = comps.scheduler, getattr(comps.optimizer, "param_groups", None)
    if sched is None or not groups or not hasattr(sched, "max_lr"):
        return
    old = groups[0].get("max_lr", sched.max_lr)
    for group in groups:
        group["max_lr"], group["min_lr"] = sched.max_lr, sched.min_lr
    sched.step(increment=0)
    if old != sched.max_lr and comps.dist.rank == 0:
        log.warning(
            "trainer.optim.lr changed on resume: %g -> %g, applied to the optimizer (now %g)",
            old,
            sched.max_lr,
            groups[0]["lr"],
        )


def _first_verified(comps: Components, candidates: list[str], skipped: list[str]) -> Path | None:
    """The first candidate whose checksums all ranks confirm; warns about each one skipped."""
    rank, world = comps.dist.rank, comps.dist.world_size
    for candidate in candidates:
        problems = comps.dist.all_gather_object(verify_share(Path(candidate), rank, world))
        bad = [p for share in problems for p in share]
        if not bad:
            if skipped and rank == 0:
                log.warning(
                    "resume: skipped damaged checkpoint(s) %s; resuming from %s, the newest "
                    "intact one",
                    "; ".join(skipped),
                    Path(candidate).name,
                )
            return Path(candidate)
        skipped.append(f"{Path(candidate).name}: {', '.join(bad)}")
    if skipped:
        raise integrity.NoIntactCheckpointError(
            f"trainer.resume: no intact checkpoint: {'; '.join(skipped)}. Nothing was loaded or "
            "deleted; start fresh with trainer.resume=none, or resume a copy you trust with "
            "trainer.resume=PATH"
        )
    return None


def _best_checkpoint(cfg: RunConfig, step: int, logger: MetricsLogger) -> Path | None:
    """Rank 0: the checkpoint of the best keep_best value so far (step: the one being saved)."""
    metric = cfg.trainer.checkpoint.keep_best
    if metric is None:
        return None
    from rlbatch.eval.metrics import best_step
    from rlbatch.train.checkpoint import checkpoint_name, list_checkpoints

    steps = [s for s, _ in list_checkpoints(checkpoint_dir(cfg))] + [step]
    mode = cfg.trainer.checkpoint.keep_best_mode.value
    best = best_step(logger.history, metric, mode, steps)
    return None if best is None else checkpoint_dir(cfg) / checkpoint_name(best)
