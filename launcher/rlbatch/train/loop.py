"""The GRPO training loop: :func:`train` over :class:`Components` (the worker entry of rlbatch-train
is ``rlbatch.train.build:run``, which builds the components and calls it).

One optimizer step (docs/training_loop.md):

    heartbeat -> fault injection -> producer.batch_for_step (generation due at this policy
    version: sample prompts, LCM aggregate, roll out, reward, advantages, logps) -> ranks agree on
    (step, round, stream position) -> train_step (plan, passes, optimizer step) -> finite check ->
    metrics (DP-reduced) -> checkpoint every trainer.checkpoint.every_steps / every_minutes

and at the end: final checkpoint, HF export, summary table, plot. :func:`train` is generic over
:class:`Components`, so the loop's own behaviour (resume, faults, metrics) is tested with small
torch fakes; :mod:`rlbatch.train.build` assembles the real Megatron components.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from rlbatch.config.distill import reward_weight, served_teacher
from rlbatch.config.schema import RunConfig
from rlbatch.distributed import as_collective_timeout
from rlbatch.eval.settings import eval_due
from rlbatch.grpo.distill import zero_advantage
from rlbatch.rollout.protocol import RolloutUnavailableError
from rlbatch.runtime import preempt
from rlbatch.runtime.rng import capture_rng_state, restore_rng_state
from rlbatch.train import generation_failure
from rlbatch.train.components import Components
from rlbatch.train.health import (
    Heartbeat,
    Watchdog,
    ZeroAdvantageGuard,
    check_finite,
    inject_fault,
    laggards,
)
from rlbatch.train.metrics import MetricsLogger
from rlbatch.train.plot import plot_metrics
from rlbatch.train.producer import StepBatch, oldest_version
from rlbatch.train.saving import resume, run_dir, save
from rlbatch.train.staleness import (
    ROLLOUT_COUNTERS,
    ROUND_EVENTS,
    rollout_metrics,
    staleness_metrics,
    staleness_sums,
    step_figures,
)

log = logging.getLogger("rlbatch.train")


class RankTimeoutError(RuntimeError):
    """A collective timed out (trainer.timeout_s); names the ranks that stopped answering."""


class RankDisagreementError(RuntimeError):
    """Ranks disagree on the step they are executing."""


# ------------------------------------------------------------------------------------------
# Entry
# ------------------------------------------------------------------------------------------


def train(cfg: RunConfig, comps: Components) -> list[dict[str, Any]]:
    """Resume, run optimizer steps up to trainer.max_steps, finish. Returns rank 0's history."""
    rank = comps.dist.rank
    state = resume(cfg, comps)
    resumed_step = state.step if state is not None else 0  # the last step already done
    logger = MetricsLogger(
        run_dir(cfg),
        cfg.logging,
        rank=rank,
        max_steps=cfg.trainer.max_steps,
        resumed_step=resumed_step,
        history=state.metrics_history if state is not None else None,
    )
    heartbeat = Heartbeat(run_dir(cfg), rank)
    heartbeat.beat(resumed_step + 1, "start")
    watchdog = Watchdog(run_dir(cfg), rank, comps.dist.world_size, cfg.trainer.timeout_s).start()
    learning = ZeroAdvantageGuard(
        cfg.grpo.max_zero_advantage_steps,
        state.metrics_history if state is not None else None,
        "grpo.distill.teacher_url" if served_teacher(cfg) else "grpo.distill.teacher",
    )
    last_saved = resumed_step if state is not None else -1
    servers = generation_failure.on_servers(cfg)
    saved_at = time.monotonic()
    try:
        if state is None and _eval_due(cfg, comps, 0):
            logger.log({"step": 0, **_evaluate(cfg, comps, heartbeat, 0)})
        for step in range(resumed_step + 1, cfg.trainer.max_steps + 1):
            before = (
                generation_failure.unsaved_state(
                    comps.producer, comps.planner, comps.aggregator, step, last_saved
                )
                if servers
                else None
            )
            try:
                record = _guarded(
                    cfg, comps, heartbeat, step, lambda s=step: _one_step(cfg, comps, heartbeat, s)
                )
            except RolloutUnavailableError:
                if before is not None:  # the last completed step, for trainer.resume=auto
                    heartbeat.beat(step - 1, "checkpoint")
                    path = save(cfg, comps, step - 1, logger, before)
                    if rank == 0:
                        log.error("generation failed: saved step %d at %s", step - 1, path)
                raise
            best = False
            if _eval_due(cfg, comps, step):
                record.update(_evaluate(cfg, comps, heartbeat, step))
                best = _new_best(cfg, comps, logger, record)
            logger.log(record)
            learning.observe(record)
            due, stop = _guarded(
                cfg, comps, heartbeat, step, lambda s=step, t=saved_at: _decide(cfg, comps, s, t)
            )
            if due or stop or best:
                heartbeat.beat(step, "checkpoint")
                path = _guarded(
                    cfg, comps, heartbeat, step, lambda s=step: save(cfg, comps, s, logger)
                )
                last_saved, saved_at = step, time.monotonic()
            if stop:
                _stop_preempted(cfg, comps, step, path, stop)
        final = cfg.trainer.max_steps
        if resumed_step > final:
            log.warning(
                "checkpoint step %d is past trainer.max_steps=%d: nothing to train",
                resumed_step,
                final,
            )
        elif last_saved != final:
            heartbeat.beat(final, "checkpoint")
            _guarded(cfg, comps, heartbeat, final, lambda: save(cfg, comps, final, logger))
        heartbeat.beat(final, "end")
        watchdog.stop()
        _finish(cfg, comps, logger)
    finally:
        watchdog.stop()
        logger.close()
    return logger.history


