"""The reward-hacking battery (tests/sandbox_battery.py) through rlbatch-score, as root and as
an unprivileged user: every hostile program scores 0 with the reason it must fail with, the
honest answers around them score 1 (correct programs returning standard-library values and
their own types, tested with asserts, unittest or pytest-style functions), the command carries
on, and no process of any execution outlives it. The dataset itself (the battery, with every
test's expected output) lies in a world-readable file, where a program that could see the
machine's files would find it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rlbatch.rewards.sandbox_plan import cgroup_kind
from sandbox_battery import (
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
                   f"score.input={data}", f"score.output={work / 'out.jsonl'}"]  # fmt: skip
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
        assert leftover_sandbox_processes() == []
        assert not Path("/tmp/fill").exists() and not Path("/dev/shm/fill").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)
