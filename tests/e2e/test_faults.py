"""Faults a cluster causes, through the real rlbatch-train: damaged checkpoints (fallback,
none intact), resume with changed keys (refused before launch, or applied), hung workers and
reward calls at dp1 and dp2 (named; the failing rank's own error; no markup read; no error of an
earlier run), user code that exits, and a sweep whose first job fails."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

COMMON = ["+recipe=grpo_qwen", "logging.tensorboard=false"]


def _train(bin_dir, env, *args, flags=(), timeout=400):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), *flags, *COMMON, *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    timing = ("_s", "_seconds", "seconds", "memory_gb")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.endswith(timing) or "per_s" in k)} for r in rows]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_damaged_checkpoints_and_resume_compatibility(bin_dir, subprocess_env, tmp_path):
    run_dir = tmp_path / "run"
    common = ["trainer.max_steps=4", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}"]
    first = _train(bin_dir, subprocess_env, *common)
    assert first.returncode == 0, first.stderr[-3000:]
    # an ordinary run (the default recipe, periodic checkpoints) prints no warning; this run
    # doubles as that check instead of a launch of its own
    assert "warning" not in (first.stdout + first.stderr).lower(), first.stderr[-3000:]
    expected = _metrics(run_dir)
    # garbage inside a shard of the newest checkpoint (same size: only the checksum sees it)
    shard = sorted((run_dir / "checkpoints" / "step_00000004" / "model_optim").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    resumed = _train(bin_dir, subprocess_env, *common, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = _flat(resumed.stdout + resumed.stderr)
    assert (
        f"skipped damaged checkpoint(s) step_00000004: model_optim/{shard.name} is corrupt" in out
    )
    assert "resuming from step_00000002, the newest intact one" in out
    assert _metrics(run_dir) == expected  # steps 3 and 4 again, bit-exact

    # keys that may not change: one error per key (old and new), before anything is launched
    refused = _train(bin_dir, subprocess_env, *common, "trainer.resume=auto", "trainer.seed=7",
                     "grpo.num_generations=4", "model.hidden_size=128")  # fmt: skip
    assert refused.returncode == 2  # a configuration error: no worker started
    assert _metrics(run_dir) == expected  # nothing trained, nothing appended
    err = _flat(refused.stderr)
    assert "3 configuration error(s)" in err and "Traceback" not in err
    for key, new, old in (("trainer.seed", 7, 1234), ("grpo.num_generations", 4, 8),
                          ("model.hidden_size", 128, 64)):  # fmt: skip
        assert f"{key}={new}: was {old} in {run_dir / 'checkpoints' / 'step_00000004'}" in err

    # a changed learning rate takes effect (constant schedule: the next steps use it)
    longer = ["trainer.max_steps=6", "trainer.checkpoint.every_steps=2", f"hydra.run.dir={run_dir}"]
    lr = _train(bin_dir, subprocess_env, *longer, "trainer.resume=auto", "trainer.optim.lr=0.05")
    assert lr.returncode == 0, lr.stderr[-3000:]
    out = _flat(lr.stdout + lr.stderr)
    assert "trainer.optim.lr: 0.003 -> 0.05" in out
    assert "trainer.optim.lr changed on resume: 0.003 -> 0.05, applied to the optimizer" in out
    assert [r["lr"] for r in _metrics(run_dir)] == [0.003] * 4 + [0.05] * 2

    # no intact checkpoint at all: an error listing them; nothing deleted, nothing started
    for meta in (run_dir / "checkpoints").glob("step_*/meta.json"):
        meta.write_text("{")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    none = _train(bin_dir, subprocess_env, *longer, "trainer.resume=auto")
    assert none.returncode == 2
    err = _flat(none.stderr)
    assert "none is intact: step_00000006 (meta.json" in err and "step_00000004 (meta.json" in err
    assert "trainer.resume=none" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


HANG = """
import os, time

def r(completion):
    if os.environ["RANK"] == os.environ["HANG_RANK"] and os.path.exists(os.environ["AFTER"]):
        if os.environ["HOW"] == "raise":
            raise RuntimeError("bad [/red] input [bold]x")
        time.sleep(3600)
    return float(len(completion))
