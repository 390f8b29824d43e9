"""Driver -> torchrun -> worker with real gloo processes: a normal run, a crashed rank, a killed
rank and Ctrl-C all end promptly, stop every worker, and name the failing rank."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.e2e

LAUNCH = """
import sys
from pathlib import Path
from rlbatch.cli.common import compose
from rlbatch.runtime.driver import launch
cfg = compose(sys.argv[2:], "test")
sys.exit(launch(cfg, Path(sys.argv[1]), entry="rlbatch.runtime.selftest:run"))
"""


def _start(run_dir, overrides, env):
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(run_dir), "parallel.dp=2", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _leftover_workers(run_dir) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_workers_run_with_resolved_config(tmp_path, subprocess_env):
    proc = _start(tmp_path / "run", [], subprocess_env)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    report = json.loads((tmp_path / "run" / "selftest.json").read_text())
    assert report == {**report, "world_size": 2, "rank_sum": 1.0}
    assert (tmp_path / "run" / "resolved.yaml").is_file()


@pytest.mark.parametrize("kind", ["raise_error", "kill"])
def test_failed_rank_stops_everyone_and_is_named(tmp_path, subprocess_env, kind):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = _start(
        run_dir,
        [
            "debug.fail_at_step=1",
            "debug.fail_rank=1",
            f"debug.fail_kind={kind}",
            "trainer.timeout_s=60",
        ],
        subprocess_env,
    )
    out, err = proc.communicate(timeout=180)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    if kind == "raise_error":
        assert "injected failure on rank 1" in err
        assert "rank1 failed first" in err
    assert "Traceback (most recent call last)" not in err.split("full reports")[0][:200]
    assert elapsed < 60, f"took {elapsed:.0f} s to stop"
    assert not _leftover_workers(run_dir)


def test_ctrl_c_stops_every_worker(tmp_path, subprocess_env):
    run_dir = tmp_path / "run"
    proc = _start(
        run_dir,
        ["debug.fail_at_step=1", "debug.fail_rank=1", "debug.fail_kind=hang"],
        subprocess_env,
    )
    deadline = time.monotonic() + 120
    while len(_leftover_workers(run_dir)) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # driver's torchrun + 2 workers are up
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    proc.communicate(timeout=60)
    assert time.monotonic() - stopped < 20
    assert proc.returncode == 130
    time.sleep(1)
    assert not _leftover_workers(run_dir)
