"""What rlbatch-train says when things go wrong, and paths that work from any directory, through
the real commands:

- a misspelled override is answered with the key it probably means, not with Hydra's advice to
  add the typo with ``+``;
- an environment call over env.timeout_s is shown as the environment's own error, never as a
  distributed collective timeout;
- Ctrl-C stops the run at once (exit 130) and a preemption signal saves it (exit 75); each says
  so in its own words, without torchrun's "failed (exitcode: ...)" line, and prints the command
  that continues the run: run from another directory, that command continues it to the end;
- the run's relative data.path and a reward function reading only ``completion_ids`` work; the
  samples files carry the prompt text; rlbatch-eval RUN_DIR works from another directory;
- a resume that changes how far generation runs ahead is refused before launch.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlbatch.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.e2e

STEPS = 4
PROMPTS = [{"prompt": f"copy {n:04d}", "answer": f"{n:04d}"} for n in range(64)]
RUN = [
    "+recipe=grpo_qwen", "data=jsonl", "data.path=prompts.jsonl", "data.reward_fn=ids.py:short",
    "logging.samples=true", f"trainer.max_steps={STEPS}", "trainer.checkpoint.every_steps=1",
    "logging.tensorboard=false", "logging.plot=false",
]  # fmt: skip
SLOW_ENV = """
import time

class Slow:
    def reset(self, row):
        return {}

    def step(self, state, text):
        time.sleep(30)
        return {"observation": None, "done": True}
"""


def _flat(text: str) -> str:
    return " ".join(text.split())


def _start(bin_dir, env, cwd, *overrides):
    cmd = [str(bin_dir / "rlbatch-train"), *overrides]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _signal_after(proc, run_dir: Path, step: int, sig: signal.Signals) -> tuple[int, str]:
    """Send ``sig`` to the launcher once checkpoint ``step`` exists; (exit code, stderr)."""
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
    deadline = time.monotonic() + 300
    while not ckpt.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=200)
    return proc.returncode, err


def _continue_command(err: str) -> str:
    lines = err.splitlines()
    at = next(
        i for i, line in enumerate(lines) if line.rstrip().endswith("Continue this run with:")
    )
    return lines[at + 1].strip()


def _shell(command: str) -> list[str]:
    """``command`` for bash, the launcher replacing the shell (signals reach it, as typed)."""
    return ["bash", "-c", command.replace("&& rlbatch-train", "&& exec rlbatch-train", 1)]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_misspelled_override_gets_did_you_mean(bin_dir, subprocess_env, tmp_path):
    cmd = [str(bin_dir / "rlbatch-train"), "grpo.polcy_loss=gspo", "traner.max_steps=2",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env, timeout=60)
    assert proc.returncode == 2
    err = _flat(proc.stderr)
    assert "grpo.polcy_loss=gspo: unknown key; did you mean grpo.policy_loss?" in err
    assert "traner.max_steps=2: unknown key; did you mean trainer.max_steps?" in err
    assert "+grpo.polcy_loss" not in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_environment_timeout_is_the_environments_error(bin_dir, subprocess_env, tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_ENV)
    run_dir = tmp_path / "run"
    cmd = [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", "env=default",
           "env.path=slow.py:Slow", "env.timeout_s=1", "trainer.max_steps=1",
           "logging.tensorboard=false", "logging.plot=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=subprocess_env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = _flat(proc.stderr)
    assert "EnvCallError: environment Slow.step on sample" in err, err[-3000:]
    assert "took longer than env.timeout_s=1" in err
    assert "RankTimeoutError" not in err and "trainer.timeout_s" not in err


@pytest.mark.slow
def test_interrupt_preemption_continue_and_paths(bin_dir, subprocess_env, tmp_path):
    launch_dir, elsewhere = tmp_path / "launch", tmp_path / "elsewhere"
    launch_dir.mkdir()
    elsewhere.mkdir()
    (launch_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (launch_dir / "ids.py").write_text("def short(completion_ids):\n    return -len(completion_ids) / 100\n")  # fmt: skip
    run_dir = launch_dir / "run"
    env = {**subprocess_env, "PATH": f"{bin_dir}:{subprocess_env.get('PATH', '')}"}

    # Ctrl-C (SIGINT to the launcher, as a terminal sends it): stopped at once, not saved
    proc = _start(bin_dir, env, launch_dir, *RUN, "hydra.run.dir=run")
    code, err = _signal_after(proc, run_dir, 1, signal.SIGINT)
    assert code == 130, err[-3000:]
    assert "interrupted (Ctrl-C): stopped every worker; exit code 130" in _flat(err)
    assert "preempted" not in err and "exitcode" not in err, err[-3000:]
    again = _continue_command(err)
    assert again.endswith(f"hydra.run.dir={run_dir} trainer.resume=auto")

    # the printed command continues the run from anywhere; a preemption signal saves and says so
    # (the first run may have saved more than step 1 before Ctrl-C reached it: wait for a
    # checkpoint this run writes, so the signal finds it running)
    newest = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    proc = subprocess.Popen(_shell(again), cwd=elsewhere, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    code, err = _signal_after(proc, run_dir, newest + 1, signal.SIGTERM)
    assert code == 75, err[-3000:]
    saved = _rows(run_dir)[-1]["step"]
    assert f"preempted (SIGTERM): saved step {saved} at " in _flat(err)
    assert "exitcode" not in err and "Traceback" not in err, err[-3000:]
    again = _continue_command(err)
    done = subprocess.run(_shell(again), cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, STEPS + 1))
    assert "Warning" not in done.stderr, done.stderr[-3000:]

    # resolved.yaml holds the data file's absolute path; the samples carry the prompt text; the
    # per-sample reward of completion_ids alone is the negated length / 100 of each completion
    resolved = (run_dir / "resolved.yaml").read_text()
    assert f"path: {launch_dir / 'prompts.jsonl'}" in resolved
    texts = {r["prompt"]: r["answer"] for r in PROMPTS}
    for line in (run_dir / "samples" / f"step_{STEPS:05d}.jsonl").read_text().splitlines():
        sample = json.loads(line)
        assert texts[sample["prompt"]] == sample["answer"]
        assert bytes(sample["prompt_ids"]).decode() == sample["prompt"]  # the byte tokenizer
        ids = sample["response_ids"]
        kept = ids[:-1] if ids and ids[-1] == ByteTokenizer.EOS else ids  # the EOS is not given
        assert sample["reward"] == pytest.approx(-len(kept) / 100)

    # rlbatch-eval of the run directory from another directory
    ev = subprocess.run([str(bin_dir / "rlbatch-eval"), str(run_dir), "--json", "eval.max_prompts=4",
                         "eval.num_samples=1", "--out", str(tmp_path / "eval")], cwd=elsewhere,
                        env=subprocess_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout)["step"] == STEPS
    assert "Warning" not in ev.stderr, ev.stderr[-3000:]

    # a resume that changes the run-ahead: refused before launch, naming each key and old value
    more = ["grpo.num_steps_async=1", "grpo.max_staleness=8", "grpo.partial_rollouts=true"]
    cmd = shlex.split(again.split("&&", 1)[1]) + more
    refused = subprocess.run(cmd, cwd=launch_dir, env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    err = _flat(refused.stderr)
    assert "grpo.num_steps_async=1: was 0 in" in err
    assert "grpo.partial_rollouts=true: was false in" in err
    assert "Resume with grpo.partial_rollouts=false" in err
    assert "Nothing was run" in err and "Traceback" not in err
