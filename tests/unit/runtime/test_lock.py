"""One run per directory: a live holder refuses a second launcher, naming it; a dead holder's
lock (gone pid on this host, not refreshed, or this same requeued scheduler job) is taken
over; release removes only our own lock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from rlbatch.runtime import lock
from rlbatch.runtime.lock import LOCK_NAME, RunLockedError, acquire

HOLD = """
import sys, time
from pathlib import Path
from rlbatch.runtime.lock import acquire
held = acquire([Path(sys.argv[1])], "run-a", None)
print("held", flush=True)
time.sleep(60)
"""


def test_live_holder_refuses_and_is_named(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError) as err:
            acquire([tmp_path], "run-b", None)
        message = str(err.value)
        assert f"host {socket.gethostname()}, pid {holder.pid}, started 20" in message
        assert "(run id run-a)" in message
        body = json.loads((tmp_path / LOCK_NAME).read_text())
        assert body["pid"] == holder.pid  # untouched by the refused launcher
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: its lock is stale and taken over
    with acquire([tmp_path], "run-b", None) as held:
        assert json.loads(held.paths[0].read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_stale_by_age_and_same_job(tmp_path):
    other_host = {"host": "elsewhere", "pid": 1, "started": "then", "job": "slurm-7"}
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(other_host))
    with pytest.raises(RunLockedError, match="host elsewhere, pid 1"):
        acquire([tmp_path], None, "slurm-8")
    with acquire([tmp_path], None, "slurm-7"):  # the same job, requeued
        pass
    path.write_text(json.dumps(other_host))
    old = time.time() - lock.STALE_S - 5
    os.utime(path, (old, old))
    with acquire([tmp_path], None, None):  # not refreshed for STALE_S: its holder is gone
        pass


def test_both_directories_or_none(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(RunLockedError):
        acquire([run_dir, ckpt], None, None)
    assert not (run_dir / LOCK_NAME).exists()  # the lock already taken is released


def _dead_holder(path, token):
    """A lock left by a launcher of this host that is gone (its pid ended), run id run-a."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    body = {"host": socket.gethostname(), "pid": int(ended.stdout), "started": "then",
            "run_id": "run-a", "token": token}  # fmt: skip
    path.write_text(json.dumps(body))


def _process_of_run(token, seconds):
    env = {**os.environ, lock.RUN_ENV: token}
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], env=env)


def test_dead_holder_whose_run_still_has_a_process_is_not_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "SURVIVOR_WAIT_S", 1.0)
    token = "a" * 32
    _dead_holder(tmp_path / LOCK_NAME, token)
    survivor = _process_of_run(token, 60)
    try:
        with pytest.raises(RunLockedError) as err:
            acquire([tmp_path], "run-b", None)
        message = str(err.value)
        assert "run id run-a" in message and f"kill -9 {survivor.pid}" in message
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == token  # untouched
    finally:
        survivor.kill()
        survivor.wait()
    with acquire([tmp_path], "run-b", None) as held:  # nothing of run-a is left
        body = json.loads(held.paths[0].read_text())
        assert body["pid"] == os.getpid() and body["token"] == held.token != token
        assert os.environ[lock.RUN_ENV] == held.token  # inherited by what the launcher starts
    assert lock.RUN_ENV not in os.environ


def test_dead_holder_is_taken_over_once_its_last_process_ended(tmp_path):
    token = "b" * 32
    _dead_holder(tmp_path / LOCK_NAME, token)
    ending = _process_of_run(token, 1.0)
    with acquire([tmp_path], "run-b", None):
        assert ending.poll() is not None  # the takeover waited for it


def test_an_empty_lock_is_its_holders_instant_of_writing_until_it_is_old(tmp_path):
    """A launcher creates its lock, then writes it: a second one that reads it in between is
    refused (the lock is being taken), not told the lock is torn and free; an empty lock older
    than that instant (its writer died in it) is taken over."""
    path = tmp_path / LOCK_NAME
    path.write_text("")
    with pytest.raises(RunLockedError, match="being taken by another rlbatch launcher"):
        acquire([tmp_path], None, None)
    old = time.time() - lock.TORN_LIVE_S - 1
    os.utime(path, (old, old))
    with acquire([tmp_path], None, None) as held:
        assert json.loads(held.paths[0].read_text())["pid"] == os.getpid()
