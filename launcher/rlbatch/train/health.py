"""Failure behaviour of the loop: fault injection, non-finite checks, heartbeats.

- :func:`inject_fault` implements ``debug.fail_at_step / fail_rank / fail_kind`` (failure tests).
- :class:`NonFiniteError` is raised before a checkpoint can record a poisoned step.
- :class:`Heartbeat`: every rank writes ``<run_dir>/heartbeat/rank<N>.json`` (step, phase, time)
  at each step; when a collective times out (``trainer.timeout_s``), :func:`laggards` reads them
  to name the ranks that stopped answering instead of a bare "timed out".
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbatch.config.schema import DebugConfig, FailKind
from rlbatch.runtime import progress


class InjectedFailure(RuntimeError):
    """debug.fail_kind=raise_error."""


class NonFiniteError(FloatingPointError):
    """A NaN/inf loss or gradient; the step is not checkpointed."""


def inject_fault(debug: DebugConfig, step: int, rank: int, *, hang_s: float = 1e9) -> bool:
    """Apply debug.fail_* at 1-based optimizer ``step`` on ``rank``.

    Returns True when the step must poison its loss (nan_loss); raises / kills / hangs for the
    other kinds; False when nothing is injected.
    """
    if debug.fail_at_step is None or step != debug.fail_at_step or rank != debug.fail_rank:
        return False
    if debug.fail_sync is not None:  # the fault is in that step's weight sync
        return False
    kind = FailKind(debug.fail_kind)
    if kind == FailKind.nan_loss:
        return True
    if kind == FailKind.raise_error:
        raise InjectedFailure(
            f"injected failure (debug.fail_kind=raise_error) at step {step} on rank {rank}"
        )
    if kind == FailKind.kill:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(hang_s)  # FailKind.hang: stop answering; the other ranks time out
    return False


def check_finite(metrics: Mapping[str, Any], *, step: int, rank: int) -> None:
    """Raise NonFiniteError if loss or grad_norm is NaN/inf, naming micro-batch and rank.

    ``nonfinite_micro_batch`` in the metrics is either the train step's description
    ("micro-batch 2 on rank 1") or a micro-batch index on this rank.
    """
    bad = [
        k
        for k in ("loss", "grad_norm")
        if isinstance(metrics.get(k), float) and not math.isfinite(metrics[k])
    ]
    if not bad:
        return
    where = metrics.get("nonfinite_micro_batch")
    if isinstance(where, str):
        location = where
    elif where is not None:
        location = f"micro-batch {where} on rank {rank}"
    else:
        location = f"rank {rank}"
    values = ", ".join(f"{k}={metrics[k]}" for k in bad)
    raise NonFiniteError(
        f"non-finite {values} at step {step}: {location}. The update was not checkpointed; the "
        "last good checkpoint is intact (lower trainer.optim.lr, or check the data and rewards)"
    )


class ZeroAdvantageError(RuntimeError):
    """Every advantage was 0 for grpo.max_zero_advantage_steps steps in a row."""


class ZeroAdvantageGuard:
    """Counts the optimizer steps in a row whose every advantage is 0 (the record's
    ``advantage_zero_frac`` is 1: the same on every rank, it is reduced over all of them) and
    stops the run at ``limit`` of them (0: never). A resumed run counts on from its history."""

    def __init__(
        self, limit: int, history: list[dict[str, Any]] | None = None, teacher_key: str = ""
    ) -> None:
        self.limit = limit
        self.teacher_key = teacher_key
        self.run: list[dict[str, Any]] = []
        for record in history or []:
            self._count(record)

    def _count(self, record: Mapping[str, Any]) -> None:
        if record.get("advantage_zero_frac") == 1.0:
            self.run.append(dict(record))
        elif "advantage_zero_frac" in record:
            self.run = []

    def observe(self, record: Mapping[str, Any]) -> None:
        self._count(record)
        if self.limit <= 0 or len(self.run) < self.limit:
            return
        raise ZeroAdvantageError(
            zero_advantage_message(self.run[-self.limit :], self.limit, self.teacher_key)
        )


def zero_advantage_message(
    records: list[dict[str, Any]], limit: int, teacher_key: str = "grpo.distill.teacher"
) -> str:
    """Why the run stopped and what to change, from the steps that learnt nothing
    (``teacher_key``: the key that sets the run's teacher, grpo.distill.teacher or
    grpo.distill.teacher_url)."""
    first, last = records[0]["step"], records[-1]["step"]
    if not any("reward_mean" in r for r in records):  # pure distillation: the teacher's alone
        teacher_key = teacher_key or "grpo.distill.teacher"
        check = (
            f"Check that {teacher_key} is not a rollout server: a weight sync of the student (of"
            " this run or another) replaced the teacher's weights there; serve the teacher on a"
            " server of its own"
            if teacher_key.endswith("_url")
            else f"Check that {teacher_key} is not the student itself"
        )
        return (
            f"every advantage was 0 at steps {first}..{last} ({limit} steps in a row): pure"
            " distillation (grpo.distill.reward_coef=0) trains on the teacher's per-token"
            " advantage alone, and the teacher gave every sampled token the behaviour policy's"
            " own log-prob (to within 1e-5 nats, numeric noise: distill/teacher_kl"
            f" 0), so the policy learnt nothing. {check}, raise grpo.distill.reward_coef to"
            f" learn from rewards too, or raise grpo.max_zero_advantage_steps (now {limit}; 0 ="
            " never stop)"
        )
    means = sorted({round(float(r.get("reward_mean") or 0.0), 6) for r in records})
    fails: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("reward_fail/") and v:
                fails[k] = fails.get(k, 0.0) + float(v)
    failed = f"; reward failures over these steps: {dict(sorted(fails.items()))}" if fails else ""
    return (
        f"every advantage was 0 at steps {first}..{last} ({limit} steps in a row): within every"
        f" group all rewards were equal (reward_mean per step in {means}), so the policy"
        f" learnt nothing from them{failed}. Check the reward: score some completions with"
        " rlbatch-score, read reward/<part>_mean and reward_fail/<reason> in metrics.jsonl."
        " If equal rewards are expected for now (a hard task whose rewards all start at 0),"
        f" raise grpo.max_zero_advantage_steps (now {limit}), set it to 0 to never stop, or"
        " set grpo.filter_groups=zero_variance to train only on groups with a reward spread"
    )


class Heartbeat:
    """Per-rank liveness file, rewritten atomically at each phase of each step (and around
    each user call: rlbatch.runtime.progress)."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = self.dir / f"rank{rank}.json"
        progress.listen(self._write)

    def beat(self, step: int, phase: str) -> None:
        progress.set_phase(step, phase)

    def _write(self, now: progress.Activity) -> None:
        body = {"rank": self.rank, "step": now.step, "phase": now.phase, "time": time.time()}
        if now.detail:
            body["detail"] = now.detail
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)


