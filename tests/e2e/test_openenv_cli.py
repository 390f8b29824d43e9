"""OpenEnv environments through the real rlbatch-train (env.agent.openenv_url): a small OpenEnv
environment written here (OpenEnv's own Action / Observation / Environment and create_app),
served over HTTP by uvicorn in a process of its own, trained through the built-in OpenEnv
harness. One shared run (env.on_error=zero_reward): two steps train, every trained token one the
policy sampled (the endpoint's records), the reward the environment's rewards summed, a row's
episodes reset with one seed, each observation the next user message, one server session per
episode, a task whose step fails scored 0 and counted; at step 3 the server dies and the run
stops naming it. A run before it (raise_error) with env.agent.openenv_action on a second
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


app = create_fastapi_app(Echo, Say, Heard, max_concurrent_envs=64)
app.mount("/two", create_fastapi_app(EchoTwo, Two, Heard, max_concurrent_envs=64))
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openenv")
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp / "act.py").write_text(ACTION)
    return tmp


@pytest.fixture(scope="module")
def server(tmp):
    """The environments' server on a free port: (url, log path). "/" dies at its 17th reset
    (step 3 of the shared run, which runs last)."""
    port, log = _free_port(), tmp / "server.jsonl"
    (tmp / "server.py").write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(tmp / "server.py"), str(log), str(port), "16"])
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
def shared_run(tmp, server, raise_run, bin_dir, subprocess_env):
    """Three steps on "/" under zero_reward, after the raise run (the server dies at step 3's
    first reset, the 17th): (the process, metrics records, samples per step, the server's log
    lines of "/")."""
    url, log = server
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={tmp / 'run'}", *RUN,
                f"env.agent.openenv_url={url}", "env.on_error=zero_reward",
                "env.max_error_fraction=1.0", "trainer.max_steps=3")  # fmt: skip
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
    resets = [x for x in lines if x["event"] == "reset"]
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
