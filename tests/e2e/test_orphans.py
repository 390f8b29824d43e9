"""kill -9 of rlbatch-train (its whole process group, or the launcher process alone) stops
torchrun and every worker within 5 s: nothing keeps training into the run directory."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from processes import processes_of

pytestmark = pytest.mark.e2e

STOP_WITHIN_S = 5.0


def _processes_of(run_dir: Path) -> list[str]:
    return [f"{pid} {cmdline[:200]}" for pid, cmdline in processes_of(run_dir).items()]


def _rows(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _wait_for(condition, timeout_s: float, what: str) -> float:
    """Poll ``condition`` until true; return the seconds it took, fail after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("target", ["process_group", "launcher"])
def test_kill_9_of_launcher_stops_every_worker(bin_dir, subprocess_env, tmp_path, target):
    run_dir = tmp_path / "run"
    with open(tmp_path / "out.txt", "w") as out:
        launcher = subprocess.Popen(
            [
                str(bin_dir / "rlbatch-train"),
                "+recipe=grpo_qwen",
                "parallel.dp=2",
                "trainer.max_steps=100000",
                f"hydra.run.dir={run_dir}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=subprocess_env,
            start_new_session=True,  # its own process group, as a shell job has
        )
    try:
        _wait_for(lambda: _rows(run_dir) >= 2, 300, "two metrics rows")
        assert len(_processes_of(run_dir)) >= 4, "expected launcher, torchrun and 2 workers"
        killed = time.monotonic()
        if target == "process_group":
            os.killpg(launcher.pid, signal.SIGKILL)
        else:
            os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=5)
        took = _wait_for(
            lambda: not _processes_of(run_dir), STOP_WITHIN_S, "torchrun and workers stopped"
        )
        print(f"kill -9 of the {target}: every process gone {took:.2f} s after the kill")
        assert time.monotonic() - killed < STOP_WITHIN_S
        rows = _rows(run_dir)
        time.sleep(1.0)  # nothing is left that could write
        assert _rows(run_dir) == rows, "metrics.jsonl still grows after the kill"
    finally:
        for line in _processes_of(run_dir):
            os.kill(int(line.split()[0]), signal.SIGKILL)
