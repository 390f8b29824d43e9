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
    """An observation after turn 1, done after turn 2; even secrets raise at turn 1 after a
    turn of even length (when asked to: a step keeps episodes that succeed, or the run would
    stop). The untrained model ends few turns with EOS, so episodes are kept short."""

    def __init__(self, fail=False):
        self.fail = fail

    def reset(self, row):
        return {"turn": 0, "secret": row["answer"]}

    async def step(self, state, text):
        state["turn"] += 1
        if self.fail and int(state["secret"]) % 2 == 0 and len(text) % 2 == 0:
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
    "grpo.global_batch_size=32", "rollout.max_new_tokens=64",  # turns long enough to end with EOS
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
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={run_dir}", *USER_RUN,
                "trainer.checkpoint.every_steps=2")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, _metrics(run_dir)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
            for r in records]  # fmt: skip


def test_a_resumed_multi_turn_run_continues_exactly(user_run, bin_dir, subprocess_env):
    """The same async multi-turn run, resumed in a new run directory from its step-2
    checkpoint (a queued round of trajectories and the generation worker's aggregator state):
    every step's metrics and every trained trajectory equal the uninterrupted run's."""
    ref_dir, expected = user_run
    run_dir = ref_dir.parent / "resumed"
    step_2 = ref_dir / "checkpoints" / "step_00000002"
    resumed = _run(bin_dir, subprocess_env, ref_dir.parent, f"hydra.run.dir={run_dir}",
                   *USER_RUN, f"trainer.resume={step_2}")  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _untimed(_metrics(run_dir)) == _untimed(expected)
    for step in (3, 4):
        name = f"samples/step_{step:05d}.jsonl"
        assert (run_dir / name).read_text() == (ref_dir / name).read_text()


MOE_RUN = (
    "model=tiny_moe", "parallel.dp=2", "parallel.ep=2", "env=default",
    "env.path=scripted.py:Scripted", "env.max_turns=3", "rollout.max_new_tokens=48",
    "trainer.max_steps=2", "trainer.checkpoint.every_steps=1", "grpo.beta=0.02",
    "logging.samples=true", "grpo.routing_replay=r3", "eval.every_steps=2",
    "eval.data.path=held_out.jsonl", "eval.num_samples=2", "eval.at_start=false",
)  # fmt: skip