def _eval_due(cfg: RunConfig, comps: Components, step: int) -> bool:
    return comps.evaluate is not None and eval_due(cfg, step)


def _evaluate(cfg: RunConfig, comps: Components, heartbeat: Heartbeat, step: int) -> dict:
    """The eval/* metrics of the policy after ``step`` optimizer steps (0: the initial one).
    The RNG streams training reads are saved before and restored after: evaluation leaves
    training as it was."""
    assert comps.evaluate is not None
    heartbeat.beat(step, "eval")
    evaluate = comps.evaluate
    rng = capture_rng_state()
    try:
        return _guarded(cfg, comps, heartbeat, step, lambda: evaluate(step))
    finally:
        restore_rng_state(rng)
        if comps.release_rollout is not None:
            comps.release_rollout()


def _new_best(cfg: RunConfig, comps: Components, logger: MetricsLogger, record: dict) -> bool:
    """trainer.checkpoint.keep_best: whether ``record`` beats every earlier evaluation (rank 0
    holds the history and decides for all), so the step is saved as the new best."""
    metric = cfg.trainer.checkpoint.keep_best
    if metric is None:
        return False
    from rlbatch.eval.metrics import is_new_best

    mode = cfg.trainer.checkpoint.keep_best_mode.value
    mine = comps.dist.rank == 0 and is_new_best(logger.history, metric, mode, record[metric])
    return bool(comps.dist.all_gather_object(mine)[0])


def _decide(cfg: RunConfig, comps: Components, step: int, saved_at: float) -> tuple[bool, str]:
    """(save now, preemption signal or ''), the same on every rank, in one small collective
    per step: a save is due at trainer.checkpoint.every_steps, or every_minutes since the last
    save by rank 0's clock; a stop when any rank got a preemption signal (SIGTERM, SIGUSR1,
    SIGHUP: rlbatch.runtime.preempt)."""
    ckpt = cfg.trainer.checkpoint
    overdue = ckpt.every_minutes > 0 and time.monotonic() - saved_at >= ckpt.every_minutes * 60
    votes = comps.dist.all_gather_object((overdue, preempt.requested() or ""))
    signals = [sig for _, sig in votes if sig]
    due = (ckpt.every_steps > 0 and step % ckpt.every_steps == 0) or bool(votes[0][0])
    return due, signals[0] if signals else ""


