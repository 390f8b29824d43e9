"""One run per directory: the launcher locks its run directory (and an explicit checkpoint
directory) before it starts anything.

The lock is ``<dir>/rlbatch.lock``, created exclusively (``O_CREAT | O_EXCL``, atomic on local
and NFS v3+ file systems), holding the holder's host, pid, start time, run id and scheduler job.
The holder touches it every :data:`REFRESH_S` while its workers run. A second launcher refuses,
naming the holder, unless the lock is stale:

- the holder is on this host and its pid is gone (killed, crashed, rebooted);
- or the lock was not refreshed for :data:`STALE_S` (a holder on another host that died);
- or it belongs to this same scheduler job (a requeued SLURM job: the scheduler never runs one
  job twice at once).

A stale lock is taken over with a warning, but only once no process of the holder's run is left
on this host: every process of a run carries the lock's token in its environment
(:data:`RUN_ENV`, inherited by torchrun, the workers, their generation workers and anything
they start), and a launcher that finds one alive waits up to :data:`SURVIVOR_WAIT_S` for it to
end (a killed run's processes follow their launcher within a second:
rlbatch.runtime.lifeline), then refuses, naming them. Multi-node: only node 0 takes the lock (every node
of the run shares the run id and the directory; the others are the same run).

Torch-free; no Hydra.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("rlbatch")

LOCK_NAME = "rlbatch.lock"
REFRESH_S = 30.0
"""The holder touches its lock this often."""
STALE_S = 300.0
"""A lock not touched for this long belongs to a dead holder, wherever it ran."""
RUN_ENV = "RLBATCH_RUN_LOCK"
"""Environment variable holding the lock's token in every process of the run."""
TORN_LIVE_S = 10.0
"""A lock that cannot be read yet and is younger than this is being written by its holder."""
SURVIVOR_WAIT_S = 10.0
"""How long a launcher waits for a dead holder's processes to end before it refuses."""