EXIT_HUNG = 1
"""Exit code of a worker the watchdog stopped."""


class Watchdog:
    """Fails this worker when its current phase makes no progress for trainer.timeout_s (a
    user call marked by progress.user_call: its own bound), at any dp: writes the rank's error
    report (the step, the phase, the user call, the main thread's stack; or, when peers lag
    behind, which ranks it waits for) and exits, so torchrun stops the run."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._main = threading.main_thread().ident

    def start(self) -> Watchdog:
        threading.Thread(target=self._watch, name="rlbatch-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            now = progress.current
            limit = now.limit_s if now.detail and now.limit_s else self.timeout_s
            idle = time.monotonic() - now.since
            if idle > limit and not self._stop.is_set():
                from rlbatch.runtime.worker import write_report

                write_report(self.run_dir, self.rank, self.report(now, idle, limit))
                print(f"[rank {self.rank}] no progress for {idle:.0f} s: stopped", flush=True)
                os._exit(EXIT_HUNG)

    def report(self, now: progress.Activity, idle: float, limit: float) -> str:
        where = f"step {now.step} ({now.phase}" + (f", in {now.detail})" if now.detail else ")")
        bound = "its own bound" if limit != self.timeout_s else "trainer.timeout_s"
        behind = laggards(self.run_dir, self.world_size, now.step, now.phase)
        behind = [b for b in behind if not b.startswith(f"rank {self.rank} ")]
        if behind:  # a peer is stuck, this rank waits for it in a collective
            head = (
                f"rank {self.rank}: RankTimeoutError: waited {idle:.0f} s at {where} for "
                f"{', '.join(behind)} (trainer.timeout_s={self.timeout_s:g})"
            )
        else:
            head = (
                f"rank {self.rank}: HangError: no progress for {idle:.0f} s at {where}: over "
                f"{bound} ({limit:g} s; trainer.timeout_s, data.reward_timeout_s for reward "
                "functions)"
            )
        frame = sys._current_frames().get(self._main or 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        return f"{head}\n\nmain thread of rank {self.rank} when stopped:\n{stack}"


def read_heartbeats(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in (Path(run_dir) / "heartbeat").glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[int(beat["rank"])] = beat
    return out


PHASES = ("start", "batch", "agree", "train", "metrics", "eval", "checkpoint", "end")
"""Order of the phases of one step (heartbeats compare (step, phase index))."""


def _phase_index(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else 0


def laggards(run_dir: str | Path, world_size: int, step: int, phase: str) -> list[str]:
    """Ranks behind (step, phase): 'rank 1 (last seen step 3 batch, 41 s ago)'."""
    beats = read_heartbeats(run_dir)
    now = time.time()
    out = []
    for rank in range(world_size):
        beat = beats.get(rank)
        if beat is None:
            out.append(f"rank {rank} (no heartbeat)")
        elif (beat["step"], _phase_index(beat["phase"])) < (step, _phase_index(phase)):
            ago = now - beat["time"]
            detail = f", in {beat['detail']}" if beat.get("detail") else ""
            out.append(
                f"rank {rank} (last seen step {beat['step']} {beat['phase']}{detail}, "
                f"{ago:.0f} s ago)"
            )
    return out
