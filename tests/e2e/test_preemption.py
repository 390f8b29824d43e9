"""What a cluster does to a run, through the real rlbatch-train: SIGTERM / SIGUSR1 / SIGHUP (to
the launcher, or to every process of the run) save a checkpoint at the end of the step and exit
75 with one line naming the step; resume=auto then continues bit-exactly (dp1 and dp2). A second
launcher on the same directory is refused naming the holder; a stale lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from processes import processes_of

pytestmark = pytest.mark.e2e

STEPS = 8
COMMON = ["+recipe=grpo_qwen", f"trainer.max_steps={STEPS}", "trainer.checkpoint.every_steps=0",
          "trainer.checkpoint.every_minutes=0", "logging.tensorboard=false"]  # fmt: skip


def _is_timing(key):
    return key.endswith(("_s", "_seconds", "seconds", "memory_gb")) or "per_s" in key


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not _is_timing(k)} for x in lines]


def _rows(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _train(bin_dir, env, *args, timeout=400):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), *COMMON, *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(bin_dir, subprocess_env, tmp_path_factory):
    """Uninterrupted runs, one per dp size."""
    out = {}
    for dp in (1, 2):
        run_dir = tmp_path_factory.mktemp("ref") / f"dp{dp}"
        proc = _train(bin_dir, subprocess_env, f"parallel.dp={dp}", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[dp] = _metrics(run_dir)
    return out


@pytest.mark.parametrize(
    "sig,dp,target,resume",
    [
        ("SIGTERM", 1, "launcher", True),
        ("SIGUSR1", 2, "launcher", True),
        ("SIGHUP", 1, "every_process", False),
        ("SIGTERM", 2, "every_process", False),
    ],
)
def test_preemption_saves_then_resume_is_exact(
    bin_dir, subprocess_env, tmp_path, reference, sig, dp, target, resume
):
    run_dir = tmp_path / "run"
    args = [
        str(bin_dir / "rlbatch-train"),
        *COMMON,
        f"parallel.dp={dp}",
        f"hydra.run.dir={run_dir}",
    ]
    launcher = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env
    )
    deadline = time.monotonic() + 300
    if resume and dp == 1:  # one run per directory: a second launcher is refused
        # while the run starts (its lock is taken first): on a quiet machine a run of this size
        # trains its remaining steps in the seconds a refused launcher takes
        while not (run_dir / "rlbatch.lock").exists() and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            time.sleep(0.05)
        second = _train(bin_dir, subprocess_env, f"hydra.run.dir={run_dir}", timeout=60)
        assert second.returncode == 3
        holder = f"host {socket.gethostname()}, pid {launcher.pid}, started"
        assert holder in " ".join(second.stderr.split()), second.stderr[-2000:]
    while _rows(run_dir) < 2 and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    targets = [launcher.pid] if target == "launcher" else list(processes_of(run_dir))
    assert len(targets) >= (1 if target == "launcher" else 2 + dp)
    for pid in targets:
        os.kill(pid, getattr(signal, sig))
    out, err = launcher.communicate(timeout=200)
    assert launcher.returncode == 75, err[-3000:]
    saved = _rows(run_dir)
    assert 2 <= saved < STEPS
    line = f"saved step {saved} at {run_dir / 'checkpoints' / f'step_{saved:08d}'}; exit code 75"
    assert line in err, err[-3000:]
    assert f"preempted ({sig if target == 'launcher' else 'SIG'}" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{saved:08d}"]
    assert not (run_dir / "rlbatch.lock").exists()
    if not resume:
        return
    if dp == 1:  # a lock left by a dead launcher on this host is taken over with a warning
        (run_dir / "rlbatch.lock").write_text(
            json.dumps({"host": socket.gethostname(), "pid": 2**22 - 3, "started": "then"})
        )
    resumed = _train(bin_dir, subprocess_env, f"parallel.dp={dp}", f"hydra.run.dir={run_dir}",
                     "trainer.resume=auto")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if dp == 1:
        assert "taking over the stale lock" in resumed.stdout + resumed.stderr
    assert _metrics(run_dir) == reference[dp]


LATE_SIGNALS = '''
"""Imported by every Python process of the run (PYTHONPATH): each rank worker gets SIGUSR1,
SIGTERM and SIGHUP while its interpreter shuts down, after Python dropped its own handlers, and
torchrun (which ends with os._exit, no shutdown) as it exits: where a copy forwarded late by a
loaded launcher or torchrun lands."""
import os, signal, sys
def _late_signals(kill=os.kill, open_=open, join=os.path.join,
                  marks=os.environ["LATE_SIGNAL_MARKS"],
                  sigs=(signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP)):
    pid = os.getpid()
    open_(join(marks, str(pid)), "w").close()
    for sig in sigs:
        kill(pid, sig)
class _Late:
    def __del__(self, late=_late_signals):
        late()
if "rlbatch.runtime.worker" in sys.orig_argv:
    _late = _Late()
if "rlbatch.runtime.torchrun" in sys.orig_argv:
    def _exit(code, real=os._exit, late=_late_signals):
        late()
        real(code)
    os._exit = _exit
'''


@pytest.mark.parametrize("dp,preempted", [(2, True), (1, False)])
def test_a_late_signal_while_the_run_exits_keeps_its_exit_code(
    bin_dir, subprocess_env, tmp_path, dp, preempted
):
    """Every process of the run gets a preemption signal while it exits (deterministically: at
    its interpreter's shutdown). A preempted run still exits 75 with its saved step, a finished
    one 0: before, each worker died of the late signal (torchrun: 'exitcode: -10') and the run
    read as failed."""
    hook, marks, run_dir = tmp_path / "hook", tmp_path / "marks", tmp_path / "run"
    hook.mkdir(), marks.mkdir()
    (hook / "sitecustomize.py").write_text(LATE_SIGNALS)
    path = os.pathsep.join(filter(None, [str(hook), subprocess_env.get("PYTHONPATH")]))
    env = {**subprocess_env, "PYTHONPATH": path, "LATE_SIGNAL_MARKS": str(marks)}
    steps = STEPS if preempted else 2
    args = [*COMMON, f"trainer.max_steps={steps}", f"parallel.dp={dp}", f"hydra.run.dir={run_dir}"]
    launcher = subprocess.Popen(
        [str(bin_dir / "rlbatch-train"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while preempted and _rows(run_dir) < 2 and launcher.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    if preempted:
        launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=300)
    assert len(list(marks.iterdir())) == 1 + dp  # torchrun and every rank got the late signals
    assert "exitcode" not in err, err[-3000:]
    if not preempted:
        assert launcher.returncode == 0, err[-3000:]
        assert _rows(run_dir) == steps
        return
    assert launcher.returncode == 75, err[-3000:]
    saved = _rows(run_dir)
    assert f"preempted (SIGTERM): saved step {saved} at " in err, err[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{saved:08d}"]
