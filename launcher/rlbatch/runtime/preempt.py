"""Preemption: SIGTERM, SIGUSR1 and SIGHUP ask the run to save and stop.

What a cluster sends before it takes the nodes away: SLURM sends SIGTERM at preemption and at
the time limit (SIGKILL follows after its KillWait), SIGUSR1 ahead of time with
``--signal=USR1@SECONDS``; a closed terminal or a lost ssh session sends SIGHUP. Each process of
a run reacts the same way:

- the launcher (rlbatch.runtime.driver) forwards the signal to its torchrun as SIGUSR1 and
  waits up to ``trainer.preempt_timeout_s`` for the workers to save and exit;
- torchrun (rlbatch.runtime.torchrun) forwards it to its workers as SIGUSR1 instead of killing
  them (it handles only SIGINT and SIGQUIT itself);
- a worker records the request (:func:`install`); at the end of each optimizer step the ranks
  agree in one collective whether any of them got one (the training loop), then all save a
  checkpoint and stop with :data:`EXIT_PREEMPTED`.

The signal may reach one process of the run or all of them (SLURM signals every task of a step,
``kill -TERM -- -PGID`` a group): any one rank's request stops all ranks at the same step.

A process of the run that is ending (its checkpoint saved, its run over, or failed) ignores these
signals from then on (:func:`ignore`): a copy forwarded late, or a scheduler's second signal,
must not turn a saved run's exit code 75 into a death by signal.

A process that outlived its parent (rlbatch.runtime.lifeline.orphaned: nothing is left to
coordinate a save with) dies of the signal instead, as an unhandled SIGTERM would end it; so
does a child it forked, which inherits the handler.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from rlbatch.runtime.lifeline import orphaned

EXIT_PREEMPTED = 75
"""Exit code of a run stopped by a preemption signal after saving (BSD sysexits' EX_TEMPFAIL:
"temporary failure, retry later"); the SLURM example requeues the job on it."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
"""The signals that ask a run to save and stop."""
FORWARD = signal.SIGUSR1
"""What the launcher and torchrun send on to their children (torchrun kills on SIGTERM)."""
RECORD = "preempted.json"
"""Written by rank 0 into the run directory: the step saved and the checkpoint path."""

_received: list[str] = []


class Preempted(Exception):
    """Raised by the training loop on every rank after the preemption checkpoint is saved."""

    def __init__(self, step: int, path: str, signal_name: str) -> None:
        super().__init__(f"preempted by {signal_name}: saved step {step} at {path}")
        self.step, self.path, self.signal_name = step, path, signal_name


def _record(signum: int, frame: Any) -> None:
    if orphaned():
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signal.Signals(signum).name)


def install() -> None:
    """Worker side: remember a preemption signal instead of dying of it."""
    for sig in SIGNALS:
        signal.signal(sig, _record)


def ignore() -> None:
    """This process is ending: ignore the preemption signals from now on.

    Each worker gets the same request more than once (directly from the cluster, and forwarded
    by the launcher and by torchrun, each a Python signal handler that may run late on a loaded
    machine), so a copy can arrive after the worker saved and while it exits. Python drops its
    own handlers early in interpreter shutdown (the default action is back, and for these
    signals it ends the process), and shutting down torch and megatron takes a while: a copy
    landing then would end the worker by that signal, torchrun would report exit -10 instead of
    75, and a saved run would read as failed (and a scheduler would not requeue it). SIG_IGN is
    left in place through the shutdown."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def requested() -> str | None:
    """The first preemption signal this process got (its name), or None."""
    return _received[0] if _received else None
