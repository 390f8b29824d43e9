"""Multi-turn environments through the real rlbatch-train: a user environment by file path with
a data reward function on top, async run-ahead with generation overlapping training (the
generation worker builds the environment), two iterations per round (the old-logprob pass), the
reference pass (grpo.beta > 0), the train pass planned on whole transcripts (logging.plans),
env.on_error=zero_reward, logging.samples, evaluation during training through the same
environment (and its resume); and the errors: a bad env.path before launch, an
exception in step naming the class, the sample and the turn, without a traceback."""

from __future__ import annotations

import json
import subprocess

import pytest

from rlbatch.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.e2e

ENV = '''
class Scripted:
    """An observation after turn 1, done after turn 2; even secrets raise at turn 1 (when asked
    to). The untrained model ends few turns with EOS, so episodes are kept short."""

    def __init__(self, fail=False):
        self.fail = fail

    def reset(self, row):
        return {"turn": 0, "secret": row["answer"]}

    async def step(self, state, text):
        state["turn"] += 1
        if self.fail and int(state["secret"]) % 2 == 0:
            raise ValueError("even secret")
        if state["turn"] >= 2:
            return {"observation": None, "done": True, "reward": 1.0}
        return {"observation": f"turn {state['turn']} of {text[:3]!r}", "done": False, "reward": 0.25}
'''


def _run(bin_dir, env, cwd, *overrides):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", "logging.plot=false",
         "logging.tensorboard=false", "trainer.checkpoint.export_hf=false", *overrides],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
    )  # fmt: skip


USER_RUN = (
    "env=default", "env.path=scripted.py:Scripted", "+env.kwargs.fail=true",
    "env.on_error=zero_reward", "env.max_turns=3", "data.reward_fn=bonus.py:bonus",
    "logging.samples=true", "logging.plans=true", "trainer.max_steps=4",
    "grpo.num_steps_async=1", "grpo.num_iterations=2", "grpo.beta=0.02",
    "grpo.global_batch_size=32", "rollout.max_new_tokens=24",
    "eval.every_steps=2", "eval.data.path=held_out.jsonl", "eval.num_samples=2",
    "eval.temperature=1.0", "eval.at_start=false",
)  # fmt: skip


