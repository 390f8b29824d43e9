"""Checkpoint integrity: the manifest (the commit point), verification, and free space.

Torch-free, so the driver can check checkpoints before launching anything.

``manifest.json`` lists every file of a checkpoint with its size and CRC-32, and is written
last: a checkpoint is *intact* when its manifest reads and every file it lists is there with
that size (:func:`check_sizes`, cheap: used for pruning and by the driver) and that checksum
(:func:`check_checksums`: what ``trainer.resume`` runs, shared over the ranks).

Why CRC-32 (zlib): it finds the damage a file system does (truncation, zeroed or flipped
blocks, a partial copy) at 3-4 GB/s on one core, about twice sha256 and four times blake2b
here; nothing needs protection against a forger, only against accidents. A checkpoint of a 7B
model with its Adam moments (~85 GB) is checked in well under a minute when its files are
split over the ranks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("rlbatch")

MANIFEST = "manifest.json"
META = "meta.json"
ALGORITHM = "crc32"
CHUNK = 8 << 20
"""Bytes read at a time while checksumming (streamed: memory stays flat for any shard)."""
NAME_RE = re.compile(r"^step_(\d{8})$")
SPACE_MARGIN = 1.10
MANIFEST_SINCE = 3
"""The checkpoint format (meta.json "format") that introduced manifests. An older complete
checkpoint has none: it was committed by an atomic rename, so it is taken as intact, unverified."""
"""Free space a save needs: the expected size times this (file system metadata, rounding)."""


class CheckpointSpaceError(OSError):
    """Not enough free space for a checkpoint (before the save, or ENOSPC while writing)."""


class NoIntactCheckpointError(RuntimeError):
    """Checkpoints exist but none is intact; resume refuses to start fresh silently."""


def crc32_file(path: Path) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def checkpoint_files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, relative, sorted (the same on every
    rank, so ranks can split the list)."""
    out = []
    for path in directory.rglob("*"):
        if path.is_file() and path.name != MANIFEST:
            out.append(path.relative_to(directory).as_posix())
    return sorted(out)


