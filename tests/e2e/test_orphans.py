"""kill -9 of rlbatch-train (its whole process group, or the launcher process alone) stops
torchrun and every worker within 5 s: nothing keeps training into the run directory. At any
point of an async run (partial rollouts, multi-turn): start-up, the generation worker's
start, mid-step, a checkpoint being written, no process the run started survives (spawned and
forked children and multiprocessing's resource tracker included), and the next launch in the
directory (trainer.resume=auto) takes the dead run's lock over and goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from processes import processes_marked, processes_of

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


MARK = "RLBATCH_TEST_RUN_MARK"
"""Set in the launcher's environment only: every process of the run inherits it."""
REPEATS = int(os.environ.get("RLBATCH_ORPHAN_REPEATS", "1"))
"""Passes over the kill points (each pass a few launches); raise it to hunt for races."""
COMMON = (
    "trainer.max_steps=100000", "trainer.checkpoint.every_steps=1", "trainer.resume=auto",
    "trainer.checkpoint.export_hf=false", "trainer.num_threads=2", "logging.plot=false",
    "logging.tensorboard=false", "grpo.num_steps_async=1",
)  # fmt: skip
ASYNC_PARTIAL = (
    "+recipe=grpo_qwen", "grpo.max_staleness=3", "grpo.partial_rollouts=true",
    "grpo.consumption_granularity=group", "debug.response_length_median=5",
)  # fmt: skip
MULTI_TURN = (
    "+recipe=grpo_guess_number", "grpo.num_generations=4", "grpo.global_batch_size=16",
    "env.max_turns=2",
)  # fmt: skip


def _ranks(procs: dict[int, str]) -> int:
    """Processes running the rank worker's code: one per rank, plus a fork of it while
    megatron's checkpoint writer runs."""
    return sum(
        "-m rlbatch.runtime.worker --config" in cmd and "rlbatch.runtime.torchrun" not in cmd
        for cmd in procs.values()
    )


KILL_POINTS = {
    "start-up": lambda run_dir, procs, rows: _ranks(procs) >= 1,
    "generation worker start": lambda run_dir, procs, rows: any(
        "spawn_main" in cmd for cmd in procs.values()
    ),
    "mid-step": lambda run_dir, procs, rows: _rows(run_dir) > rows,
    "checkpoint write": lambda run_dir, procs, rows: _ranks(procs) >= 2,
}
"""When to kill, read from what the run shows: (run_dir, its processes, metrics rows at launch)."""


def _kill_at(bin_dir, env, run_dir: Path, recipe: tuple[str, ...], point: str) -> None:
    mark = uuid.uuid4().hex
    rows = _rows(run_dir)
    cmd = [str(bin_dir / "rlbatch-train"), *recipe, *COMMON, f"hydra.run.dir={run_dir}"]
    out_path = run_dir.parent / f"{run_dir.name}.out"
    with open(out_path, "a") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**env, MARK: mark}, start_new_session=True)  # fmt: skip
    try:
        reached = KILL_POINTS[point]
        deadline = time.monotonic() + 240
        while not reached(run_dir, procs := processes_marked(MARK, mark), rows):
            assert launcher.poll() is None, (
                f"{point}: the run ended first\n" + out_path.read_text()[-3000:]
            )
            assert time.monotonic() < deadline, f"{point}: not reached in 240 s"
            time.sleep(0.01)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=5)
        killed = time.monotonic()
        while (left := processes_marked(MARK, mark)) and time.monotonic() - killed < STOP_WITHIN_S:
            time.sleep(0.05)
        print(f"kill -9 at {point} ({len(procs)} processes): "
              f"{len(left)} left after {time.monotonic() - killed:.2f} s")  # fmt: skip
        assert not left, f"kill -9 at {point}: still alive after {STOP_WITHIN_S} s:\n" + "\n".join(
            f"{pid} {cmd[:160]}" for pid, cmd in left.items()
        )
    finally:
        for pid in processes_marked(MARK, mark):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, points",
    [
        (ASYNC_PARTIAL, list(KILL_POINTS)),
        (MULTI_TURN, ["mid-step"]),
    ],
    ids=["async_partial", "async_multi_turn"],
)
def test_kill_9_at_any_point_of_an_async_run_leaves_no_process(
    bin_dir, subprocess_env, tmp_path, recipe, points
):
    """Each launch resumes the previous one's directory (trainer.resume=auto) right after its
    kill: the dead run's lock is taken over, never beside a survivor."""
    run_dir = tmp_path / "run"
    for _ in range(REPEATS):
        for point in points:
            _kill_at(bin_dir, subprocess_env, run_dir, recipe, point)
    assert _rows(run_dir) > 0, "no launch got as far as a step"
