"""OpenEnv environments through the real rlbatch-train (env.agent.openenv_url): a small OpenEnv
environment written here (OpenEnv's own Action / Observation / Environment and create_app),
served over HTTP by uvicorn in a process of its own, trained through the built-in OpenEnv
harness. One shared run (dp 2, env.on_error=zero_reward, evaluation after step 2): two steps
train, every trained token one the policy sampled (the endpoint's records), the reward the
environment's rewards summed, a row's episodes reset with one seed, each observation the next
user message, one server session per episode, a task whose step fails scored 0 and counted (in
training and in eval/env_errors); at step 3 the server dies and the run stops naming it. The
same run on a copy of the environment that does not crash, SIGKILLed during step 2 and resumed,
equals it. A run before it (raise_error) with env.agent.openenv_action on a second
environment of the same server: the function's actions reach it, and a step they make fail
stops the run naming the row. The configuration errors before launch: a server that does not
answer, a bad function, both env.harness and env.agent.openenv_url (an action with no text
field and no function: tests/unit/rollout/test_openenv.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from importlib.util import find_spec

import pytest

from agent_runs import train as _run
from rlbatch.engine.tokenizer import ByteTokenizer

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.optional_extra,
    # found, not imported: importing openenv imports gradio, seconds at every worker's collection
    pytest.mark.skipif(find_spec("openenv") is None, reason="the openenv extra (openenv-core)"),
]

SERVER = '''
"""A text environment: reset(seed) gives task seed % 10; the first step's observation asks
for more, the second ends the episode with reward 1 + task / 10 (the first has none). Task 7
fails its first step. Every reset and step is logged (one line each, with the app and the
session); the server process dies at the app "/"'s reset number CRASH_AFTER + 1."""
import json
import os
import sys
import uuid

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

LOG, PORT, CRASH_AFTER = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


class Say(Action):
    message: str


class Two(Action):  # served at /two: no single text field, a function must build it
    message: str
    mood: str


class Heard(Observation):
    prompt: str = ""


def log(**line):
    with open(LOG, "a") as f:
        f.write(json.dumps(line) + "\\n")


