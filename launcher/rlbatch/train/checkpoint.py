"""Atomic, resumable checkpoints (docs/resume.md).

Layout of ``<checkpoint dir>/step_00000042/``:

- ``model_optim/``: the model chunks and the optimizer (Adam moments, the distributed
  optimizer's sharded state included) through megatron-core's distributed checkpointing
  (rlbatch.engine.dist_checkpoint): tensors keyed by global name and offset, so a checkpoint
  saved at one (tp, pp, vpp, dp) layout loads at another.
- ``rank_00000.pt`` .. one file per global rank (torch.save): the LR scheduler state and that
  rank's :class:`TrainState` (RNG states, producer queue + sampler cursor, planner pool, LCM
  buffers, policy version, step, metrics history). Plain torch modules (no sharded state dict)
  keep their model / optimizer ``state_dict()`` here instead.
- ``meta.json``: step, world size, the parallel layout and per-rank coordinates, the run's
  resolved config, ``"complete": true``.
- ``manifest.json``: every other file with its size and CRC-32 (rlbatch.train.integrity).
  Written last: the commit point.

Resume at the same layout restores everything (bit-exact). At another layout
(:func:`reshard_train_state`): model and optimizer are resharded; the scheduler, step counters,
metrics history and the sampler's global cursor come from rank 0; per-rank state that is tied
to the old data-parallel sharding (queued generated rounds, pool contents, LCM buffers, RNG
streams) must be empty or is re-seeded (docs/resume.md).

Atomicity: every rank writes into ``.tmp-step_00000042`` (same parent, so the rename stays on
one file system), each file written to ``*.part``, flushed, fsynced and renamed; after a
barrier rank 0 writes meta.json; the ranks checksum their share of the files; rank 0 writes
manifest.json, fsyncs the directory and renames it to ``step_00000042``, then fsyncs the
parent. :func:`latest_checkpoint` only considers ``step_*`` directories intact by their
manifest, so a crash at any point leaves the previous checkpoint the latest one; resume also
verifies the checksums before loading (:func:`resume_candidates`, :func:`verify_share`).
Needs a file system shared by all ranks (one node, or a shared mount).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from rlbatch.runtime.rng import capture_rng_state
from rlbatch.train import integrity
from rlbatch.train.integrity import CheckpointSpaceError, resume_candidates

FORMAT_VERSION = 3
SHARDED_DIR = "model_optim"
"""Sub-directory of a checkpoint holding the distributed (megatron) model + optimizer state."""
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
    """rlbatch.runtime.rng.capture_rng_state()."""
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


def capture_train_state(
    step: int, producer: Any, planner: Any, aggregator: Any, *, detached: bool = False
) -> TrainState:
    """The TrainState after ``step`` optimizer steps: the run-ahead producer's, the planner's
    and the aggregator's state_dict() (None: no state) and the RNG streams, as they are now.
    ``detached``: a state kept while the run goes on (saved later, if at all) owns copies of
    what those objects keep changing: the sampler's cursor, the planner's pool and the LCM
    buffers (the producer's lists are copies already)."""
    producer_state = producer.state_dict()
    planner_state = _state_of(planner)
    aggregator_state = _state_of(aggregator)
    if detached:
        producer_state["sampler"] = copy.deepcopy(producer_state["sampler"])
        planner_state = copy.deepcopy(planner_state)
        aggregator_state = copy.deepcopy(aggregator_state)
    return TrainState(
        step=step,
        policy_version=step,
        producer=producer_state,
        planner=planner_state,
        aggregator=aggregator_state,
        rng=capture_rng_state(),
        metrics_history=[],
    )


def _state_of(obj: Any) -> dict[str, Any]:
    return obj.state_dict() if obj is not None else {}


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
    """(step, path) of every intact checkpoint (by its manifest's names and sizes), oldest
    first."""
    return [(f.step, f.path) for f in integrity.scan(ckpt_dir) if f.intact]


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """Newest intact checkpoint under ``ckpt_dir`` (half-written ones are never returned)."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def prune_checkpoints(
    ckpt_dir: str | Path, keep_last: int, *, keep: Path | None = None, best: Path | None = None
):
    """Delete all but the newest ``keep_last`` intact checkpoints (a damaged checkpoint never
    counts toward them, so a failed newer save never costs an intact older one), damaged ones
    older than those, and leftovers of crashed writes. ``keep`` and ``best`` (the
    trainer.checkpoint.keep_best one) survive."""
    root = Path(ckpt_dir)
    removed = []
    found = integrity.scan(root)
    kept = [f for f in found if f.intact][-max(keep_last, 1) :]
    spared = {p.resolve() for p in (keep, best) if p is not None}
    oldest_kept = kept[0].step if kept else -1
    for f in found:
        if f in kept or f.path.resolve() in spared:
            continue
        if f.intact or f.step < oldest_kept:
            shutil.rmtree(f.path)
            removed.append(f.path)
    for child in root.iterdir():
        if child.name.startswith((_TMP_PREFIX, _OLD_PREFIX)) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def resolve_resume(resume: str, ckpt_dir: str | Path) -> Path | None:
    """The newest intact (by names and sizes) checkpoint ``trainer.resume`` names, or None."""
    candidates, _ = resume_candidates(resume, ckpt_dir)
    return candidates[0] if candidates else None


def verify_share(path: Path, rank: int, world_size: int) -> list[str]:
    """Checksum problems among this rank's share of ``path``'s files (every world_size-th)."""
    names = integrity.manifest_names(path)
    return integrity.check_checksums(path, names[rank::world_size])


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
    gather: Callable[[Any], list[Any]] | None = None,
    keep_best: Path | None = None,
) -> Path:
    """Collective: every rank calls it with its own payload; returns the final directory.

    ``barrier`` synchronises the ranks and ``gather`` collects one object per rank
    (rlbatch.distributed's; no-ops for one rank). Without ``gather`` rank 0 checksums every
    file itself. A write that fails for lack of space raises CheckpointSpaceError.
    ``keep_best`` (rank 0): a checkpoint that pruning keeps beyond ``keep_last``.
    """
    sync = barrier or (lambda: None)
    root = Path(ckpt_dir)
    final = root / checkpoint_name(step)
    tmp = root / (_TMP_PREFIX + final.name)
    payload = dict(payload)
    sharded = payload.pop("sharded", None)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        if sharded is not None:
            (tmp / SHARDED_DIR).mkdir()
    sync()
    with _space_errors(root, tmp, step):
        if sharded is not None:
            from rlbatch.engine.dist_checkpoint import save_sharded

            save_sharded(tmp / SHARDED_DIR, sharded.model, sharded.optimizer)
        _write_atomic(tmp / rank_file(rank), lambda fh: torch.save(payload, fh))
        sync()
        if rank == 0:
            _write_meta(tmp, final, step, world_size, meta or {})
        sync()
        # without gather nothing holds rank 0 back from committing (renaming tmp) while the
        # others would still list it: they take no share, and do not look
        shared = gather is not None
        names = integrity.checkpoint_files(tmp) if shared or rank == 0 else []
        share = names[rank::world_size] if shared else names
        entries = integrity.file_entries(tmp, share)
        shares = gather(entries) if gather is not None else [entries]
        if rank == 0:
            integrity.write_manifest(tmp, {k: v for part in shares for k, v in part.items()})
            _commit(tmp, final)
            prune_checkpoints(root, keep_last, keep=final, best=keep_best)
    sync()
    return final


@contextlib.contextmanager
def _space_errors(root: Path, tmp: Path, step: int) -> Iterator[None]:
    """Turn a write that failed for lack of space (ENOSPC, or torch's serializer failing on a
    full disk) into CheckpointSpaceError, after removing the partial checkpoint."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        full = getattr(err, "errno", None) == errno.ENOSPC or shutil.disk_usage(root).free < (
            1 << 20
        )
        if not full:
            raise
        written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSpaceError(
            errno.ENOSPC, integrity.space_message(root, step, written, None)
        ) from err


def _write_meta(tmp: Path, final: Path, step: int, world_size: int, meta: dict[str, Any]):
    missing = [rank_file(r) for r in range(world_size) if not (tmp / rank_file(r)).exists()]
    if missing:
        raise RuntimeError(f"checkpoint {final.name}: rank files missing: {missing}")
    body = {**meta, "step": step, "world_size": world_size, "format": FORMAT_VERSION}
    body["complete"] = True
    _write_atomic(tmp / "meta.json", lambda fh: fh.write(json.dumps(body, indent=2).encode()))


def _commit(tmp: Path, final: Path) -> None:
    _fsync_dir(tmp)
    old = final.with_name(_OLD_PREFIX + final.name)
    if final.exists():  # re-saving a step (e.g. the final save right after a resume)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def load_checkpoint(
    path: str | Path, *, rank: int = 0, world_size: int = 1, layout: dict[str, int] | None = None
) -> dict[str, Any]:
    """This rank's payload. ``layout``: this run's parallel sizes (default: megatron's, when it
    is initialized). At the saved layout the rank's own file; at another one (only checkpoints
    with sharded model state) rank 0's file with its TrainState reduced to the layout-free part
    (:func:`reshard_train_state`) and ``"resharded": True``."""
    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    layout = layout if layout is not None else _current_layout()
    saved = meta.get("parallel")
    same = meta["world_size"] == world_size and (None in (layout, saved) or saved == layout)
    sharded = (path / SHARDED_DIR).is_dir()
    if not same and not sharded:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks, this run has "
            f"{world_size} (layouts {saved} vs {layout}) and it has no sharded model state: "
            "resume with the same parallel layout (tp, pp, vpp, dp)"
        )
    payload = torch.load(
        path / rank_file(rank if same else 0), map_location="cpu", weights_only=False
    )
    if sharded:
        payload["sharded_dir"] = path / SHARDED_DIR
    if not same:
        payload["train_state"] = reshard_train_state(payload["train_state"], keep_history=rank == 0)
        payload["resharded"] = True
    return payload


