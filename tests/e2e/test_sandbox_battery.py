"""The reward-hacking battery (tests/sandbox_battery.py) through rlbatch-score, as root and as
an unprivileged user: every hostile program scores 0 with the reason it must fail with, the
honest answers around them score 1 (correct programs returning standard-library values and
their own types, tested with asserts, unittest or pytest-style functions), the command carries
on, and no process of any execution outlives it. The dataset itself (the battery, with every
test's expected output) lies in a world-readable file, where a program that could see the
machine's files would find it.

Stub programs against weak tests: rlbatch-score names the rows a stub passes, and rlbatch-train
warns before launch, with counts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rlbatch.rewards.sandbox_plan import cgroup_kind
from sandbox_battery import (
    ASSERTS,
    CASES,
    as_unprivileged,
    battery,
    correct_programs,
    hacks_of_test_code,
    honest,
    leftover_sandbox_processes,
)

pytestmark = pytest.mark.e2e

LIMITS = [
    "data.code_exec.limits.cpu_s=1", "data.code_exec.limits.wall_s=5",
    "data.code_exec.limits.memory_mb=256", "data.code_exec.limits.file_size_mb=1",
]  # fmt: skip


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_reward_hacks_score_zero_through_rlbatch_score(user, bin_dir, subprocess_env):
    if os.geteuid() != 0:
        pytest.fail("the battery runs as root (CI does) so that it can also drop to nobody")
    work = Path(tempfile.mkdtemp(prefix="rlbatch-battery-", dir="/tmp"))
    try:
        os.chmod(work, 0o777)
        as_root = user == "root"
        hacks = battery(memory_cgroup=as_root and cgroup_kind()[0] != "none", as_root=as_root)
        hacks += hacks_of_test_code()
        good = honest() + correct_programs()
        rows = [h.row() for h in hacks] + good
        data = work / "battery.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.chmod(data, 0o644)
        command = [str(bin_dir / "rlbatch-score"), "+recipe=grpo_code", *LIMITS,
                   f"score.input={data}", f"score.output={work / 'out.jsonl'}",
                   "score.stubs=false"]  # fmt: skip
        if user != "root":
            command = as_unprivileged(command)
        env = {**subprocess_env, "HOME": str(work)}
        proc = subprocess.run(command, capture_output=True, text=True, cwd=work, env=env,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines()]
        assert len(out) == len(rows)
        for hack, scored in zip(hacks, out, strict=False):
            reasons = {f["reason"] for f in scored["failures"]}
            assert scored["reward"] == 0.0, (hack.name, hack.why, scored)
            assert reasons == {hack.reason}, (hack.name, hack.why, scored["failures"])
        wrong = [(row["prompt"], r["failures"]) for row, r in zip(good, out[len(hacks) :],
                 strict=True) if r["reward"] != 1.0]  # fmt: skip
        assert wrong == []
        assert leftover_sandbox_processes(work) == []
        assert not Path("/tmp/fill").exists() and not Path("/dev/shm/fill").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)


WEAK = [
    # (row fields, a correct completion, the stubs that earn a reward on it, worked out by hand)
    ({"test_code": "assert square(3) is not None"}, "def square(x):\n    return x * x",
     {"returns NaN": 1.0, "returns an opaque object": 1.0, "echoes its input": 1.0}),
    ({"test_code": "assert all(map(is_even, [2, 4]))"}, "def is_even(x):\n    return x % 2 == 0",
     {"returns NaN": 1.0, "echoes its input": 1.0}),
    ({"tests": [{"input": "abc\n", "output": "cba\n"}, {"input": "aba\n", "output": "aba\n"}]},
     "print(input()[::-1])", {"echoes its input": 0.5}),
    ({"tests": [{"input": "5\n", "output": ""}]}, "input()", {"prints nothing": 1.0}),
    ({"test_code": ASSERTS}, "def add(a, b):\n    return a + b", {}),
    ({"tests": CASES}, "a, b = map(int, input().split())\nprint(a + b)", {}),
]  # fmt: skip
"""Rows whose tests a stub program passes (or partly passes), and two that no stub passes."""


def _weak_rows(path: Path) -> Path:
    rows = [{"prompt": f"task {i}", "answer": "", "completion": f"```python\n{program}\n```",
             **fields} for i, (fields, program, _) in enumerate(WEAK)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rlbatch_score_names_the_rows_a_stub_passes(bin_dir, subprocess_env, tmp_path):
    data = _weak_rows(tmp_path / "weak.jsonl")
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-score"), "+recipe=grpo_code", *LIMITS, f"score.input={data}",
         f"score.output={tmp_path / 'out.jsonl'}"],
        capture_output=True, text=True, cwd=tmp_path, env=subprocess_env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in out] == [1.0] * len(WEAK)  # the completions are correct
    assert [r["stubs"] for r in out] == [want for _, _, want in WEAK]
    said = proc.stdout
    assert "warning: stub programs pass the tests of 3 of 6 rows (line 1: returns NaN," in said
    assert "line 4: prints nothing)" in said
    assert "and earn part of the reward on 1 more (line 3: echoes its input 0.50)" in said
    assert leftover_sandbox_processes(tmp_path) == []


def test_rlbatch_train_warns_before_launch_with_counts(bin_dir, subprocess_env, tmp_path):
    """One short run: the warning is printed before launch, the run trains as asked."""
    data = _weak_rows(tmp_path / "weak.jsonl")
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "data=jsonl", f"data.path={data}",
         "data.reward=code_exec", *LIMITS, "data.code_exec.stub_check_rows=6", "model=tiny",
         "parallel.dp=1", "grpo.num_generations=2", "grpo.global_batch_size=8",
         "rollout.max_new_tokens=8", "trainer.max_steps=1", "logging.tensorboard=false",
         "hydra.run.dir=run"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env={**subprocess_env, "COLUMNS": "1000"},  # the warning on one line
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert (
        "rlbatch-train: warning: data.reward=code_exec: stub programs pass the tests of 3 of"
        in said
    )
    assert f"6 sampled rows of data.path={data} (line 1: returns NaN" in said
    assert "and earn part of the reward on 1 more (line 3: echoes its input 0.50)" in said
    assert "data.code_exec.stub_check_rows=6" in said
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    assert leftover_sandbox_processes(tmp_path) == []


LOOP = "i = 0\nwhile step(i) != 5:\n    i += 1"
"""Tests that loop for as long as a stub's answer is not 5: None and NaN keep them looping."""


