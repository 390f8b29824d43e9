"""No orphans: every process of a run ends when the process that started it dies.

The launcher starts torchrun in its own session (so Ctrl-C reaches the workers through the
driver, in order), and torchrun starts each worker in a session of its own. Neither is then in
the launcher's process group, so ``kill -9`` of the launcher or of its group (a closed terminal,
``timeout``, a scheduler killing the job's main process) would leave them training and writing
into the run directory, racing a resumed run. Each process of a run therefore binds its life to
its parent's (:func:`die_with_parent`):

- Linux: ``prctl(PR_SET_PDEATHSIG, sig)`` makes the kernel send ``sig`` the moment the parent
  dies, whatever killed it. The kernel counts the *thread* that started the child as its
  parent, so it is armed only for children started from the parent's main thread;
- everywhere: a daemon thread polls the parent pid and sends ``sig`` itself when it changes
  (the parent died before the signal was armed, a child started from another thread, or a
  platform without PR_SET_PDEATHSIG).

The parent passes its pid in ``RLBATCH_PARENT_PID``: a child that finds another parent at start
(its parent died while it was still importing) stops at once instead of arming too late.

The bound processes are torchrun, the rank workers and each rank's generation worker (a spawned
process). A process bound this way also binds every child it *forks* (``os.fork``,
multiprocessing's fork context: megatron's checkpoint writer, a reward function's pool): a fork
inherits neither the parent-death signal nor the watch thread, and it holds copies of all the
parent's file descriptors, so an orphaned fork would also keep the generation worker's pipe and
multiprocessing's resource tracker open. The resource tracker itself is not bound: it ends by
itself (cleaning up what the run left in shared memory) once every process holding its pipe has
ended.

:func:`orphaned` tells a signal handler whether this process outlived its parent: a preemption
signal (SIGTERM) then ends it instead of asking it to save (rlbatch.runtime.preempt).
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

_binding: tuple[int, signal.Signals] | None = None
"""(parent pid, signal) of this process once bound; None when unbound."""
_forking: tuple[int, bool] = (0, False)
"""(pid, from the main thread?) of the process about to fork: set just before a fork, so the
child finds the values of its parent."""
_hooked = False


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must die with this process."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def die_with_parent(sig: signal.Signals, *, kernel: bool = True) -> None:
    """Receive ``sig`` when the parent dies (at once if it already has); then mark this process
    as the parent of the children it starts (they inherit os.environ), and bind every child it
    forks the same way. A second call in a bound process only arms the kernel's signal (when
    ``kernel``).

    ``kernel=False``: the parent started this process from a thread other than its main thread
    (that thread may end first): only the parent-pid watch binds it."""
    global _hooked
    if _binding is not None:  # bound already (at import, or as a fork of a bound process)
        if kernel and _binding[0] == os.getppid():
            _arm_parent_death_signal(sig)
        return
    expected = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    if not _hooked:
        _hooked = True
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _bind(expected, sig, kernel=kernel)


def orphaned() -> bool:
    """Whether this process is bound (:func:`die_with_parent`) and its parent is gone."""
    return _binding is not None and os.getppid() != _binding[0]


def _bind(parent: int, sig: signal.Signals, *, kernel: bool) -> None:
    global _binding
    _binding = (parent, sig)
    if kernel:
        _arm_parent_death_signal(sig)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
        return
    watch = threading.Thread(
        target=_watch_parent, args=(parent, sig), name="rlbatch-lifeline", daemon=True
    )
    watch.start()


def _before_fork() -> None:
    global _forking
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    """A forked child of a bound process: bound to the process that forked it, with the same
    signal (the kernel's only when the fork came from the main thread)."""
    if _binding is not None:
        pid, main_thread = _forking
        os.environ[PARENT_PID_ENV] = str(os.getpid())
        _bind(pid, _binding[1], kernel=main_thread)


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
