"""verifiers' runtime folders as rlbatch keeps track of them (rlbatch.rollout.agent.verifiers_env).

verifiers' subprocess runtime makes a folder for each runtime it starts,
``~/.cache/verifiers/runtimes/subprocess/<random name>``: one per tool server and one per
running episode. It removes the folder when it tears the runtime down, or at the interpreter's exit. A
``kill -9`` of the run reaches neither, so the folders stay. Their names carry no pid, so
nothing tells a dead run's folders from those of a run still going (another run, another
user's, another node's on a shared home).

rlbatch therefore keeps a record of its own: one folder per process, next to verifiers' ones,
``~/.cache/verifiers/runtimes/rlbatch-owners/<host>-<boot>-<pid>-<start>``, holding an empty
file named after each runtime folder the process has made and not yet removed (the name is
written before the runtime folder is made, and removed once the folder is gone), and beside it
``<record>.lock``, which the process holds locked (flock) for as long as it lives: it takes the
lock before it makes the record, and the kernel releases it when the process ends, however it
ends. Each run (and evaluation) that starts verifiers environments calls
:func:`record_runtime_folders`, which first reclaims every record whose lock it can take: its
owner has ended, so its runtime folders, the record and the lock file go. Whether a process
lives is the lock's to say, not its pid: a pid means nothing in another PID namespace (a
container sharing the home folder and the host name) or on another machine (a home folder on
NFS, whose locks the server keeps). A lock that cannot be taken (a live owner, a reclaim under
way elsewhere, a file system without locks) leaves the record alone, and a folder no record
names is not rlbatch's to remove. The name's host, boot, pid and process start time only say
whose record it is in the log.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
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


def reclaim(root: Optional[Path] = None) -> list[tuple[str, list[str]]]:
    """Remove the runtime folders, the record and the lock file of every record whose lock
    this process can take (its owner has ended); (record, folders removed) of each. A record
    another process reclaims at the same time, or one that cannot be read, is left to it (or
    to a later run): a run never fails here."""
    root = _root() if root is None else root
    owners = root / OWNERS
    try:
        entries = sorted(owners.iterdir())
    except OSError:  # no record yet
        return []
    reclaimed = []
    for entry in entries:
        try:
            if entry.suffix == ".lock":
                if not entry.with_suffix("").exists():  # a clean exit's, or a cut reclaim's
                    _reclaim_record(root, entry.with_suffix(""))
                continue
            removed = _reclaim_record(root, entry)
        except OSError as err:
            log.debug("verifiers runtime record %s left as it is: %s", entry, err)
            continue
        if removed is not None:
            reclaimed.append((entry.name, removed))
    return reclaimed


def _reclaim_record(root: Path, record: Path) -> Optional[list[str]]:
    """The runtime folders removed with ``record``, or None when its owner lives (or another
    process is reclaiming it)."""
    lock = record.with_name(record.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:  # being reclaimed elsewhere (records without a lock are not ours)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: the owner lives (or no locks on this file system: cannot tell)
            return None
        try:
            if os.stat(lock).st_ino != os.fstat(fd).st_ino:
                return None  # reclaimed and removed since it was opened
        except FileNotFoundError:
            return None
        removed = []
        if record.is_dir():
            for marker in sorted(record.iterdir()):
                folder = root / "subprocess" / marker.name
                if folder.is_dir():
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(marker.name)
            shutil.rmtree(record, ignore_errors=True)
        lock.unlink(missing_ok=True)
        return removed
    finally:
        os.close(fd)


def record_runtime_folders() -> None:
    """Reclaim the runtime folders of gone processes (:func:`reclaim`, logged), then record each
    runtime folder this process's verifiers subprocess runtime makes, until it is removed."""
    for record, removed in reclaim():
        if removed:
            log.info(
                "removed %d verifiers runtime folder(s) from %s that process %s left when it"
                " ended without removing them (rlbatch's record %s): %s",
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


_OWNER: dict[int, tuple[Path, int]] = {}
"""This process's record and the descriptor of its held lock (by pid: a forked child has its
own)."""


def _record() -> Path:
    """This process's record folder's path, its lock taken first (a reclaim that finds the
    record finds it held)."""
    pid = os.getpid()
    if pid not in _OWNER:
        record = _root() / OWNERS / owner_name(pid)
        lock = record.with_name(record.name + ".lock")
        record.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(
                fd, fcntl.LOCK_EX
            )  # a reclaim that took the new file first holds it briefly
            with contextlib.suppress(FileNotFoundError):
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break  # not removed by that reclaim meanwhile
            os.close(fd)
        _OWNER[pid] = (record, fd)
        atexit.register(_drop_lock_file, pid, record)
    return _OWNER[pid][0]


def _drop_lock_file(pid: int, record: Path) -> None:
    """At the owner's clean exit (not a forked child's): the lock file goes with the record (a
    record still naming folders teardown could not remove keeps it, for a later run)."""
    if os.getpid() == pid and not record.exists():
        with contextlib.suppress(OSError):
            record.with_name(record.name + ".lock").unlink()


def _marker(folder: str) -> Path:
    record = _record()
    marker = record / folder
    for _ in range(10):  # another thread may remove the record as it empties (_unmark)
        record.mkdir(parents=True, exist_ok=True)
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
