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
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbatch.config.schema import DebugConfig, FailKind


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


class Heartbeat:
    """Per-rank liveness file, rewritten atomically at each phase of each step."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.dir = Path(run_dir) / "heartbeat"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = self.dir / f"rank{rank}.json"

    def beat(self, step: int, phase: str) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(
            json.dumps({"rank": self.rank, "step": step, "phase": phase, "time": time.time()})
        )
        os.replace(tmp, self.path)


def read_heartbeats(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in (Path(run_dir) / "heartbeat").glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[int(beat["rank"])] = beat
    return out


PHASES = ("batch", "agree", "train", "metrics", "eval", "checkpoint", "end")
"""Order of the phases of one step (heartbeats compare (step, phase index))."""


def laggards(run_dir: str | Path, world_size: int, step: int, phase: str) -> list[str]:
    """Ranks behind (step, phase): 'rank 1 (last seen step 3 batch, 41 s ago)'."""
    beats = read_heartbeats(run_dir)
    now = time.time()
    out = []
    for rank in range(world_size):
        beat = beats.get(rank)
        if beat is None:
            out.append(f"rank {rank} (no heartbeat)")
        elif (beat["step"], PHASES.index(beat["phase"])) < (step, PHASES.index(phase)):
            ago = now - beat["time"]
            out.append(
                f"rank {rank} (last seen step {beat['step']} {beat['phase']}, {ago:.0f} s ago)"
            )
    return out
