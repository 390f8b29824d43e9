"""verifiers' runtime folders as rlbatch keeps track of them (rlbatch.rollout.agent.verifiers_env).

verifiers' subprocess runtime makes a folder for each runtime it starts,
``~/.cache/verifiers/runtimes/subprocess/<random name>``: one per tool server and one per
running episode. It removes the folder when it tears the runtime down, or at the interpreter's exit. A
``kill -9`` of the run reaches neither, so the folders stay. Their names carry no pid, so
nothing tells a dead run's folders from those of a run still going (another run, another
user's, another node's on a shared home).

rlbatch therefore keeps a record of its own: one folder per process, next to verifiers' ones,
``~/.cache/verifiers/runtimes/rlbatch-owners/<host>-<boot>-<pid>-<start>``, holding an empty
file named after each runtime folder the process has made and not yet removed. The name is
written before the runtime folder is made, and removed once the folder is gone. ``start`` is
the process's start time (clock ticks since boot, /proc), so a pid the system has given to
another process since does not pass for the owner; ``boot`` (the kernel's boot id) covers a
reboot. Each run (and evaluation) that starts verifiers environments calls
:func:`record_runtime_folders`, which first removes the folders of every record on this host
whose process is gone (or a zombie), then the record itself. A record of a live process, or of
another host, is never touched, and a folder no record names is not rlbatch's to remove.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("rlbatch")

OWNERS = "rlbatch-owners"
"""The folder, next to verifiers' runtime folders, holding one record per process."""


def _root() -> Path:
    """verifiers' runtimes folder, read at each call (verifiers' own CACHE_DIR)."""
    from verifiers.v1.runtimes import subprocess as vf_subprocess

    return Path(vf_subprocess.CACHE_DIR) / "runtimes"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return "noboot"


def _stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time in clock ticks since boot) of ``pid`` from /proc, or None when /proc
    has no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]  # fields 3 and 22 of proc(5)


def owner_name(pid: Optional[int] = None) -> str:
    """The record's name for process ``pid`` (this one by default)."""
    pid = os.getpid() if pid is None else pid
    stat = _stat(pid)
    return f"{socket.gethostname()}-{_boot_id()}-{pid}-{stat[1] if stat else 'nostart'}"


def owner_gone(name: str) -> bool:
    """Whether the process a record of this host names has ended: another boot, no such pid,
    a zombie, or a pid now held by a process started at another time. A record of another
    host is never gone here; without /proc a pid still in use counts as the owner."""
    host, boot, pid, start = name.rsplit("-", 3)
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if boot != _boot_id():
        return True
    stat = _stat(int(pid))
    if stat is None:
        if Path("/proc/self/stat").exists():
            return True
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    state, started = stat
    return state in ("Z", "X") or started != start


def reclaim(root: Optional[Path] = None) -> list[tuple[str, list[str]]]:
    """Remove the runtime folders of every record of a gone process (:func:`owner_gone`) and the
    record; (record, folders removed) of each."""
    root = _root() if root is None else root
    owners = root / OWNERS
    if not owners.is_dir():
        return []
    reclaimed = []
    for record in sorted(owners.iterdir()):
        try:
            gone = record.is_dir() and owner_gone(record.name)
        except ValueError:  # not a record's name
            continue
        if not gone:
            continue
        removed = []
        for marker in sorted(record.iterdir()):
            name = marker.name
            folder = root / "subprocess" / name
            if name not in (".", "..") and "/" not in name and folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(name)
        shutil.rmtree(record, ignore_errors=True)
        reclaimed.append((record.name, removed))
    return reclaimed


def record_runtime_folders() -> None:
    """Reclaim the runtime folders of gone processes (:func:`reclaim`, logged), then record each
    runtime folder this process's verifiers subprocess runtime makes, until it is removed."""
    for record, removed in reclaim():
        if removed:
            log.info(
                "removed %d verifiers runtime folder(s) from %s that process %s left when it was"
                " killed (rlbatch's record %s): %s",
                len(removed),
                _root() / "subprocess",
                record.rsplit("-", 2)[1],
                record,
                ", ".join(removed[:3]) + (", ..." if len(removed) > 3 else ""),
            )
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    if getattr(SubprocessRuntime.start, "rlbatch_recorded", False):
        return
    start, teardown, cleanup = (
        SubprocessRuntime.start,
        SubprocessRuntime.teardown,
        SubprocessRuntime.cleanup,
    )

    async def recorded_start(self: Any) -> None:
        self._rlbatch_marker = _marker(self.name)  # before the folder: a kill between leaves
        await start(self)  # a record of no folder, never a folder of no record

    async def recorded_teardown(self: Any) -> None:
        await teardown(self)
        _unmark(self)

    def recorded_cleanup(self: Any) -> None:
        cleanup(self)
        _unmark(self)

    for fn in (recorded_start, recorded_teardown, recorded_cleanup):
        fn.rlbatch_recorded = True  # type: ignore[union-attr]
    SubprocessRuntime.start = recorded_start  # type: ignore[method-assign]
    SubprocessRuntime.teardown = recorded_teardown  # type: ignore[method-assign]
    SubprocessRuntime.cleanup = recorded_cleanup  # type: ignore[method-assign]


_OWNER: dict[int, Path] = {}
"""This process's record (by pid: a forked child has its own)."""


def _marker(folder: str) -> Path:
    pid = os.getpid()
    if pid not in _OWNER:
        _OWNER[pid] = _root() / OWNERS / owner_name(pid)
    marker = _OWNER[pid] / folder
    for _ in range(10):  # another thread may remove the record as it empties (_unmark)
        _OWNER[pid].mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            marker.touch()
            return marker
    marker.touch()
    return marker


def _unmark(runtime: Any) -> None:
    """Drop the runtime's name from the record once its folder is gone (a folder teardown
    could not remove stays recorded, for a later run to reclaim)."""
    marker = getattr(runtime, "_rlbatch_marker", None)
    workdir = getattr(runtime, "workdir", None)
    if marker is not None and (workdir is None or not Path(workdir).exists()):
        with contextlib.suppress(OSError):
            marker.unlink()
        with contextlib.suppress(OSError):
            marker.parent.rmdir()  # the last one: no record left behind by a clean exit