"""


def test_hangs_are_named_and_the_report_is_the_failing_ranks_own(bin_dir, subprocess_env, tmp_path):
    (tmp_path / "hang.py").write_text(HANG)
    fn = f"data.reward_fn=[{tmp_path / 'hang.py'}:r]"

    def run(run_dir, dp, how, *extra):
        """(launcher's stderr, flattened; the failing rank's own report file). A hang that went
        undetected would run into the subprocess timeout: no wall-clock bound of our own here
        (shared CI machines are noisy), the reports say which bound fired."""
        env = {**subprocess_env, "HANG_RANK": str(dp - 1), "HOW": how,
               "AFTER": str(run_dir / "metrics.jsonl")}  # fmt: skip
        proc = _train(bin_dir, env, fn, f"parallel.dp={dp}", "trainer.max_steps=50",
                      f"hydra.run.dir={run_dir}", *extra, timeout=300)  # fmt: skip
        assert proc.returncode not in (0, 75), proc.stderr[-3000:]
        report = (run_dir / "errors" / f"rank{dp - 1}.txt").read_text()
        return _flat(proc.stderr), _flat(report)

    # dp1: a reward call that never returns, bounded by data.reward_timeout_s
    err, report = run(tmp_path / "dp1", 1, "hang", "data.reward_timeout_s=4")
    assert "rank0 failed first" in err and "rank 0: HangError: no progress for" in err
    assert "at step 2 (batch, in reward function" in report
    assert "hang.py:r): over its own bound (4 s" in report and "time.sleep(3600)" in report

    # dp2: rank 1's reward raises a message full of markup: shown verbatim, rank 1's own
    err, report = run(tmp_path / "dp2", 2, "raise")
    assert "rank1 failed first" in err and "bad [/red] input [bold]x" in err
    assert "RewardCallError: reward function" in report and report.startswith("rank 1: ")

    # the same directory again, rank 1 hangs: its own hang is shown, not rank 0's wait and not
    # the previous run's error
    err, report = run(tmp_path / "dp2", 2, "hang", "trainer.timeout_s=30")
    assert "rank1 failed first" in err and "rank 1: HangError: no progress for" in err
    assert "in reward function" in report and "bad [/red]" not in err


EXITS = """
import os, sys

def by_sys_exit(completion):
    sys.exit(0)

def by_os_exit(completion):
    os._exit(0)
"""


def test_reward_exits_are_failures_naming_the_function(bin_dir, subprocess_env, tmp_path):
    (tmp_path / "exits.py").write_text(EXITS)
    for name, message in (
        ("by_sys_exit", f"{tmp_path / 'exits.py'}:by_sys_exit called sys.exit(0) on sample 0"),
        ("by_os_exit", "workers exited with code 0 before the run finished (rank 0: last seen "
         f"at step 1 (batch, in reward function {tmp_path / 'exits.py'}:by_os_exit))"),
    ):  # fmt: skip
        proc = _train(bin_dir, subprocess_env, f"data.reward_fn=[{tmp_path / 'exits.py'}:{name}]",
                      "trainer.max_steps=2", f"hydra.run.dir={tmp_path / name}")  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert message in _flat(proc.stderr), proc.stderr[-3000:]
        if name == "by_os_exit":  # the exact command that continues this run, not a hint
            cont = _flat(proc.stderr).split("Continue this run with:", 1)[-1]
            assert f"hydra.run.dir={tmp_path / name}" in cont and "trainer.resume=auto" in cont


def test_failing_sweep_job_does_not_stop_the_sweep(bin_dir, subprocess_env, tmp_path):
    sweep = tmp_path / "sweep"
    proc = _train(bin_dir, subprocess_env, "trainer.max_steps=2", f"hydra.sweep.dir={sweep}",
                  "debug.fail_at_step=1,null", flags=("-m",))  # fmt: skip
    assert proc.returncode == 1
    err = _flat(proc.stderr)
    assert "injected failure" in err
    assert f"FAILED (exit 1) │ {sweep / '0'}" in err and f"ok │ {sweep / '1'}" in err
    assert "1 of 2 job(s) failed: 0" in err
    assert len(_metrics(sweep / "1")) == 2


def test_everything_checkable_is_refused_before_launch(bin_dir, subprocess_env, tmp_path):
    proc = _train(bin_dir, subprocess_env, "parallel.backend=nccl",
                  "rollout.backend=megatron_dynamic", "trainer.optim.lr=nan", "data.source=jsonl",
                  f"data.path={tmp_path}", "data.reward=exact_match",
                  f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    err = _flat(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    for line in (
        "parallel.backend=nccl: needs CUDA, which this machine lacks: use parallel.backend=auto",
        "rollout.backend=megatron_dynamic: needs CUDA",
        "trainer.optim.lr=nan: must be a finite number",
        f"data.path={tmp_path}: is a directory",
    ):
        assert line in err, err[-3000:]
    assert not (tmp_path / "run" / "resolved.yaml").exists()  # nothing was launched
    chat, empty = tmp_path / "chat.jsonl", tmp_path / "empty.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}))
    empty.write_text("\n".join(json.dumps({"prompt": " ", "answer": str(i)}) for i in range(3)))
    for path, line in (
        (chat, "data.chat_template=none: 1 prompt(s) are chat messages (line 1...): set"),
        (empty, "data.prompt_key=prompt: every one of the 3 prompts is empty"),
    ):
        proc = _train(bin_dir, subprocess_env, "data.source=jsonl", f"data.path={path}",
                      "data.reward=exact_match", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
        assert proc.returncode == 2 and line in _flat(proc.stderr), proc.stderr[-3000:]
        assert not (tmp_path / "run" / "resolved.yaml").exists()