def _current_layout() -> dict[str, int] | None:
    """(tp, pp, vpp, cp, dp) of this process when megatron's parallel state is initialized."""
    if "megatron.core.parallel_state" not in sys.modules:
        return None
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        return None
    return parallel.current_layout().sizes()


def work_in_flight(data: dict[str, Any]) -> list[str]:
    """The per-rank work a TrainState (``TrainState.to_dict()``) holds that belongs to its
    data-parallel sharding, each named by the setting that fills it: what a resume at another
    parallel layout cannot carry over. Recorded in meta.json (``in_flight``, every rank's), so
    the driver refuses such a resume before launch (rlbatch.config.resume_check)."""
    producer = data.get("producer") or {}
    aggregator = data.get("aggregator") or {}
    stream = aggregator.get("stream")  # grpo.partial_rollouts: the aggregator's state is nested
    if stream is not None:
        aggregator = aggregator.get("aggregator") or {}
    pending = {
        "producer queue (grpo.num_steps_async > 0)": producer.get("queue"),
        "round being trained (grpo.steps_per_generation > 1)": (
            producer.get("current") and not producer.get("round_done")
        ),
        "rows of the partial-rollout stream (grpo.partial_rollouts)": stream
        and any(stream.get(k) for k in ("groups", "pending", "running")),
        "LCM buffer": aggregator.get("buffer"),
        "pool batcher (batching.*.mode=pool)": data.get("planner"),
    }
    return [name for name, value in pending.items() if value]