def _stop_preempted(cfg: RunConfig, comps: Components, step: int, path: Path, sig: str) -> None:
    """After the preemption checkpoint: rank 0 records it for the launcher's one-line report;
    every rank raises Preempted (the worker exits with EXIT_PREEMPTED)."""
    if comps.dist.rank == 0:
        record = {"signal": sig, "step": step, "path": str(path)}
        (run_dir(cfg) / preempt.RECORD).write_text(json.dumps(record))
        # the worker sees the launcher's forwarded signal; the launcher names the one it got
        log.warning("preemption requested (%s reached the workers): saved step %d at %s",
                    sig, step, path)  # fmt: skip
    raise preempt.Preempted(step, str(path), sig)


def _guarded(cfg: RunConfig, comps: Components, heartbeat: Heartbeat, step: int, fn):
    """Run ``fn``; turn a collective timeout into an error naming the silent ranks."""
    try:
        return fn()
    except RuntimeError as error:
        exc = as_collective_timeout(error)
        if exc is None:
            raise
        try:
            beat = json.loads(heartbeat.path.read_text())
        except (OSError, ValueError):
            raise RankTimeoutError(
                f"rank {comps.dist.rank}: a collective got no answer within "
                f"trainer.timeout_s={cfg.trainer.timeout_s} before the first step"
            ) from exc
        behind = laggards(run_dir(cfg), comps.dist.world_size, beat["step"], beat["phase"])
        who = ", ".join(behind) if behind else "unknown rank (no heartbeat lags)"
        raise RankTimeoutError(
            f"rank {comps.dist.rank}: a collective at step {step} ({beat['phase']}) got no answer "
            f"within trainer.timeout_s={cfg.trainer.timeout_s}: {who}"
        ) from exc


def _one_step(cfg: RunConfig, comps: Components, heartbeat: Heartbeat, step: int):
    rank = comps.dist.rank
    start_time = time.perf_counter()
    comps.dist.reset_peak_memory()
    heartbeat.beat(step, "batch")
    if generation_failure.on_servers(cfg):
        batch = generation_failure.agreed_batch(comps.producer, comps.dist, step)
    else:
        batch = comps.producer.batch_for_step(step)
    if comps.release_rollout is not None:
        comps.release_rollout()
    inject_nan = inject_fault(cfg.debug, step, rank)  # mid-step: generation done, no update yet
    heartbeat.beat(step, "agree")
    if cfg.debug.check_plan_consistency:
        _check_agreement(comps, step, batch)
    heartbeat.beat(step, "train")
    metrics = comps.train_step(batch, step, inject_nan)
    if cfg.debug.detect_nan:
        check_finite(metrics, step=step, rank=rank)
    heartbeat.beat(step, "metrics")
    took = time.perf_counter() - start_time
    # the run's last step also reports what the rounds generated ahead for steps past
    # trainer.max_steps counted (a server restart seen while generating them), which no step of
    # this run trains
    ahead = comps.producer.take_ahead_events(ROUND_EVENTS) if step == cfg.trainer.max_steps else {}
    return _record(
        comps, step, batch, metrics, took, reward_weight(cfg), float(cfg.grpo.distill.coef), ahead
    )


def _check_agreement(comps: Components, step: int, batch: StepBatch) -> None:
    """Every rank must be at the same step, round, round version and stream position."""
    current = comps.producer.current
    assert current is not None
    key = (
        step,
        batch.round_index,
        batch.iteration,
        batch.slice_index,
        current.policy_version,
        current.request.stream_start,
    )
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    digests = comps.dist.all_gather_object(digest)
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise RankDisagreementError(
            f"step {step}: rank(s) {odd} disagree with rank 0 on the step state (step, round, "
            f"round version, stream position): digests {digests}. Rank {comps.dist.rank} has {key}"
        )