@pytest.fixture(scope="module")
def user_run(bin_dir, subprocess_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("env")
    (tmp / "scripted.py").write_text(ENV)
    (tmp / "bonus.py").write_text("def bonus(completion):\n    return 0.5\n")
    rows = [{"prompt": "guess 0-9:", "answer": str(a)} for a in (1, 2, 3, 4, 5, 6, 7, 8)]
    (tmp / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp / "run"
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={run_dir}", *USER_RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, _metrics(run_dir)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "seconds")) and "per_s" not in k}
            for r in records]  # fmt: skip


def test_killed_and_resumed_multi_turn_run_continues_exactly(user_run, bin_dir, subprocess_env):
    """The same async multi-turn run, SIGKILLed during step 3 (a queued round of trajectories
    and the generation worker's aggregator state in the step-2 checkpoint), then resumed:
    every step's metrics and every trained trajectory equal the uninterrupted run's."""
    ref_dir, expected = user_run
    run_dir = ref_dir.parent / "killed"
    common = [f"hydra.run.dir={run_dir}", *USER_RUN, "trainer.checkpoint.every_steps=2"]
    killed = _run(bin_dir, subprocess_env, ref_dir.parent, *common, "debug.fail_at_step=3",
                  "debug.fail_kind=kill")  # fmt: skip
    assert killed.returncode != 0 and len(_metrics(run_dir)) == 2
    resumed = _run(bin_dir, subprocess_env, ref_dir.parent, *common, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _untimed(_metrics(run_dir)) == _untimed(expected)
    for step in (3, 4):
        name = f"samples/step_{step:05d}.jsonl"
        assert (run_dir / name).read_text() == (ref_dir / name).read_text()


def test_user_environment_trains_with_masks_rewards_and_samples(user_run):
    run_dir, records = user_run
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        for key in ("turns_mean", "turns_max", "env_seconds", "observation_tokens_mean",
                    "episodes_truncated", "env_errors", "reward/env_mean", "reward/bonus_mean"):  # fmt: skip
            assert key in r, key
        assert 1.0 <= r["turns_mean"] <= r["turns_max"] <= 3
        assert r["kl"] is not None and r["kl"] >= 0.0  # the reference pass scored the transcripts
    assert [r["staleness_mean"] for r in records] == [0.0, 0.0, 1.0, 1.0]  # async rounds of 2
    assert "old_logps_seconds" in records[0]  # num_iterations=2: the old pass ran
    tok = ByteTokenizer()
    errors = observed = 0
    for step in (1, 2, 3, 4):
        lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        assert len(samples) == 32
        truncated = 0
        for s in samples:
            assert len(s["loss_mask"]) == len(s["response_ids"])
            pos = 0
            for turn in s["turns"]:  # the transcript is the turns' tokens, in order
                ids = s["response_ids"][pos : pos + turn["tokens"]]
                if turn["role"] == "observation":
                    assert ids == tok.encode(turn["text"]) and turn["text"].startswith("turn ")
                    assert s["loss_mask"][pos : pos + turn["tokens"]] == [0] * len(ids)
                else:
                    assert s["loss_mask"][pos : pos + turn["tokens"]] == [1] * len(ids)
                pos += turn["tokens"]
            assert pos == len(s["response_ids"])
            assert s["num_turns"] == sum(t["role"] == "assistant" for t in s["turns"])
            truncated += s["truncated"]
            if s["end"] == "error":
                errors += 1
                assert "Scripted.step" in s["error"] and "turn 1 raised ValueError" in s["error"]
                assert s["reward"] == 0.0
            else:
                assert s["reward"] == pytest.approx(sum(s["env_rewards"]) + 0.5)
                assert s["reward_parts"]["bonus"] == 0.5
            observed += any(t["role"] == "observation" for t in s["turns"])
        assert records[step - 1]["episodes_truncated"] == truncated
        # the planner sees whole trajectories: the train pass's lengths are the transcripts'
        plan = json.loads((run_dir / "plans" / f"step_{step:05d}.json").read_text())
        lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
        assert sorted(plan["lengths"]) == sorted(lengths)
    assert errors > 0 and observed > 0
    assert sum(r["env_errors"] for r in records) == errors


def test_bad_environment_is_a_config_error_before_launch(bin_dir, subprocess_env, tmp_path):
    (tmp_path / "half.py").write_text("class Half:\n    def reset(self, row):\n        return 0\n")
    proc = _run(bin_dir, subprocess_env, tmp_path, "env=default", "env.path=half.py:Half",
                f"hydra.run.dir={tmp_path / 'run'}", "+env.kwargs.x=1")  # fmt: skip
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())  # the terminal wraps long lines
    assert "env.path=" in err and "half.py:Half has no method step(state, text)" in err
    assert "cannot be constructed with env.kwargs={'x': 1}" in err
    assert not (tmp_path / "run" / "errors").exists()  # nothing launched


def test_environment_exception_names_class_sample_and_turn(bin_dir, subprocess_env, tmp_path):
    (tmp_path / "scripted.py").write_text(ENV)
    run_dir = tmp_path / "run"
    proc = _run(bin_dir, subprocess_env, tmp_path, "env.path=scripted.py:Scripted",
                "+env.kwargs.fail=true", "env=default", f"hydra.run.dir={run_dir}", "trainer.max_steps=2",
                "rollout.max_new_tokens=24")  # fmt: skip
    assert proc.returncode != 0
    report = next((run_dir / "errors").glob("rank*.txt")).read_text()
    assert "EnvCallError: environment Scripted.step on sample" in report
    assert "turn 1 raised ValueError: even secret" in report
    assert "Traceback" not in report and "Traceback" not in proc.stderr


def test_evaluation_rolls_out_through_the_environment(user_run):
    """eval.every_steps during a multi-turn run: the held-out episodes run through the same
    environment and their rewards include its step rewards (a data reward alone would give
    every sample exactly the 0.5 bonus), an environment error scoring 0 (env.on_error)."""
    run_dir, records = user_run
    assert [r["step"] for r in records if "eval/reward_mean" in r] == [2, 4]
    rewards = []
    for step in (2, 4):
        lines = (run_dir / "eval" / f"step_{step:05d}.jsonl").read_text().splitlines()
        rewards += [s["reward"] for line in lines for s in json.loads(line)["samples"]]
    assert len(rewards) == 2 * 8 * 2
    assert any(r > 0.5 for r in rewards)  # the environment paid: 0.5 + its step rewards
    assert set(rewards) <= {0.0, 0.5, 0.75, 1.5, 1.75}
