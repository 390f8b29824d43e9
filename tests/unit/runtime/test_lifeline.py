"""A process bound with die_with_parent ends when its parent dies: by the kernel's parent-death
signal, by the parent-pid watch alone (platforms without PR_SET_PDEATHSIG), and at once when its
parent was already gone before it could arm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = """
import signal, sys, time
import rlbatch.runtime.lifeline as lifeline
if sys.argv[1] == "watch_only":
    lifeline._arm_parent_death_signal = lambda sig: None
lifeline.die_with_parent(signal.SIGKILL)
print("armed", flush=True)
time.sleep(60)
"""

PARENT = """
import os, subprocess, sys, time
from rlbatch.runtime.lifeline import child_env
child = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], sys.argv[2]],
    env=child_env(dict(os.environ)), stdout=subprocess.PIPE, text=True,
)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("mode", ["pdeathsig", "watch_only"])
def test_child_ends_within_a_second_of_its_parent(mode):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, mode], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    while _alive(child) and time.monotonic() - killed < 5:
        time.sleep(0.02)
    took = time.monotonic() - killed
    if _alive(child):
        os.kill(child, signal.SIGKILL)
    assert took < 2.0, f"{mode}: the child outlived its parent by {took:.1f} s"


def test_child_whose_parent_already_died_stops_at_once():
    env = {**os.environ, "RLBATCH_PARENT_PID": "1"}  # not the real parent: it "died" meanwhile
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, "pdeathsig"], env=env, capture_output=True, timeout=30
    )
    assert proc.returncode == -signal.SIGKILL and b"armed" not in proc.stdout


RELAY = """
import os, subprocess, sys, time
from rlbatch.runtime.lifeline import child_env
child = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], sys.argv[2]],
    env=child_env(dict(os.environ)), stdout=subprocess.PIPE, text=True,
)
print(child.stdout.readline().strip(), flush=True)  # the pid of the child's fork
time.sleep(60)
"""

FORKING_CHILD = """
import os, signal, sys, threading, time
import rlbatch.runtime.lifeline as lifeline
from rlbatch.runtime import preempt
lifeline.die_with_parent(signal.SIGKILL)
preempt.install()  # the fork inherits the handler: it records SIGTERM, not SIGKILL
def fork():
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
if sys.argv[1] == "thread":  # the kernel's signal would follow the thread: the watch binds it
    threading.Thread(target=fork).start()
else:
    fork()
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("where", ["main_thread", "thread"])
def test_a_fork_of_a_bound_process_ends_with_it(where):
    """A forked child (megatron's checkpoint writer, a reward's pool) of a bound process is
    bound to it: when the bound process dies (its own parent was killed), the fork follows."""
    parent = subprocess.Popen(
        [sys.executable, "-c", RELAY, FORKING_CHILD, where], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    fork = int(parent.stdout.readline())
    assert _alive(fork)
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    while _alive(fork) and time.monotonic() - killed < 5:
        time.sleep(0.02)
    took = time.monotonic() - killed
    if _alive(fork):
        os.kill(fork, signal.SIGKILL)
    assert took < 2.0, f"{where}: the fork outlived its parent by {took:.1f} s"