def test_a_dp2_ep2_moe_policy_runs_episodes_on_policy_and_resumes_exactly(
    bin_dir, subprocess_env, tmp_path
):
    """tiny_moe at dp 2 x ep 2 on a multi-turn environment (the built-in engine's per-row
    decoder running megatron's MoE layers, the two expert-parallel ranks kept in step while
    their episodes wait, re-enter and end at different times): the behaviour log-probs are the
    training forward's (on-policy: mismatch KL ~ 0, importance weights 1), observations were
    appended, evaluation runs its episodes too; each episode carries the experts its tokens
    were routed to while decoding (the training routers choose the same at step 1, and
    grpo.routing_replay=r3 replays them); and a run SIGKILLed in step 2 resumes to the
    uninterrupted run's metrics and trajectories."""
    (tmp_path / "scripted.py").write_text(ENV)
    rows = [{"prompt": "guess 0-9:", "answer": str(a)} for a in range(8)]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref = _run(bin_dir, subprocess_env, tmp_path, f"hydra.run.dir={ref_dir}", *MOE_RUN)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _metrics(ref_dir)
    for r in expected:
        assert abs(r["mismatch_kl_k1"]) < 1e-6 and abs(r["is_weight_max"] - 1.0) < 1e-4, r
        assert r["turns_max"] == 2 and r["env_episodes"] > 0  # episodes went on after turn 1
    assert expected[1]["kl"] > 0  # the reference pass scored transcripts of a moved policy
    assert "eval/reward_mean" in expected[1]  # evaluation's episodes, the expert group in step
    # same weights at step 1: the rollout's record is the training routers' own choice, up to
    # near-ties (positions, observations included, laid out as the trainer feeds them)
    assert expected[0]["moe/routing_mismatch"] < 0.01
    sample = json.loads((ref_dir / "samples/step_00001.jsonl").read_text().splitlines()[0])
    length = len(sample["prompt_ids"]) + len(sample["response_ids"])
    assert len(sample["routing"]) == length and sample["routing"][-1][0] == [-1, -1]
    common = (f"hydra.run.dir={run_dir}", *MOE_RUN)
    killed = _run(bin_dir, subprocess_env, tmp_path, *common, "debug.fail_at_step=2",
                  "debug.fail_kind=kill")  # fmt: skip
    assert killed.returncode != 0 and len(_metrics(run_dir)) == 1
    resumed = _run(bin_dir, subprocess_env, tmp_path, *common, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _untimed(_metrics(run_dir)) == _untimed(expected)
    name = "samples/step_00002.jsonl"
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
    episodes = {}
    for step in (1, 2, 3, 4):
        lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        assert len(samples) == 32
        # num_iterations=2: steps 2 and 4 train the episodes of steps 1 and 3 again, and the
        # episodes' event counts are counted once, on the steps that first train them
        first = step in (1, 3)
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
                errors += first
                assert "Scripted.step" in s["error"] and "turn 1 raised ValueError" in s["error"]
                assert s["reward"] == 0.0
            else:
                assert s["reward"] == pytest.approx(sum(s["env_rewards"]) + 0.5)
                assert s["reward_parts"]["bonus"] == 0.5
            observed += any(t["role"] == "observation" for t in s["turns"])
        episodes[step] = sorted(s["response_ids"] for s in samples)
        first = step in (1, 3)
        assert first or episodes[step] == episodes[step - 1]
        assert records[step - 1]["episodes_truncated"] == (truncated if first else 0)
        assert records[step - 1]["env_errors"] == (
            sum(s["end"] == "error" for s in samples) if first else 0
        )
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
    every sample exactly the 0.5 bonus), an environment error scoring 0 (env.on_error), counted
    in eval/env_errors and marked in the evaluation's samples file, never correct."""
    run_dir, records = user_run
    assert [r["step"] for r in records if "eval/reward_mean" in r] == [2, 4]
    rewards, errors = [], 0
    for step in (2, 4):
        lines = (run_dir / "eval" / f"step_{step:05d}.jsonl").read_text().splitlines()
        samples = [s for line in lines for s in json.loads(line)["samples"]]
        failed = [s for s in samples if s["error"] is not None]
        for s in failed:
            assert "Scripted.step" in s["error"] and "raised ValueError" in s["error"], s
            assert s["reward"] == 0.0 and not s["correct"]
        record = records[step - 1]
        assert record["eval/env_errors"] == len(failed)
        # zero_reward: the errored samples' 0 counts in the mean
        mean = sum(s["reward"] for s in samples) / len(samples)
        assert record["eval/reward_mean"] == pytest.approx(mean)
        rewards += [s["reward"] for s in samples]
        errors += len(failed)
    assert len(rewards) == 2 * 8 * 2
    assert any(r > 0.5 for r in rewards)  # the environment paid: 0.5 + its step rewards
    assert set(rewards) <= {0.0, 0.5, 0.75, 1.5, 1.75}
    assert errors > 0  # even secrets fail at turn 1 after a turn of even length