def reshard_train_state(data: dict[str, Any], *, keep_history: bool) -> dict[str, Any]:
    """Rank 0's TrainState for a run at another parallel layout: step, policy version, metrics
    history, LCM counters and the sampler's global cursor carry over; the RNG streams are the
    new run's own. Per-rank work in flight (queued generated rounds, the round being trained,
    pending LCM buffers, pool contents) belongs to the old data-parallel sharding: it must be
    empty (else ValueError naming the setting that fills it)."""
    producer = dict(data.get("producer") or {})
    busy = work_in_flight(data)
    if busy:
        raise ValueError(
            "resume at another parallel layout needs a checkpoint without per-rank work in "
            f"flight; this one holds: {', '.join(busy)}. Resume at the saved layout, or save "
            "where none is pending (grpo.num_steps_async=0, a step that ends a generation round)"
        )
    producer["current"] = None
    out = dict(data)
    out["producer"] = producer
    out["rng"] = {}
    out["planner"] = {}
    if not keep_history:
        out["metrics_history"] = []
    return out


# ------------------------------------------------------------------------------------------
# Rank payload: model chunks + optimizer + scheduler + TrainState
# ------------------------------------------------------------------------------------------


@dataclass
class ShardedState:
    """Model chunks + optimizer that save_checkpoint writes through megatron's distributed
    checkpointing (collectively) instead of into the rank file."""

    model: list[Any]
    optimizer: Any


def build_payload(
    model: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
) -> dict[str, Any]:
    from rlbatch.engine.dist_checkpoint import is_sharded_model

    payload: dict[str, Any] = {
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "train_state": state.to_dict(),
    }
    if is_sharded_model(model):
        payload["sharded"] = ShardedState(list(model), optimizer)
    else:
        payload["model"] = [chunk.state_dict() for chunk in model]
        payload["optimizer"] = optimizer.state_dict() if optimizer is not None else None
    return payload


def apply_payload(
    payload: dict[str, Any], model: list[torch.nn.Module], optimizer: Any, scheduler: Any
) -> TrainState:
    """Load model/optimizer/scheduler in place (collective for sharded checkpoints); return the
    TrainState (RNG not yet restored)."""
    if "sharded_dir" in payload:
        from rlbatch.engine.dist_checkpoint import load_sharded

        load_sharded(payload["sharded_dir"], list(model), optimizer)
    else:
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
