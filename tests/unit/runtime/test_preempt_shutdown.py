"""A preemption signal that reaches a process of the run while it shuts down must not end it by
that signal: its exit code (75 after a preemption save) is what the launcher and a scheduler
read. Python drops its own signal handlers early in interpreter shutdown, so without
preempt.ignore a late copy ends the process by the signal's default action."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

CHILD = """
import os, signal, sys
from rlbatch.runtime import preempt
preempt.install()
class Late:  # destroyed at interpreter shutdown, after Python has dropped its signal handlers
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=int(sys.argv[1])):
        kill(pid, sig)
late = Late()
os.kill(os.getpid(), int(sys.argv[1]))  # the request itself: recorded, not fatal
assert preempt.requested() == signal.Signals(int(sys.argv[1])).name
if sys.argv[2] == "ignore":
    preempt.ignore()
sys.exit(75)
"""


def _exit_code(sig: signal.Signals, mode: str) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(int(sig)), mode], capture_output=True, timeout=60
    )
    assert b"Error" not in proc.stderr, proc.stderr.decode()
    return proc.returncode


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP])
def test_a_late_signal_during_shutdown_keeps_the_exit_code(sig):
    assert _exit_code(sig, "ignore") == 75
    # without it, the same late copy ends the process by the signal: what torchrun reported as
    # a worker's exit -10 after a preemption save
    assert _exit_code(sig, "keep") == -sig
