"""Atomic, resumable checkpoints (docs/resume.md).

Layout of ``<checkpoint dir>/step_00000042/``:

- ``rank_00000.pt`` .. one file per global rank (torch.save): that rank's model chunks
  (``module.state_dict()`` per virtual stage), optimizer and LR scheduler state, and its
  :class:`TrainState` (RNG states, producer queue + sampler cursor, planner pool, LCM buffers,
  policy version, step, metrics history). Saving per rank covers every (tp, pp, dp) layout
  without a resharding step; resume needs the same parallel layout (checked).
- ``meta.json``: step, world size, the per-rank parallel coordinates, ``"complete": true``.
  Written last.

Atomicity: every rank writes into ``.tmp-step_00000042`` (same parent, so the rename stays on
one file system), each file written to ``*.part``, flushed, fsynced and renamed; after a
barrier rank 0 writes meta.json, fsyncs the directory and renames it to ``step_00000042``,
then fsyncs the parent. :func:`latest_checkpoint` only considers ``step_*`` directories whose
meta.json says complete, so a crash at any point leaves the previous checkpoint the latest
one. Needs a file system shared by all ranks (one node, or a shared mount).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


@dataclass
class TrainState:
    """Everything besides model/optimizer/scheduler that resume needs, for one rank."""

    step: int = 0
    """Optimizer steps completed."""
    policy_version: int = 0
    """Version of the policy after ``step`` steps (equal to step in the loop)."""
    producer: dict[str, Any] = field(default_factory=dict)
    """RunAheadProducer.state_dict(): sampler epoch/cursor, queued rounds, current round."""
    planner: dict[str, Any] = field(default_factory=dict)
    """Pool batcher state (batching.*.mode=pool)."""
    aggregator: dict[str, Any] = field(default_factory=dict)
    """Pending LCM aggregation buffers."""
    rng: dict[str, Any] = field(default_factory=dict)
    """capture_rng_state()."""
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    """Per-step metric records so far (summary table and plot at the end)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: dataclasses.asdict would turn queued Samples into plain dicts.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown TrainState fields in checkpoint: {sorted(unknown)}")
        return cls(**data)


# ------------------------------------------------------------------------------------------
# RNG
# ------------------------------------------------------------------------------------------


def _megatron_tracker() -> Any | None:
    """Megatron's model-parallel RNG tracker, only if megatron is already imported."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    if module is None:
        return None
    return module.get_cuda_rng_tracker()


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU, CUDA (when present) and Megatron tracker RNG states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _megatron_tracker()
    if tracker is not None and tracker.is_initialized():
        state["megatron"] = {name: s.clone() for name, s in tracker.get_states().items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron" in state:
        tracker = _megatron_tracker()
        if tracker is None:
            raise RuntimeError("checkpoint has Megatron RNG states but megatron is not loaded")
        tracker.set_states({name: s.clone() for name, s in state["megatron"].items()})


# ------------------------------------------------------------------------------------------
# Directory protocol
# ------------------------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` via ``path.part`` + flush + fsync + rename."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a checkpoint directory, or None when missing/unreadable/incomplete."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("complete") is True else None


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME_RE.match(child.name)
        if match and child.is_dir() and read_meta(child) is not None:
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """Newest complete checkpoint under ``ckpt_dir`` (half-written ones are never returned)."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int, *, keep: Path | None = None):
    """Delete all but the newest ``keep_last`` checkpoints, and leftovers of crashed writes."""
    root = Path(ckpt_dir)
    removed = []
    complete = list_checkpoints(root)
    for _, path in complete[: max(0, len(complete) - max(keep_last, 1))]:
        if keep is None or path.resolve() != keep.resolve():
            shutil.rmtree(path)
            removed.append(path)
    for child in root.iterdir():
        if child.name.startswith((_TMP_PREFIX, _OLD_PREFIX)) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def resolve_resume(resume: str, ckpt_dir: str | Path) -> Path | None:
    """trainer.resume = none | auto | PATH -> the checkpoint to load (None: start fresh)."""
    if resume in ("none", "", None):
        return None
    if resume == "auto":
        return latest_checkpoint(ckpt_dir)
    path = Path(resume)
    if read_meta(path) is None:
        hint = latest_checkpoint(path)  # a checkpoint *directory* was given
        if hint is not None:
            return hint
        raise FileNotFoundError(
            f"trainer.resume={resume} is not a complete checkpoint (no meta.json with "
            f'"complete": true): pass a step_* directory, its parent, or trainer.resume=auto'
        )
    return path


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    payload: dict[str, Any],
    *,
    rank: int = 0,
    world_size: int = 1,
    meta: dict[str, Any] | None = None,
    keep_last: int = 2,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Collective: every rank calls it with its own payload; returns the final directory.

    ``barrier`` synchronises the ranks (rlbatch.distributed's barrier; a no-op for one rank).
    """
    sync = barrier or (lambda: None)
    root = Path(ckpt_dir)
    final = root / checkpoint_name(step)
    tmp = root / (_TMP_PREFIX + final.name)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    sync()
    _write_atomic(tmp / rank_file(rank), lambda fh: torch.save(payload, fh))
    sync()
    if rank == 0:
        _commit(tmp, final, step, world_size, meta or {})
        prune_checkpoints(root, keep_last, keep=final)
    sync()
    return final


def _commit(tmp: Path, final: Path, step: int, world_size: int, meta: dict[str, Any]) -> None:
    missing = [rank_file(r) for r in range(world_size) if not (tmp / rank_file(r)).exists()]
    if missing:
        raise RuntimeError(f"checkpoint {final.name}: rank files missing: {missing}")
    body = {**meta, "step": step, "world_size": world_size, "format": FORMAT_VERSION}
    body["complete"] = True
    _write_atomic(tmp / "meta.json", lambda fh: fh.write(json.dumps(body, indent=2).encode()))
    _fsync_dir(tmp)
    old = final.with_name(_OLD_PREFIX + final.name)
    if final.exists():  # re-saving a step (e.g. the final save right after a resume)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def load_checkpoint(path: str | Path, *, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """This rank's payload; refuses a checkpoint written by another world size."""
    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks, this run has "
            f"{world_size}: resume with the same parallel layout (tp, pp, vpp, dp)"
        )
    return torch.load(path / rank_file(rank), map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------------
# Rank payload: model chunks + optimizer + scheduler + TrainState
# ------------------------------------------------------------------------------------------


def build_payload(
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
) -> dict[str, Any]:
    return {
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "train_state": state.to_dict(),
    }


def apply_payload(
    payload: dict[str, Any], model: list[torch.nn.Module], optimizer: Any, scheduler: Any
) -> TrainState:
    """Load model/optimizer/scheduler in place; return the TrainState (RNG not yet restored)."""
    if len(payload["model"]) != len(model):
        raise ValueError(
            f"checkpoint has {len(payload['model'])} model chunks, this run {len(model)} "
            "(parallel.vpp differs?)"
        )
    for chunk, sd in zip(model, payload["model"], strict=True):
        chunk.load_state_dict(sd)
    if optimizer is not None and payload["optimizer"] is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload["scheduler"] is not None:
        scheduler.load_state_dict(payload["scheduler"])
    return TrainState.from_dict(payload["train_state"])