def _record(
    comps: Components,
    step: int,
    batch: StepBatch,
    metrics: dict[str, Any],
    step_time: float,
    reward_coef: float = 1.0,
    coef: float = 1.0,
    ahead: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The step's record; advantage_zero_frac counts samples whose combined advantage
    (reward_coef * A + the per-token teacher advantage, coef * D_t) is 0 everywhere (D_t within
    rlbatch.grpo.distill.ZERO_TOLERANCE); ``ahead``: rollout/* events of rounds generated
    past trainer.max_steps (the last step's, rlbatch.train.staleness.step_figures)."""
    local = [0.0] * 7
    for s in batch.samples:
        local[0] += 1
        local[1] += s.reward
        local[2] += s.reward * s.reward
        local[3] += len(s.response_ids)
        local[4] += batch.round_start_version - oldest_version(s)
        local[5] += sum(p.length for p in (s, *s.earlier_segments))  # every trained sample
        local[6] += float(zero_advantage(s, reward_coef, coef))
    figures = step_figures(batch, ahead)
    reported = [float(k in figures) for k in ROLLOUT_COUNTERS]  # present, even when 0
    rollout = [float(figures.pop(k, 0.0)) for k in ROLLOUT_COUNTERS]
    staleness = staleness_sums(batch)
    reduced = comps.dist.all_reduce_sum(local + staleness + rollout + reported + [1.0])
    n, r_sum, r_sq, len_sum, stale_sum, tokens, zero_adv = reduced[:7]
    figures.update(staleness_metrics(reduced[7 : 7 + len(staleness)]))
    counters = reduced[7 + len(staleness) : 7 + len(staleness) + len(rollout)]
    ranks = reduced[7 + len(staleness) + len(rollout) : -1]
    # a counter counts when every rank of the reduction reported it (a round that decoded
    # nothing reports zeros, not nothing)
    present = {
        k: c for k, c, r in zip(ROLLOUT_COUNTERS, counters, ranks, strict=True) if r == reduced[-1]
    }
    figures.update(rollout_metrics(present))
    n = max(n, 1.0)
    mean = r_sum / n
    record = {
        "step": step,
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "reward_mean": mean,
        "reward_std": math.sqrt(max(r_sq - n * mean * mean, 0.0) / max(n - 1, 1.0)),
        "kl": metrics.get("kl"),
        "clip_fraction": metrics.get("clip_fraction"),
        "entropy": metrics.get("entropy"),
        "response_len_mean": len_sum / n,
        "tokens": int(tokens),
        "padding_efficiency": metrics.get("padding_efficiency"),
        "dp_imbalance": metrics.get("dp_imbalance"),
        "staleness_mean": stale_sum / n,
        "advantage_zero_frac": zero_adv / n,
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time if step_time > 0 else None,
        "peak_memory_gb": comps.dist.peak_memory_gb(),
        "round": batch.round_index,
        "iteration": batch.iteration,
        "samples": int(n),
        **figures,
    }
    if reward_coef == 0:  # pure distillation computes no reward: none is reported
        del record["reward_mean"], record["reward_std"]
    for key, value in metrics.items():
        record.setdefault(key, value)
    return record


# ------------------------------------------------------------------------------------------
# Finish
# ------------------------------------------------------------------------------------------


def _finish(cfg: RunConfig, comps: Components, logger: MetricsLogger) -> None:
    if cfg.trainer.checkpoint.export_hf and comps.export_hf is not None:
        comps.export_hf(run_dir(cfg) / "hf")
    if comps.dist.rank != 0:
        return
    logger.close()
    logger.print_summary()
    if cfg.logging.plot:
        plot_metrics(logger.history, run_dir(cfg) / "metrics.png", title=cfg.model.name)