def test_stub_check_is_bounded_and_runs_under_code_whole(bin_dir, subprocess_env, tmp_path):
    """data.code_exec.code=whole (the stubs are programs, not fenced completions) with generous
    limits: the stubs run and are found as under last_block, and the tests that loop on a
    stub's answer hold each stub execution seconds, not the whole limit."""
    rows = [
        {"prompt": "loop", "completion": "def step(i):\n    return i", "test_code": LOOP},
        {"prompt": "weak", "completion": "def square(x):\n    return x * x",
         "test_code": "assert square(3) is not None"},
    ]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"answer": "", **r}) + "\n" for r in rows))
    started = time.monotonic()
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-score"), "+recipe=grpo_code", "data.code_exec.code=whole",
         "data.code_exec.limits.cpu_s=120", "data.code_exec.limits.wall_s=120",
         f"score.input={data}", f"score.output={tmp_path / 'out.jsonl'}"],
        capture_output=True, text=True, cwd=tmp_path, env=subprocess_env, timeout=600,
    )  # fmt: skip
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in out] == [1.0, 1.0]
    assert [r["stubs"] for r in out] == [
        {"echoes its input": 1.0},  # step(i) == i reaches 5
        {"returns NaN": 1.0, "returns an opaque object": 1.0, "echoes its input": 1.0},
    ]
    # the two looping stubs of the first row would hold 120 s each (two workers: 120 s at least)
    assert took < 100, f"rlbatch-score took {took:.0f} s"
    assert leftover_sandbox_processes(tmp_path) == []