def file_entries(directory: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{name: {"size", "crc32"}} of ``names`` (a rank's share of :func:`checkpoint_files`)."""
    return {
        n: {"size": (directory / n).stat().st_size, ALGORITHM: crc32_file(directory / n)}
        for n in names
    }


def write_manifest(directory: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Write manifest.json (through a .part file, fsynced): the checkpoint's commit point."""
    body = {"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}
    part = directory / (MANIFEST + ".part")
    with open(part, "wb") as fh:
        fh.write(json.dumps(body, indent=1).encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, directory / MANIFEST)


def read_manifest(directory: Path) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """(files, None), or (None, why it cannot be used)."""
    try:
        body = json.loads((directory / MANIFEST).read_text())
        files = body["files"]
        if body.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            return None, f"{MANIFEST} has an unknown format"
        return files, None
    except FileNotFoundError:
        return None, f"no {MANIFEST} (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{MANIFEST} unreadable ({type(err).__name__})"


def written_before_manifests(directory: Path) -> bool:
    """A complete checkpoint of a format older than :data:`MANIFEST_SINCE` (no manifest)."""
    if (directory / MANIFEST).exists():
        return False
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("complete") is True and int(meta.get("format", 0)) < MANIFEST_SINCE


def check_sizes(directory: Path) -> list[str]:
    """What is wrong with ``directory`` by the manifest's names and sizes ([] = intact)."""
    files, why = read_manifest(directory)
    if files is None:
        if written_before_manifests(directory):
            log.warning("%s was written before checkpoints had manifests: taken as intact, "
                        "its files unverified", directory)  # fmt: skip
            return []
        return [why or "no manifest"]
    problems = []
    for name, entry in files.items():
        try:
            size = (directory / name).stat().st_size
        except OSError:
            problems.append(f"{name} missing")
            continue
        if size != entry["size"]:
            problems.append(f"{name} has {size} bytes, the manifest says {entry['size']}")
    try:
        meta = json.loads((directory / META).read_text())
        if meta.get("complete") is not True:
            problems.append(f"{META} does not say complete")
    except (OSError, ValueError):
        problems.append(f"{META} unreadable")
    return problems


def check_checksums(directory: Path, names: Sequence[str]) -> list[str]:
    """Checksum mismatches among ``names`` (a rank's share of the manifest's files)."""
    files, why = read_manifest(directory)
    if files is None and written_before_manifests(directory):
        return []
    if files is None:
        return [why or "no manifest"]
    problems = []
    for name in names:
        try:
            actual = crc32_file(directory / name)
        except OSError as err:
            problems.append(f"{name} unreadable ({err.strerror or err})")
            continue
        if actual != files[name][ALGORITHM]:
            problems.append(f"{name} is corrupt (crc32 {actual}, the manifest says "
                            f"{files[name][ALGORITHM]})")  # fmt: skip
    return problems


def manifest_names(directory: Path) -> list[str]:
    files, _ = read_manifest(directory)
    return sorted(files or {})


def checkpoint_size(directory: Path) -> int:
    """Bytes of a checkpoint by its manifest (0 when it has none)."""
    files, _ = read_manifest(directory)
    return sum(int(e["size"]) for e in (files or {}).values())


@dataclass(frozen=True)
class Found:
    """A ``step_*`` directory and what is wrong with it ([] = intact by names and sizes)."""

    step: int
    path: Path
    problems: list[str]

    @property
    def intact(self) -> bool:
        return not self.problems


def scan(ckpt_dir: str | Path) -> list[Found]:
    """Every ``step_*`` directory of ``ckpt_dir``, oldest first, with its size check."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = NAME_RE.match(child.name)
        if match and child.is_dir():
            found.append(Found(int(match.group(1)), child, check_sizes(child)))
    return sorted(found, key=lambda f: f.step)


def describe(found: Sequence[Found]) -> str:
    """'step_00000004 (rank_00000.pt missing); step_00000002 (intact)' (newest first)."""
    return "; ".join(
        f"{f.path.name} ({', '.join(f.problems) if f.problems else 'intact'})"
        for f in reversed(found)
    )


def no_intact_error(ckpt_dir: str | Path, found: Sequence[Found]) -> NoIntactCheckpointError:
    return NoIntactCheckpointError(
        f"trainer.resume=auto: {ckpt_dir} holds {len(found)} checkpoint(s) and none is intact: "
        f"{describe(found)}. Nothing was loaded or deleted; start fresh with trainer.resume=none "
        "(in another run directory, or after moving these away), or resume a copy you trust "
        "with trainer.resume=PATH"
    )


def free_space_problem(root: Path, step: int, needed: int) -> str | None:
    """A 'no space left' message when the file system of ``root`` has less than ``needed`` x
    SPACE_MARGIN bytes free, else None."""
    probe = root if root.exists() else root.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free >= needed * SPACE_MARGIN:
        return None
    return space_message(root, step, needed, free)


def space_message(root: Path, step: int, needed: int, free: int | None = None) -> str:
    if free is None:
        probe = root if root.exists() else root.parent
        free = shutil.disk_usage(probe).free
    kept = [f.path.name for f in scan(root) if f.intact]
    return (
        f"no space left on the file system of {root} for checkpoint step {step}: it needs about "
        f"{_size(needed)} ({_size(int(needed * SPACE_MARGIN))} with margin), {_size(free)} are "
        f"free. The previous checkpoints are intact ({', '.join(kept) or 'none yet'}); free space "
        "or set trainer.checkpoint.dir to a larger file system, then resume with "
        "trainer.resume=auto"
    )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return f"{n} B"


def resume_candidates(resume: str, ckpt_dir: str | Path) -> tuple[list[Path], list[Found]]:
    """trainer.resume = none | auto | PATH -> (checkpoints to try, newest first; the damaged
    ones newer than the newest intact one, with why). The caller verifies the candidates'
    checksums in turn (:func:`verify_share`) and loads the first that passes.

    auto: the intact checkpoints of ``ckpt_dir`` ([] when it holds none at all; checkpoints
    that exist but none intact: NoIntactCheckpointError, never a silent fresh start). PATH:
    that step directory, or the checkpoints of that directory."""
    if resume in ("none", "", None):
        return [], []
    root = Path(ckpt_dir) if resume == "auto" else Path(resume)
    if resume != "auto" and NAME_RE.match(root.name):
        problems = check_sizes(root) if root.is_dir() else ["no such directory"]
        if problems:
            raise FileNotFoundError(
                f"trainer.resume={resume} is not an intact checkpoint ({', '.join(problems)}): "
                "pass another step_* directory, its parent, or trainer.resume=auto"
            )
        return [root], []
    found = scan(root)
    intact = [f for f in reversed(found) if f.intact]
    if found and not intact:
        raise no_intact_error(root, found)
    if resume != "auto" and not intact:
        raise FileNotFoundError(
            f"trainer.resume={resume} holds no checkpoint: pass a step_* directory, its "
            "parent, or trainer.resume=auto"
        )
    newest = intact[0].step if intact else -1
    return [f.path for f in intact], [f for f in found if not f.intact and f.step > newest]