# ------------------------------------------------------------------ a real tokenizer, qwen turns
CHATTY = '''
LONG = "the tool says: " + "the answer is 42, " * 8


class Chatty:
    """A long tool answer after turns 1 and 2, done after turn 3; a row with "fail" raises at
    its second step."""

    def reset(self, row):
        return {"n": 0, "fail": row["fail"]}

    def step(self, state, text):
        state["n"] += 1
        if state["fail"] and state["n"] == 2:
            raise ValueError("tool crashed")
        if state["n"] >= 3:
            return {"observation": None, "done": True, "reward": 1.0}
        return {"observation": LONG, "done": False, "reward": 0.5}
'''
LONG = "the tool says: " + "the answer is 42, " * 8
BEFORE = "\n<|im_start|>user\n<tool_response>\n"  # Qwen2.5's tool turn after an assistant EOS
AFTER = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def turn_model(tmp_path_factory):
    """A tiny Qwen2 checkpoint with a Qwen2-style byte-level BPE tokenizer.json (EOS
    <|im_end|>) whose turns end with EOS after a few tokens; (directory, transformers'
    tokenizer of it)."""
    import transformers

    from hf_reference import save_qwen_style_tokenizer, save_turn_ending_qwen2

    path = tmp_path_factory.mktemp("turn_model")
    tok = save_qwen_style_tokenizer(path)
    save_turn_ending_qwen2(path, eos_id=tok.token_to_id("<|im_end|>"))
    return path, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen_run(bin_dir, subprocess_env, tmp_path_factory, turn_model):
    """Two steps of 32 episodes with data.chat_template=qwen and the real tokenizer: long
    observations cut to a limit 12 tokens over the tool turn's wrapper; 2 of the 8 prompts'
    episodes fail at their second step (env.on_error=zero_reward), with a data reward of 0.5."""
    model_dir, theirs = turn_model
    tmp = tmp_path_factory.mktemp("qwen_env")
    (tmp / "chatty.py").write_text(CHATTY)
    (tmp / "bonus.py").write_text("def bonus(completion):\n    return 0.5\n")
    chat = [{"role": "system", "content": "go"}, {"role": "user", "content": "ask the tool"}]
    rows = [{"prompt": chat, "answer": str(i), "fail": i < 2} for i in range(8)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    wrapper = len(theirs.encode(BEFORE, add_special_tokens=False)) + len(
        theirs.encode(AFTER, add_special_tokens=False)
    )
    limit = wrapper + 12
    run_dir = tmp / "run"
    proc = _run(
        bin_dir, subprocess_env, tmp, f"hydra.run.dir={run_dir}", f"model.hf_path={model_dir}",
        f"data.path={tmp / 'data.jsonl'}", "data.chat_template=qwen", "data.max_prompt_len=64",
        "data.reward_fn=bonus.py:bonus", "env=default", "env.path=chatty.py:Chatty",
        "env.on_error=zero_reward", f"env.max_observation_tokens={limit}",
        "env.max_total_tokens=400", "env.max_error_fraction=0.05", "logging.samples=true",
        "trainer.max_steps=2", "grpo.global_batch_size=32", "rollout.max_new_tokens=24",
        "logging.progress=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = {
        step: [
            json.loads(line)
            for line in (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
        ]
        for step in (1, 2)
    }
    output = " ".join((proc.stdout + proc.stderr).split())
    return _metrics(run_dir), samples, output, limit


@pytest.mark.slow
def test_cut_observation_keeps_the_chat_wrapper(qwen_run, turn_model):
    """An observation over env.max_observation_tokens loses the end of its content, never the
    tool turn's closing tags nor the next assistant header; the samples file logs exactly the
    text of the ids that were appended (decoded by transformers)."""
    records, samples, _, limit = qwen_run
    _, theirs = turn_model
    cut = 0
    for step, rows in samples.items():
        for s in rows:
            pos = 0
            for k, turn in enumerate(s["turns"]):
                ids = s["response_ids"][pos : pos + turn["tokens"]]
                if turn["role"] == "observation":
                    text = turn["text"]
                    assert theirs.decode(ids, skip_special_tokens=False) == text
                    assert text.startswith(BEFORE) and text.endswith(AFTER), text
                    content = text[len(BEFORE) : -len(AFTER)]
                    assert content and LONG.startswith(content) and content != LONG
                    assert len(ids) == limit
                    assert s["turns"][k + 1]["role"] == "assistant"  # sampled after the header
                    cut += 1
                pos += turn["tokens"]
            assert pos == len(s["response_ids"])
        assert records[step - 1]["observations_cut"] == sum(
            t["role"] == "observation" for s in rows for t in s["turns"]
        )
    assert cut > 0


@pytest.mark.slow
def test_zeroed_episodes_count_zero_in_every_reward_metric(qwen_run):
    """env.on_error=zero_reward: an episode ended by an error trained on 0, and so its parts
    (the data reward, the environment's step rewards paid before the error) are 0 in the
    samples' reward_parts and in reward/<name>_mean."""
    records, samples, output, _ = qwen_run
    errors = 0
    for step, rows in samples.items():
        want_bonus, want_env = [], []
        for s in rows:
            if s["end"] == "error":
                errors += 1
                assert "tool crashed" in s["error"] and s["env_rewards"] == [0.5]
                want_bonus.append(0.0)
                want_env.append(0.0)
                assert s["reward"] == 0.0
            else:
                want_bonus.append(0.5)
                want_env.append(sum(s["env_rewards"]))
            assert s["reward_parts"] == {"bonus": want_bonus[-1], "env": want_env[-1]}
        r = records[step - 1]
        assert r["reward/bonus_mean"] == pytest.approx(sum(want_bonus) / len(rows))
        assert r["reward/env_mean"] == pytest.approx(sum(want_env) / len(rows))
        assert r["env_errors"] == sum(s["end"] == "error" for s in rows)
    assert errors > 0
    # over env.max_error_fraction=0.05: a warning naming the step and an example error
    assert "episodes that reached the environment failed (over env.max_error_fraction=0.05)" in (
        output
    )


@pytest.mark.slow
def test_progress_line_and_summary_show_episode_figures(qwen_run):
    records, _, output, _ = qwen_run
    last = records[-1]
    line = f"step 2/2 reward {last['reward_mean']:.3f} kl {last['kl']:.4f}"  # then tok/s, then the episode figures
    assert line in output, output[-3000:]
    assert (
        f"turns {last['turns_mean']:.2f} env_errors {last['env_errors']:.0f} truncated"
        f" {last['episodes_truncated']:.0f}"
    ) in output
    for row in ("turns_mean", "env_errors", "episodes_truncated"):
        assert f"│ {row} " in output, row


def test_every_episode_failing_stops_the_run(bin_dir, subprocess_env, tmp_path, turn_model):
    """env.on_error=zero_reward with an environment whose every step fails (as when every
    thread is held by a hung call): the run stops at step 1 naming the failure, rather than
    training on reward 0."""
    model_dir, _ = turn_model
    (tmp_path / "broken.py").write_text(
        "class Broken:\n    def reset(self, row):\n        return 0\n"
        "    def step(self, state, text):\n        raise OSError('tool service down')\n"
    )
    run_dir = tmp_path / "run"
    proc = _run(
        bin_dir, subprocess_env, tmp_path, f"hydra.run.dir={run_dir}",
        f"model.hf_path={model_dir}", "env=default", "env.path=broken.py:Broken",
        "env.on_error=zero_reward", "trainer.max_steps=2", "grpo.global_batch_size=32",
        "rollout.max_new_tokens=24",
    )  # fmt: skip
    assert proc.returncode not in (0, 2), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = " ".join(next((run_dir / "errors").glob("rank*.txt")).read_text().split())
    assert "step 1: every one of the" in report and "reached the environment failed" in report
    assert "tool service down" in report
    assert "Traceback" not in report and "collective" not in report  # a user error, as such
    assert not (run_dir / "metrics.jsonl").exists() or not _metrics(run_dir)


@pytest.mark.slow
def test_no_episode_reaching_the_environment_is_reported(bin_dir, subprocess_env, tmp_path):
    """Every turn cut by rollout.max_new_tokens=1 (the untrained tiny model samples EOS about
    once in 264 tokens; with this seed, never in the two steps): the episodes never call the
    environment, which the run says at its first step and at the end."""
    (tmp_path / "scripted.py").write_text(ENV)
    run_dir = tmp_path / "run"
    proc = _run(
        bin_dir, subprocess_env, tmp_path, f"hydra.run.dir={run_dir}", "env=default",
        "env.path=scripted.py:Scripted", "trainer.max_steps=2", "grpo.global_batch_size=32",
        "rollout.max_new_tokens=1", "trainer.seed=1", "logging.progress=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _metrics(run_dir)
    assert [r["env_episodes"] for r in records] == [0, 0]
    assert all(r["episodes_truncated"] == 32 for r in records)
    output = " ".join((proc.stdout + proc.stderr).split())
    assert "step 1: no episode reached the environment" in output
    assert "step 2: no episode reached the environment" not in output  # said once
    assert "no episode reached the environment in 2 step(s)" in output