class RunLockedError(RuntimeError):
    """Another live launcher holds the directory."""


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has ``pid`` (one of another user counts as alive, a
    zombie as gone: it holds nothing and runs no more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stale_reason(holder: dict[str, Any], age_s: float, job: str | None) -> str | None:
    """Why ``holder``'s lock (last touched ``age_s`` ago) may be taken over, or None."""
    if holder.get("host") == socket.gethostname() and not pid_alive(int(holder.get("pid", -1))):
        return f"its process {holder.get('pid')} on this host is gone"
    if age_s > STALE_S:
        return f"it was last refreshed {age_s:.0f} s ago (a live holder refreshes every {REFRESH_S:.0f} s)"
    if job is not None and holder.get("job") == job:
        return f"it belongs to this same scheduler job {job} (requeued)"
    return None


@dataclass
class RunLock:
    """The locks this launcher holds; :meth:`release` (or the context manager) drops them."""

    paths: list[Path] = field(default_factory=list)
    token: str | None = None
    """Marks the processes of this run (:data:`RUN_ENV`); None when no lock is held."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> RunLock:
        """Held: the processes this launcher starts meanwhile inherit the token (RUN_ENV in
        os.environ until :meth:`__exit__`)."""
        if self.token:
            os.environ[RUN_ENV] = self.token
        return self

    def __exit__(self, *exc: object) -> None:
        if self.token and os.environ.get(RUN_ENV) == self.token:
            del os.environ[RUN_ENV]
        self.release()

    def start_refresh(self) -> None:
        def refresh() -> None:
            while not self._stop.wait(REFRESH_S):
                for path in self.paths:
                    try:
                        os.utime(path)
                    except OSError:
                        pass

        threading.Thread(target=refresh, name="rlbatch-lock", daemon=True).start()

    def release(self) -> None:
        self._stop.set()
        for path in self.paths:
            try:
                if json.loads(path.read_text()).get("pid") == os.getpid():
                    path.unlink()
            except (OSError, ValueError):
                pass
        self.paths = []


def acquire(dirs: list[Path], run_id: str | None, job: str | None) -> RunLock:
    """Lock every directory of ``dirs`` (created if missing), or raise RunLockedError naming
    the holder (after releasing what was already taken)."""
    lock = RunLock(token=uuid.uuid4().hex)
    try:
        for directory in dict.fromkeys(d.resolve() for d in dirs):
            directory.mkdir(parents=True, exist_ok=True)
            lock.paths.append(_take(directory / LOCK_NAME, run_id, job, lock.token))
    except BaseException:
        lock.release()
        raise
    lock.start_refresh()
    return lock


def _take(path: Path, run_id: str | None, job: str | None, token: str | None) -> Path:
    started = datetime.now(UTC).isoformat(timespec="seconds")
    body = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
    body |= {"run_id": run_id, "job": job, "token": token}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _take_over_if_stale(path, job)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(body))
        return path
    raise RunLockedError(f"{path}: could not take the lock (another launcher races for it)")


def _take_over_if_stale(path: Path, job: str | None) -> None:
    try:
        holder = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return  # released meanwhile: try again
    except (OSError, ValueError):
        holder, age = {}, STALE_S + 1  # torn or foreign: nothing alive writes it like that...
        with contextlib.suppress(OSError):  # ...but for its holder in the instant after creating it
            if time.time() - path.stat().st_mtime < TORN_LIVE_S:
                raise RunLockedError(
                    f"{path.parent} is being taken by another rlbatch launcher right now (its "
                    "lock is still empty): wait for it to end, or use another directory "
                    "(hydra.run.dir / trainer.checkpoint.dir)"
                ) from None
    why = stale_reason(holder, age, job)
    if why is None:
        raise RunLockedError(
            f"{path.parent} is in use by another rlbatch launcher: host {holder.get('host')}, "
            f"pid {holder.get('pid')}, started {holder.get('started')} (run id "
            f"{holder.get('run_id')}). Two runs in one directory would overwrite each other's "
            "checkpoints and metrics: wait for it to end, stop it, or use another directory "
            "(hydra.run.dir / trainer.checkpoint.dir)"
        )
    if holder.get("host") == socket.gethostname() and holder.get("token"):
        _refuse_if_survivors(path, holder, why)
    log.warning("taking over the stale lock %s: %s (holder: %s)", path, why, holder)
    path.unlink(missing_ok=True)


def _refuse_if_survivors(path: Path, holder: dict[str, Any], why: str) -> None:
    """Wait up to SURVIVOR_WAIT_S for the processes of ``holder``'s run on this host to end;
    raise RunLockedError naming those still alive."""
    deadline = time.monotonic() + SURVIVOR_WAIT_S
    while survivors := run_processes(str(holder["token"])):
        if time.monotonic() > deadline:
            listed = "; ".join(f"{pid}: {cmd[:120]}" for pid, cmd in sorted(survivors.items()))
            pids = " ".join(str(pid) for pid in sorted(survivors))
            raise RunLockedError(
                f"{path.parent}: the lock's holder is stale ({why}), but {len(survivors)} "
                f"process(es) of its run (run id {holder.get('run_id')}) are still alive after "
                f"{SURVIVOR_WAIT_S:.0f} s ({listed}). A new run beside them would overwrite its "
                f"checkpoints and metrics: stop them (kill -9 {pids}), then launch again"
            )
        time.sleep(0.1)


def run_processes(token: str) -> dict[int, str]:
    """pid -> command line of the live processes of this host whose environment holds
    ``RUN_ENV=token`` (Linux /proc; empty elsewhere and for processes this user cannot read)."""
    marker = f"{RUN_ENV}={token}".encode()
    found: dict[int, str] = {}
    try:
        entries = [e for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return found
    for entry in entries:
        try:
            with open(f"{entry.path}/environ", "rb") as fh:
                if marker not in fh.read().split(b"\0"):
                    continue
            with open(f"{entry.path}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):
                    continue  # ended, not yet reaped
            with open(f"{entry.path}/cmdline", "rb") as fh:
                found[int(entry.name)] = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile, or another user's
    return found
