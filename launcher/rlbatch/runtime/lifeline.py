"""No orphans: torchrun and the workers end when the process that started them dies.

The launcher starts torchrun in its own session (so Ctrl-C reaches the workers through the
driver, in order), and torchrun starts each worker in a session of its own. Neither is then in
the launcher's process group, so ``kill -9`` of the launcher or of its group (a closed terminal,
``timeout``, a scheduler killing the job's main process) would leave them training and writing
into the run directory, racing a resumed run. Each of them therefore binds its life to its
parent's:

- Linux: ``prctl(PR_SET_PDEATHSIG, sig)`` makes the kernel send ``sig`` the moment the parent
  dies, whatever killed it;
- everywhere: a daemon thread polls the parent pid and sends ``sig`` itself when it changes
  (the parent died before the signal was armed, or the platform has no PR_SET_PDEATHSIG).

The parent passes its pid in ``RLBATCH_PARENT_PID``: a child that finds another parent at start
(its parent died while it was still importing) stops at once instead of arming too late.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PARENT_PID_ENV = "RLBATCH_PARENT_PID"
"""Pid of the process that must outlive this one (set by the parent in the child's env)."""
POLL_S = 0.5
"""Period of the parent-pid check of the fallback thread."""
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must die with this process."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def die_with_parent(sig: signal.Signals) -> None:
    """Receive ``sig`` when the parent dies (at once if it already has); then mark this process
    as the parent of the children it starts (they inherit os.environ)."""
    expected = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    _arm_parent_death_signal(sig)
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    if os.getppid() != expected:
        os.kill(os.getpid(), sig)
        return
    watch = threading.Thread(
        target=_watch_parent, args=(expected, sig), name="rlbatch-lifeline", daemon=True
    )
    watch.start()


def _arm_parent_death_signal(sig: signal.Signals) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watch thread still ends this process, POLL_S later


def _watch_parent(parent: int, sig: signal.Signals) -> None:
    stop = threading.Event()
    while not stop.wait(POLL_S):
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
            return