class Echo(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    APP, RESETS = "/", []

    def __init__(self):
        super().__init__()
        self.session, self.task, self._state = uuid.uuid4().hex, 0, State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.RESETS.append(seed)
        if self.APP == "/" and len(self.RESETS) > CRASH_AFTER:
            os._exit(3)  # the server is gone
        self.task, self._state = seed % 10, State(step_count=0)
        log(app=self.APP, event="reset", session=self.session, seed=seed)
        return Heard(prompt=f"task {self.task}: answer")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        n = self._state.step_count
        log(app=self.APP, event="step", session=self.session, step=n, action=action.model_dump(exclude={"metadata"}))
        if self.task == 7 or getattr(action, "mood", "") == "boom":
            raise RuntimeError(f"task {self.task} breaks at step {n}")
        if n == 1:
            return Heard(prompt="heard you, once more")
        return Heard(prompt="", done=True, reward=1 + self.task / 10)

    @property
    def state(self):
        return self._state


class EchoTwo(Echo):
    APP, RESETS = "/two", []


class EchoThree(Echo):  # "/"'s environment without the crash
    APP, RESETS = "/three", []


app = create_fastapi_app(Echo, Say, Heard, max_concurrent_envs=64)
app.mount("/two", create_fastapi_app(EchoTwo, Two, Heard, max_concurrent_envs=64))
app.mount("/three", create_fastapi_app(EchoThree, Say, Heard, max_concurrent_envs=64))
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
'''

ACTION = """
def act(text, observation):
    return {"message": text, "mood": "boom" if "task 3" in observation["prompt"] else "calm"}
"""

ROWS = [  # every step trains the four rows (8 episodes: 2 generations each)
    {"prompt": "Play:", "answer": "0", "seed": 3},
    {"prompt": "Play:", "answer": "0", "seed": 7},
    {"prompt": "Play:", "answer": "0", "seed": 12},
    {"prompt": "Play on:", "answer": "0"},  # its seed drawn from the row
]
RUN = ("data.path=rows.jsonl", "data.reward=none", "rollout.max_new_tokens=8",
       "grpo.num_generations=2", "grpo.global_batch_size=8", "env.max_turns=3", "logging.samples=true")  # fmt: skip
HELD = [
    {"prompt": "Play:", "answer": "0", "seed": 17},
    {"prompt": "Play:", "answer": "0", "seed": 25},
]
"""Held-out rows: task 7 (its step fails) and task 5, seeds no training row resets with."""
SHARED = (*RUN, "parallel.dp=2", "env.on_error=zero_reward", "env.max_error_fraction=1.0",
          "rollout.micro_batch_size=2", "grpo.aggregation.train_micro_batch_size=2",
          "trainer.max_steps=3", "trainer.checkpoint.every_steps=1", "eval.every_steps=2",
          "eval.at_start=false", "eval.data.path=held.jsonl", "eval.num_samples=2")  # fmt: skip
"""Two data-parallel ranks, evaluation after step 2, a checkpoint at every step."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openenv")
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HELD))
    (tmp / "act.py").write_text(ACTION)
    return tmp


@pytest.fixture(scope="module")
def server(tmp):
    """The environments' server on a free port: (url, log path). "/" dies at its 21st reset
    (step 3 of the shared run, after 16 training and 4 evaluation episodes)."""
    port, log = _free_port(), tmp / "server.jsonl"
    (tmp / "server.py").write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(tmp / "server.py"), str(log), str(port), "20"])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None, "the OpenEnv server did not start"
                time.sleep(0.1)
        yield url, log
    finally:
        proc.kill()
        proc.wait()


def _log(log, app):
    return [x for x in map(json.loads, log.read_text().splitlines()) if x["app"] == app]


@pytest.fixture(scope="module")
def raise_run(tmp, server, bin_dir, subprocess_env):
    """One step on "/two" (message and mood: no single text field) with env.agent.openenv_action
    under raise_error: (the process, the server's log lines of "/two")."""
    url, log = server
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={tmp / 'raise'}", *RUN,
                f"env.agent.openenv_url={url}/two", "env.agent.openenv_action=act.py:act",
                "trainer.max_steps=1")  # fmt: skip
    return proc, _log(log, "/two")


@pytest.fixture(scope="module")
def resumed_run(tmp, server, raise_run, bin_dir, subprocess_env):
    """The shared run's config on "/three" (the same environment without the crash), SIGKILLed
    during step 2 after the step-1 checkpoint and resumed (trainer.resume=auto), before the
    shared run kills the server: (the killed process, the resumed one, the run's folder)."""
    url, _ = server
    run_dir = tmp / "killed"
    common = (f"hydra.run.dir={run_dir}", *SHARED, f"env.agent.openenv_url={url}/three")
    killed = _run(bin_dir, subprocess_env, tmp, *common, "debug.fail_at_step=2",
                  "debug.fail_kind=kill")  # fmt: skip
    resumed = _run(bin_dir, subprocess_env, tmp, *common, "trainer.resume=auto")
    return killed, resumed, run_dir


@pytest.fixture(scope="module")
def shared_run(tmp, server, raise_run, resumed_run, bin_dir, subprocess_env):
    """Three steps on "/" at dp 2 under zero_reward, evaluated after step 2, after the raise
    and the resumed runs (the server dies at step 3's first reset, the 21st): (the process,
    metrics records, samples per step, the server's log lines of "/")."""
    url, log = server
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={tmp / 'run'}", *SHARED,
                f"env.agent.openenv_url={url}")  # fmt: skip
    assert (tmp / "run/metrics.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    samples = {
        step: [
            json.loads(x)
            for x in (tmp / f"run/samples/step_{step:05d}.jsonl").read_text().splitlines()
        ]  # fmt: skip
        for step in (1, 2)
    }
    return proc, records, samples, _log(log, "/")


def _text(ids):
    return ByteTokenizer().decode(list(ids))


def test_two_steps_train_then_a_dead_server_stops_the_run(shared_run):
    proc, records, samples, _ = shared_run
    assert [r["step"] for r in records] == [1, 2]
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "every one of the 8 episodes" in out and "env.agent.openenv_url" in out, out[-3000:]
    assert "OpenEnv" in out and "Traceback" not in out
    for step in (1, 2):
        assert len(samples[step]) == 8  # no split: each reply is spliced onto the last


def test_every_trained_token_is_one_the_policy_sampled(shared_run):
    _, _, samples, _ = shared_run
    for s in (s for step in samples.values() for s in step):
        calls = s["turns"]
        assert calls and s["calls"] == list(range(len(calls)))
        trained = [t for t, m in zip(s["response_ids"], s["loss_mask"], strict=True) if m]
        assert trained == [t for c in calls for t in c["completion_ids"]]
        logps = [lp for lp, m in zip(s["behaviour_logps"], s["loss_mask"], strict=True) if m]
        assert logps == [lp for c in calls for lp in c["logps"]]
        for a, b in zip(
            calls, calls[1:], strict=False
        ):  # the next call extends this one token for token
            assert b["prompt_ids"][: len(a["prompt_ids"]) + len(a["completion_ids"])] == a["prompt_ids"] + a["completion_ids"]  # fmt: skip


def test_observations_rewards_and_one_session_per_episode(shared_run):
    """The reset observation follows the row's prompt, the first step's observation is the next
    user message; the reward is the environment's rewards summed; task 7's failing step scores
    0 under zero_reward and is counted; one session (reset) per episode, with the row's seed
    for every episode of the row."""
    _, records, samples, lines = shared_run
    resets = [x for x in lines if x["event"] == "reset" and x["seed"] not in (17, 25)]
    assert len(resets) == 16 and len({x["session"] for x in resets}) == 16
    seeds = Counter(x["seed"] for x in resets)
    drawn = [s for s in seeds if s not in (3, 7, 12)]
    assert set(seeds) >= {3, 7, 12} and len(drawn) == 1 and all(n == 4 for n in seeds.values())
    steps = {(x["session"], x["step"]): x["action"] for x in lines if x["event"] == "step"}
    for step, rows in samples.items():
        errors = 0
        for s in rows:
            first = _text(s["turns"][0]["prompt_ids"])
            task = next(t for t in range(10) if f"task {t}: answer" in first)
            assert ("Play on:\n\ntask" in first) == (task == drawn[0] % 10)
            if task == 7:
                errors += 1
                assert s["end"] == "error" and s["reward"] == 0.0
                assert "failed the step 1" in s["error"] and "task 7 breaks at step 1" in s["error"]
                continue
            assert s["end"] == "done", s["error"]
            between = _text(s["turns"][1]["prompt_ids"][len(s["turns"][0]["prompt_ids"]) + len(s["turns"][0]["completion_ids"]):])  # fmt: skip
            assert between.count("heard you, once more") == 1
            replies = [c["completion_ids"] for c in s["turns"]]
            if len(replies) == 2 and all(replies):  # both steps taken: done, rewarded
                assert s["reward"] == pytest.approx(1 + task / 10)
                parts = {"env": s["reward"], "harness.steps": 2.0, "harness.done": 1.0}
                assert s["reward_parts"] == parts
            else:
                assert s["reward"] == 0.0 and s["reward_parts"]["harness.done"] == 0.0
        assert records[step - 1]["env_errors"] == errors == 2
    sent = [a["message"] for a in steps.values()]  # the default action: the reply's text
    assert len(sent) >= 24 and all(set(a) == {"message"} for a in steps.values())


def test_evaluation_runs_episodes_on_the_environment(shared_run, tmp):
    """eval.every_steps=2: the held-out rows' episodes (2 samples each) reset with their own
    seeds, one session each; task 7's failing step is counted in eval/env_errors and marked in
    the evaluation's samples file, scored 0 (zero_reward), never correct; task 5's finished
    episodes score the environment's 1.5."""
    _, records, _, lines = shared_run
    assert [("eval/reward_mean" in r) for r in records] == [False, True]
    resets = [x for x in lines if x["event"] == "reset" and x["seed"] in (17, 25)]
    assert sorted(x["seed"] for x in resets) == [17, 17, 25, 25]
    assert len({x["session"] for x in resets}) == 4
    rows = [json.loads(x) for x in (tmp / "run/eval/step_00002.jsonl").read_text().splitlines()]
    samples = [s for row in rows for s in row["samples"]]
    assert len(samples) == 4
    failed = [s for s in samples if s["error"] is not None]
    assert len(failed) == 2 == records[1]["eval/env_errors"]
    for s in failed:
        assert "task 7 breaks at step 1" in s["error"] and s["reward"] == 0.0
        assert not s["correct"]
    assert {s["reward"] for s in samples if s["error"] is None} <= {0.0, 1.5}
    assert records[1]["eval/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 4)


def _untimed(records):
    return [
        {k: v for k, v in r.items()
         if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
        for r in records
    ]  # fmt: skip


def test_a_killed_dp2_run_resumes_exactly(shared_run, resumed_run, server, tmp):
    """The shared run's config on "/three", SIGKILLed during step 2 after the step-1 checkpoint
    and resumed: steps 1 and 2, the evaluation included, equal the shared run's metrics, step
    2's samples and its evaluation's samples byte for byte (the server's address in their error
    messages aside), and step 3 trains."""
    _, expected, _, _ = shared_run
    url, _ = server
    killed, resumed, run_dir = resumed_run
    assert killed.returncode != 0
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert _untimed(records[:2]) == _untimed(expected)
    for name in ("samples/step_00002.jsonl", "eval/step_00002.jsonl"):
        mine = (run_dir / name).read_text().replace(f"{url}/three", url)
        assert mine == (tmp / "run" / name).read_text(), name


def test_the_action_function_builds_the_action_and_a_failed_step_stops_the_run(raise_run):
    """env.agent.openenv_action on "/two" (message and mood: no single text field): the
    function's actions reach the server; the step it makes fail (task 3) stops the run under
    raise_error, naming the harness, the row and the server's error."""
    proc, lines = raise_run
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "OpenEnv (env.agent.openenv_url=" in out and "(prompt index" in out, out[-3000:]
    assert "failed the step 1" in out and "breaks at step 1 (code: EXECUTION_ERROR)" in out
    assert "Traceback" not in out
    actions = [x["action"] for x in lines if x["event"] == "step"]
    assert len(actions) >= 8 and {a["mood"] for a in actions} == {"calm", "boom"}


def test_configuration_errors_before_launch(tmp, bin_dir, subprocess_env):
    (tmp / "bad.py").write_text("def act(text):\n    return {}\n")
    down = f"http://127.0.0.1:{_free_port()}"
    proc = _run(bin_dir, subprocess_env, tmp, f"env.agent.openenv_url={down}",
                "env.agent.openenv_action=bad.py:act", "env.harness=h.py:run")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    for needle in (f"env.agent.openenv_url={down}", "are two ways to run episodes",
                   "cannot be called as fn(text, observation)"):  # fmt: skip
        assert needle in out, needle
    proc = _run(bin_dir, subprocess_env, tmp, f"env.agent.openenv_url={down}")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "does not answer as an OpenEnv server" in out, out[-2000:]
    assert "start the environment's server" in out
