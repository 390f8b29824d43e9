"""Rewards users bring, through the real commands.

- rlbatch-score feeds a battery of hostile programs to code_exec: each is contained (reward 0,
  the right reason), the command carries on, and nothing outside the sandbox changed.
- rlbatch-train runs the grpo_code recipe's CPU twin (one run, for CI time) with code_exec
  combined with a served HTTP reward (a real server on 127.0.0.1 that fails twice first), an
  LLM judge (a real OpenAI-compatible server) and a local reward model, weighted, the
  calculator environment's reward on top of them, generation running ahead in its worker.
- A bad setup (training or held-out rows without tests, a server answering garbage, a missing
  reward model) is stopped before launch, every error at once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from reward_servers import Judge, Scorer, save_tiny_reward_model
from rlbatch.rewards.sandbox import INIT
from sandbox_battery import leftover_sandbox_processes

pytestmark = pytest.mark.e2e

SECRET = "rlbatch-test-secret-7c1f"
# The recipe's documented CPU twin (its header comment), shortened to what CI affords.
TWIN = [
    "+recipe=grpo_code",
    "model=tiny",
    "parallel.dp=1",
    "grpo.num_generations=4",
    "grpo.global_batch_size=16",
    "data.max_prompt_len=320",
    "rollout.max_new_tokens=16",
    "batching.train.max_tokens=512",
    "batching.infer.max_tokens=1024",
    "logging.tensorboard=false",
]


def _run(bin_dir, command, env, cwd, *args, timeout=500):
    return subprocess.run(
        [str(bin_dir / command), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def _hostile(canary: Path, port: int) -> dict[str, tuple[str, str]]:
    """name -> (program, the reason it must fail with)."""
    return {
        "infinite loop": ("while True:\n    pass", "timeout"),
        "sleep forever": ("import time\ntime.sleep(600)", "timeout"),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "timeout",
        ),
        "memory bomb": ("x = []\nwhile True:\n    x.append(' ' * 10**7)", "memory"),
        "huge print": ("while True:\n    print('x' * 65536)", "output_limit"),
        "write outside scratch": (f"open({str(canary)!r}, 'w').write('pwned')", "crash"),
        "write to /etc": ("open('/etc/rlbatch_pwned', 'w').write('pwned')", "crash"),
        "open a socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
            "crash",
        ),
        "read the trainer's env": (
            "import os\nprint(os.environ.get('RLBATCH_SECRET', 'absent'))",
            "wrong_answer",
        ),
        "kill the parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "crash"),
        "kill its own group": ("import os, signal\nos.killpg(0, signal.SIGKILL)", "crash"),
        "delete visible files": (f"import os\nos.remove({str(INIT)!r})", "crash"),
        "syntax error": ("def f(:\n    pass", "syntax"),
    }


def test_hostile_programs_are_contained_and_scored_zero(bin_dir, subprocess_env, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    hostile = _hostile(canary, listener.getsockname()[1])
    rows = [
        {
            "prompt": name,
            "answer": "",
            "tests": [{"input": "", "output": SECRET}],
            "completion": f"```python\n{code}\n```",
        }
        for name, (code, _) in hostile.items()
    ]
    rows.append(
        {
            "prompt": "honest",
            "answer": "",
            "tests": [{"input": "", "output": SECRET}],
            "completion": f"print({SECRET!r})",
        }
    )
    source = tmp_path / "hostile.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**subprocess_env, "RLBATCH_SECRET": SECRET}
    before = INIT.read_bytes()
    proc = _run(
        bin_dir, "rlbatch-score", env, tmp_path,
        "+recipe=grpo_code", "data.code_exec.limits.cpu_s=1", "data.code_exec.limits.wall_s=3",
        "data.code_exec.limits.memory_mb=256", "data.code_exec.limits.file_size_mb=1",
        f"score.input={source}", "score.output=out.jsonl", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in out] == list(range(len(rows)))
    for r, (name, (_, reason)) in zip(out, hostile.items(), strict=False):
        assert r["reward"] == 0.0, name
        assert [f["reason"] for f in r["failures"]] == [reason], (name, r["failures"])
    assert out[-1]["reward"] == 1.0 and out[-1]["failures"] == []  # the run carried on
    # nothing outside the sandbox changed
    assert canary.read_text() == "untouched"
    assert not Path("/etc/rlbatch_pwned").exists()
    assert INIT.read_bytes() == before
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection ever arrived
    listener.close()
    assert leftover_sandbox_processes(tmp_path) == []
    leak = out[list(hostile).index("read the trainer's env")]["failures"][0]["detail"]
    assert leak.endswith("got 'absent\\n'"), leak  # the variable never reached the program


@pytest.mark.slow
def test_code_recipe_twin_with_served_rewards_an_environment_and_run_ahead(
    bin_dir, subprocess_env, tmp_path
):
    """One run (CI time): code_exec + http (a server failing twice first) + judge + reward model,
    weighted, with the calculator environment's reward on top and generation running ahead."""
    save_tiny_reward_model(tmp_path / "rm")
    with Scorer(fail_first=2) as server, Judge() as judge:
        proc = _run(
            bin_dir, "rlbatch-train", subprocess_env, tmp_path, *TWIN,
            # the code recipe's qwen chat template wraps a tool turn in more tokens than the
            # calculator's own limit (made for the plain template): room for the wrapper
            "env=calculator", "env.max_total_tokens=400", "env.max_observation_tokens=96",
            "data.reward_fn=[code_exec,http,judge,reward_model]",
            "data.reward_weights=[1.0,0.5,0.25,0.1]",
            f"data.reward_url={server.url}/score", f"data.judge.url={judge.url}",
            "data.served.backoff_s=0.05",
            f"data.reward_model={tmp_path / 'rm'}", "data.reward_model_batching.max_length=1024",
            "grpo.num_steps_async=1", "grpo.max_staleness=1",
            "logging.samples=true", "trainer.max_steps=2", "hydra.run.dir=run",
        )  # fmt: skip
        answered, failures_sent = list(server.answered), server.failures_sent
        scores = list(judge.scores)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert failures_sent == 2  # the check's first two requests failed and were retried
    run_dir = tmp_path / "run"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["staleness_mean"] > 0  # step 2 trained on samples generated ahead
    weights = {"code_exec": 1.0, "http": 0.5, "judge": 0.25, "reward_model": 0.1, "env": 1.0}
    samples = []
    for r in records:
        name = f"samples/step_{r['step']:05d}.jsonl"
        step = [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
        samples += step
        for s in step:  # the environment's reward plus the weighted brought ones
            total = sum(w * s["reward_parts"][k] for k, w in weights.items())
            assert s["reward"] == pytest.approx(total, abs=1e-6)
        for k in ("code_exec", "http", "judge", "reward_model"):
            mean = sum(s["reward_parts"][k] for s in step) / len(step)
            assert r[f"reward/{k}_mean"] == pytest.approx(mean, abs=1e-6)
        # per-reason counts are the failures listed in the step's logged samples
        for reason in ("syntax", "wrong_answer", "timeout", "crash", "served_error"):
            listed = sum(f.split(": ")[1] == reason for s in step for f in s["reward_failures"])
            assert r[f"reward_fail/{reason}"] == listed
        assert sum(len(s["reward_failures"]) for s in step) > 0  # the tiny model writes junk
    # every served part is one of the servers' own answers (their rules, not the client's)
    assert all(s["reward_parts"]["http"] in answered for s in samples)
    assert all(round(s["reward_parts"]["judge"] * 10) in scores for s in samples)
    assert len({round(s["reward_parts"]["reward_model"], 6) for s in samples}) > 1


def test_bad_reward_setup_is_refused_before_launch_all_at_once(bin_dir, subprocess_env, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(
        '{"prompt": "p", "answer": "a"}\n{"prompt": "q", "answer": "b", "tests": [{"in": 1}]}\n'
    )
    held_out = tmp_path / "held_out.jsonl"  # the evaluation's rows are checked the same way
    good = '{"prompt": "r", "answer": "c", "tests": [{"input": "", "output": "1"}]}'
    held_out.write_text(
        f'{good}\n{good}\n{{"prompt": "s", "answer": "d", "test_code": "assert ("}}\n'
    )
    with Scorer(garbage=True) as server:
        proc = _run(
            bin_dir, "rlbatch-train", subprocess_env, tmp_path,
            "data=jsonl", f"data.path={data}", "data.reward_fn=[code_exec,http,reward_model]",
            f"data.reward_url={server.url}", f"data.reward_model={tmp_path / 'no_rm'}",
            "data.code_exec.limits.cpu_s=0", "eval.every_steps=1", f"eval.data.path={held_out}",
            "data.served.max_error_fraction=1.5",
            "batching.infer.max_tokens=1024",  # under the reward model's max_length (2048)
            timeout=120,
        )  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 2, proc.stdout[-2000:] + err[-2000:]
    assert f"data.path={data}: 2 row(s) without usable tests" in err
    assert "line 1: no field 'tests' or 'test_code'" in err
    assert "line 2: tests[0]" in err
    assert f"eval.data.path={held_out}: 1 row(s) without usable tests" in err
    assert "line 3: 'test_code' does not compile" in err
    assert "'tests' list of" in err  # the fix
    budget = "data.reward_model_batching.max_length=2048: a text this long (rounded to 2048) is"
    assert f"{budget} over batching.infer.max_tokens=1024" in err
    assert "lower it to 1024 or less" in err
    assert f"data.reward_url={server.url}" in err and "not JSON" in err
    assert "data.reward_model=" in err and "not a directory" in err
    assert "data.code_exec.limits.cpu_s=0" in err
    assert "data.served.max_error_fraction=1.5: is a fraction of a step's samples" in err
    assert not (tmp_path / "outputs").exists() or not list(
        (tmp_path / "outputs").rglob("metrics.jsonl")
    )
    assert os.path.exists(INIT)
