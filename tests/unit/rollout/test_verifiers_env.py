"""The verifiers harness's parts that need no training run (rlbatch.rollout.agent.verifiers_env):
verifiers' chat program runs with this interpreter and no uv; the environments this run cannot
play are refused with what to change; a failed episode names verifiers' own message. The runs
through rlbatch-train are tests/e2e/test_verifiers_cli.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from importlib.util import find_spec

import pytest

pytestmark = [
    pytest.mark.optional_extra,
    pytest.mark.skipif(find_spec("verifiers") is None, reason="the verifiers extra"),
]

TASKS = """
import verifiers.v1 as vf


class Tasks(vf.Taskset[vf.Task]):
    INFINITE = {infinite}

    def load(self):
        yield from [vf.Task(vf.TaskData(prompt="hi"))] * {count}
"""
SEATS = """

class PairConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    judge: vf.AgentConfig = vf.AgentConfig()


class Pair(vf.Env[PairConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["Tasks", "Pair"]
"""
OWN_HARNESS = """

class Cli(vf.Harness):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        raise NotImplementedError


__all__ = ["Tasks", "Cli"]
"""
BASH = """
from verifiers.v1.harnesses.bash import BashHarness

__all__ = ["Tasks", "BashHarness"]
"""
BOXED = """

class BoxConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "docker", "image": "python:3.11-slim"})


class Box(vf.Env[BoxConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["Tasks", "Box"]
"""


def test_the_chat_program_runs_with_this_interpreter_and_no_uv(tmp_path, monkeypatch):
    """Once prepared, verifiers' own runtime hands out this interpreter for its chat program
    (no `uv` run: a `uv` first on PATH marks its use), and the program starts with it (its
    imports are this interpreter's packages)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes import SubprocessConfig, make_runtime

    from rlbatch.rollout.agent import verifiers_program

    (tmp_path / "uv").write_text(f"#!/bin/sh\ntouch {tmp_path / 'uv_called'}\nexit 1\n")
    (tmp_path / "uv").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert verifiers_program.program_problem() is None
    path = verifiers_program.prepare_chat_program()
    argv = asyncio.run(make_runtime(SubprocessConfig()).prepare_uv_script(CHAT_PROGRAM_SOURCE))
    assert sys.executable in argv and str(path) in argv
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--base-url" in proc.stdout, proc.stderr[-2000:]
    assert not (tmp_path / "uv_called").exists()


def _module(tmp_path, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    return str(tmp_path / f"{name}.py")


def test_environments_this_run_cannot_play_are_refused_with_the_fix(tmp_path):
    from rlbatch.rollout.agent import verifiers_env

    one = TASKS.format(infinite=False, count=1)
    cases = {
        "vf_pair": (one + SEATS, "has 2 agent seats (agent, judge)"),
        "vf_cli": (
            one + OWN_HARNESS,
            "plays the harness 'vf_cli', whose program verifiers installs at run time",
        ),  # fmt: skip
        "vf_endless": (
            TASKS.format(infinite=True, count=1) + "\n__all__ = ['Tasks']\n",
            "is infinite",
        ),  # fmt: skip
        "vf_empty": (
            TASKS.format(infinite=False, count=0) + "\n__all__ = ['Tasks']\n",
            "holds no tasks",
        ),  # fmt: skip
        "vf_broken": ("import verifiers.v1 as vf\n__all__ = []\n", "verifiers cannot load it"),
        "vf_retry": (
            one
            + BOXED.replace(
                'runtime={"type": "docker", "image": "python:3.11-slim"}',
                "retries=vf.RetryConfig(max_retries=1)",
            ),
            "its seat 'agent' retries a failed rollout (retries.max_retries=1)",
        ),  # fmt: skip
    }
    for name, (text, needle) in cases.items():
        problems = verifiers_env.check(_module(tmp_path, name, text))
        assert len(problems) == 1 and needle in problems[0], (name, problems)
    assert "does not exist" in verifiers_env.check(str(tmp_path / "missing.py"))[0]
    # a taskset with no harness plays verifiers' tool-less chat loop
    plain = verifiers_env.load_environment(_module(tmp_path, "vf_plain", one + "\n__all__ = ['Tasks']\n"))  # fmt: skip
    assert [h.id for h in plain.config.agent_harnesses().values()] == ["null"]


def test_sandboxed_work_is_refused_on_this_machine_unless_opted_in(tmp_path):
    """A seat that declares a container runtime, or plays bash (a shell run by the policy), is
    refused naming the seat and the opt-in; with env.agent.verifiers_on_host the seat runs in
    the subprocess runtime here and bash is played."""
    from rlbatch.rollout.agent import verifiers_env

    one = TASKS.format(infinite=False, count=1)
    boxed, bash = _module(tmp_path, "vf_boxed", one + BOXED), _module(tmp_path, "vf_bash", one + BASH)  # fmt: skip
    (problem,) = verifiers_env.check(boxed)
    assert "seat 'agent' declares the docker runtime" in problem
    assert "env.agent.verifiers_on_host=true" in problem
    (problem,) = verifiers_env.check(bash)
    assert "seat 'agent' plays the harness 'vf_bash'" in problem and "a shell" in problem
    assert "env.agent.verifiers_on_host=true" in problem
    assert verifiers_env.check(boxed, on_host=True) == verifiers_env.check(bash, on_host=True) == []  # fmt: skip
    env = verifiers_env.load_environment(boxed, on_host=True)
    assert env.config.agent.runtime.type == "subprocess"
    env = verifiers_env.load_environment(bash, on_host=True)
    assert [type(h).__name__ for h in env.config.agent_harnesses().values()] == ["BashHarnessConfig"]  # fmt: skip
    assert verifiers_env.taskset_rows(bash)[0][0] == "hi"  # the rows do not depend on it


def test_each_seat_ends_at_the_run_s_turn_and_token_limits(tmp_path):
    """The run's env.max_turns / env.max_total_tokens reach every seat (the least of the
    seat's own and the run's), so verifiers ends the exchange itself and scores it."""
    from rlbatch.rollout.agent import verifiers_env

    own = TASKS.format(infinite=False, count=1) + BOXED.replace(
        'runtime={"type": "docker", "image": "python:3.11-slim"}', "max_turns=2"
    )  # fmt: skip
    path = _module(tmp_path, "vf_own", own)
    env = verifiers_env.load_environment(path, max_turns=5, max_total_tokens=320)
    assert (env.config.agent.max_turns, env.config.agent.max_total_tokens) == (2, 320)
    env = verifiers_env.load_environment(path, max_turns=1, max_total_tokens=None)
    assert (env.config.agent.max_turns, env.config.agent.max_total_tokens) == (1, None)


def test_the_rows_are_the_taskset_s_tasks_in_order(tmp_path):
    from rlbatch.rollout.agent import verifiers_env

    text = """
import verifiers.v1 as vf


class Q(vf.TaskData):
    answer: int


class Tasks(vf.Taskset[vf.Task[Q, vf.State]]):
    def load(self):
        yield vf.Task(Q(prompt="1+1=", answer=2, name="first"))
        yield vf.Task(Q(prompt="2+2=", answer=4, system_prompt="Add."))


__all__ = ["Tasks"]
"""
    (first, second) = verifiers_env.taskset_rows(_module(tmp_path, "vf_rows", text))
    assert first[0] == "1+1=" and first[1] == "2"
    assert first[2]["verifiers_task"] == 0 and first[2]["name"] == "first"
    assert second[0] == [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]  # fmt: skip
    assert second[2]["verifiers_task"] == 1 and second[2]["verifiers_key"] != first[2]["verifiers_key"]  # fmt: skip


def test_a_failed_episode_names_verifiers_message():
    import verifiers.v1 as vf

    from rlbatch.rollout.agent.verifiers_env import VerifiersError, episode_result

    task = vf.TraceTask(type="Task", data=vf.TaskData(prompt="hi"), key="k", hash="h")
    failed = vf.Episode(task=task, errors=[vf.Error(type="HarnessError", message="exited 3: boom")])  # fmt: skip
    with pytest.raises(VerifiersError, match="HarnessError: exited 3: boom"):
        episode_result(failed)


def test_a_reply_the_endpoint_answered_empty_is_not_scored():
    """A call the endpoint answered with no tokens (its prompt left nothing of
    env.max_total_tokens) makes the episode an error naming the budget, not a scored reply."""
    import verifiers.v1 as vf

    from rlbatch.rollout.agent.verifiers_env import VerifiersError, episode_result

    task = vf.TraceTask(type="Task", data=vf.TaskData(prompt="hi"), key="k", hash="h")
    call = vf.ModelCall(finish_reason="length", usage=vf.Usage(prompt_tokens=796, completion_tokens=0))  # fmt: skip
    from verifiers.v1.trace import AgentInfo

    trace = vf.Trace(task=task, agent=AgentInfo(config=vf.AgentConfig()), calls=[call], ok=True)
    with pytest.raises(VerifiersError, match="call 0 has a prompt of 796 tokens.*env.max_total_tokens=320"):  # fmt: skip
        episode_result(vf.Episode(task=task, traces=[trace], ok=True), 320)


def test_a_reward_that_reads_the_answer_is_refused_on_tasks_without_one(tmp_path):
    """A taskset whose tasks have no answer field: data.reward=exact_match (which would pay an
    empty reply for the empty answer) is a problem for every task, naming the reward; with
    data.reward=none the rows are read, their answer empty."""
    from rlbatch.config.schema import DataConfig
    from rlbatch.grpo.data import read_examples

    path = _module(tmp_path, "vf_noanswer", TASKS.format(infinite=False, count=2) + "\n__all__ = ['Tasks']\n")  # fmt: skip
    examples, problems = read_examples(DataConfig(reward="exact_match"), 0, verifiers=path)
    assert [p.where for p in problems] == ["task 0", "task 1"]
    assert "has no answer field, and data.reward exact_match" in problems[0].message
    assert "set data.reward=none" in problems[0].message
    examples, problems = read_examples(DataConfig(reward="none"), 0, verifiers=path)
    assert problems == [] and [e.answer for e in examples] == ["", ""]


def test_the_environment_s_serving_context_is_closed_at_exit(tmp_path):
    """The harness enters the environment's serving context (interception server, shared tool
    servers) on its rank's loop and registers its exit: closing it on the running loop stops
    verifiers' interception server."""
    import threading

    from rlbatch.config.schema import RunConfig
    from rlbatch.rollout.agent import verifiers_env

    cfg = RunConfig()
    path = _module(tmp_path, "vf_served", TASKS.format(infinite=False, count=1) + "\n__all__ = ['Tasks']\n")  # fmt: skip
    cfg.env.agent.verifiers = path
    harness = verifiers_env.VerifiersHarness(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        env = asyncio.run_coroutine_threadsafe(harness._env(), loop).result(60)
        assert env._interception is not None  # serving
        _, (_, serving) = harness._loops[loop]
        assert verifiers_env._SERVING == [(loop, serving)]  # closed at exit
        verifiers_env.close_serving(verifiers_env._SERVING)  # as at exit (then a no-op)
        assert env._interception is None and verifiers_env._SERVING == []
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_held_out_environment_that_is_or_shadows_the_training_one_is_refused(tmp_path):
    """eval.verifiers naming the training environment (its file, or its id) holds no held-out
    task; one in another folder under the training file's name would be imported as the
    training module (evaluated on the training tasks, and its tool servers' `python -m NAME`
    resolving to either file): both refused before launch naming eval.verifiers, the clash
    and the fix, before either is loaded."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.grpo.preflight import check_eval_inputs

    text = TASKS.format(infinite=False, count=1) + "\n__all__ = ['Tasks']\n"
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    train = _module(tmp_path / "train", "sums", text)
    cases = {
        _module(tmp_path / "test", "sums", text): "are both imported as the module 'sums'",
        train: "names the training environment itself",
        str(tmp_path / "train" / ".." / "train" / "sums.py"): "the training environment itself",
    }
    for held_out, needle in cases.items():
        cfg = RunConfig()
        cfg.env.agent.verifiers, cfg.eval.verifiers = train, held_out
        cfg.eval.every_steps = 1
        errors: list = []
        check_eval_inputs(cfg, errors)
        assert [e.key for e in errors] == ["eval.verifiers"], (held_out, errors)
        message = str(errors[0])
        assert held_out in message and needle in message, message
        assert "rename the held-out file" in message or "under another name" in message
    from rlbatch.rollout.agent.verifiers_env import clash_problem

    assert clash_problem("vf-sums", "vf-sums") is not None  # the same installed id
    (tmp_path / "other").mkdir()
    assert clash_problem(train, _module(tmp_path / "other", "sums_test", text)) is None
    # each folder holds its own tools6.py: both folders are on the tool servers' path, so
    # `python -m tools6` would run one folder's tools for both environments
    _module(tmp_path / "train", "tools6", "")
    _module(tmp_path / "other", "tools6", "")
    problem = clash_problem(train, str(tmp_path / "other" / "sums_test.py"))
    assert problem is not None and "both hold a module named 'tools6'" in problem, problem


def test_held_out_tasks_that_are_training_tasks_are_refused(tmp_path):
    """A held-out environment under another name whose taskset holds some of the training
    tasks (verifiers' task key): refused naming eval.verifiers, how many, one of them and the
    fix; one with other tasks only passes."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.grpo.preflight import check_eval_inputs

    tasks = """
import verifiers.v1 as vf


class Tasks(vf.Taskset[vf.Task]):
    def load(self):
        yield from [vf.Task(vf.TaskData(prompt=p)) for p in {prompts!r}]


__all__ = ["Tasks"]
"""
    named = tasks.replace("vf.TaskData(prompt=p)", "vf.TaskData(prompt=p, name='held-' + p)")
    train = _module(tmp_path, "vf_train", tasks.format(prompts=["1+1=", "2+2="]))
    for name, prompts, problem, source in (
        ("vf_overlaps", ["3+3=", "2+2="], "1 of its 2 tasks are tasks of the training taskset", tasks),
        # the same prompt with a name of its own: another task key, still a training task
        ("vf_renamed", ["3+3=", "2+2="], "1 of its 2 tasks are tasks of the training taskset", named),
        ("vf_other", ["3+3=", "4+4="], None, tasks),
    ):  # fmt: skip
        cfg = RunConfig()
        cfg.data.reward = "none"
        cfg.env.agent.verifiers = train
        cfg.eval.verifiers = _module(tmp_path, name, source.format(prompts=prompts))
        cfg.eval.every_steps = 1
        errors: list = []
        check_eval_inputs(cfg, errors)
        found = [str(e) for e in errors if e.key == "eval.verifiers"]
        if problem is None:
            assert found == [], found
        else:
            assert len(found) == 1 and problem in found[0], found
            assert "task 1 ('2+2=')" in found[0] and "load other tasks" in found[0]


def test_an_exchange_verifiers_cut_at_the_run_s_limits_is_a_truncated_episode():
    """verifiers ends an exchange itself at the seat's max_turns (the run's env.max_turns) and
    says so on its trace (stop_condition): the episode is truncated on its sample (counted in
    episodes_truncated, masked under grpo.mask_truncated_completions) though its last call
    ended with `stop`; one that ended by itself is not."""
    import verifiers.v1 as vf
    from verifiers.v1.trace import AgentInfo

    from rlbatch.config.schema import RunConfig
    from rlbatch.engine.tokenizer import ByteTokenizer
    from rlbatch.grpo.types import Prompt
    from rlbatch.rollout.agent.engine import AgentRolloutEngine
    from rlbatch.rollout.agent.episodes import Call
    from rlbatch.rollout.agent.session import Episode
    from rlbatch.rollout.agent.verifiers_env import episode_result

    task = vf.TraceTask(type="Task", data=vf.TaskData(prompt="hi"), key="k", hash="h")
    engine = object.__new__(AgentRolloutEngine)  # _sample reads only these
    engine.cfg, engine.tokenizer, engine.harness_spec = RunConfig(), ByteTokenizer(), "verifiers"
    for stop, cut in ((None, False), ("max_turns", True), ("max_total_tokens", True)):
        call = vf.ModelCall(finish_reason="stop", usage=vf.Usage(prompt_tokens=2, completion_tokens=1))  # fmt: skip
        trace = vf.Trace(task=task, agent=AgentInfo(config=vf.AgentConfig()), calls=[call], ok=True, stop_condition=stop)  # fmt: skip
        value = episode_result(vf.Episode(task=task, traces=[trace], ok=True))
        ep = Episode(0, Prompt(0, (1, 2), ""), 0)
        ep.calls.append(Call(0, [1, 2], [7], [-0.5], 0, "stop", 0))
        sample = engine._sample(0, ep, (value, None, 0.1), 0)
        assert (sample.truncated, sample.episode["truncated"]) == (cut, cut), stop
        assert "reward/harness.truncated" not in sample.metrics


COLOCATED = """

class Add(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> str:
        return str(a + b)


class AddTask(vf.Task[vf.TaskData, vf.State]):
    @classmethod
    def toolsets(cls, config):
        return [Add(vf.ToolsetConfig(colocated=True))]


class Adds(vf.Taskset[AddTask]):
    def load(self):
        yield AddTask(vf.TaskData(prompt="2+2="))


__all__ = ["Adds"]
"""


def test_a_toolset_placed_in_the_agent_s_sandbox_is_refused_unless_opted_in(tmp_path):
    """A task's toolset with colocated=True runs in the agent's runtime (a sandbox under
    verifiers' default); rlbatch plays the agent on this machine, so its tools would run the
    policy's calls here: refused naming the toolset and the opt-in, played with it."""
    from rlbatch.rollout.agent import verifiers_env

    path = _module(tmp_path, "vf_colocated", "import verifiers.v1 as vf\n" + COLOCATED)
    problems = verifiers_env.check(path)
    assert len(problems) == 1, problems
    assert "its task toolset Add is colocated" in problems[0]
    assert "give it colocated=False" in problems[0]
    assert "env.agent.verifiers_on_host=true" in problems[0]
    env = verifiers_env.load_environment(path, on_host=True)
    assert verifiers_env.load_tasks(env)[0].data.prompt == "2+2="
    # the taskset declares a task class without such tools and yields a subclass with them:
    # verifiers builds each episode's toolsets from its task, so it is refused the same way
    hidden = COLOCATED.replace(
        "class AddTask(",
        "class Plain(vf.Task[vf.TaskData, vf.State]):\n    pass\n\n\nclass AddTask(",
    )
    hidden = hidden.replace("vf.Taskset[AddTask]", "vf.Taskset[Plain]")
    path = _module(tmp_path, "vf_colocated_sub", "import verifiers.v1 as vf\n" + hidden)
    problems = verifiers_env.check(path)
    assert len(problems) == 1 and "its task toolset Add is colocated" in problems[0], problems


def test_a_tool_server_s_port_file_is_removed_once_its_port_is_read():
    """verifiers' tool server reports its port in a /tmp/vf-port-* file, which verifiers
    leaves behind (one per server start: per episode for a task's own toolsets); once the
    port is read the file is gone."""
    import os
    import uuid

    from verifiers.v1.mcp import launch
    from verifiers.v1.runtimes import SubprocessConfig, make_runtime

    from rlbatch.rollout.agent import verifiers_tools

    verifiers_tools.fail_fast_tool_servers()
    path = f"/tmp/vf-port-{uuid.uuid4().hex}"

    async def serve() -> int:
        runtime = make_runtime(SubprocessConfig())
        await runtime.start()
        try:  # a server as verifiers starts one: it writes MCP_PORT_FILE, then serves
            script = 'echo 4242 > "$MCP_PORT_FILE"; sleep 30'
            await runtime.run_background(["sh", "-c", script], {"MCP_PORT_FILE": path}, "log")
            return await launch._read_back_port(runtime, path)
        finally:
            await runtime.stop()

    try:
        assert asyncio.run(serve()) == 4242
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


BINDS = """
import asyncio, sys, time
from verifiers.v1.runtimes import SubprocessConfig, make_runtime
from rlbatch.rollout.agent import verifiers_tools

verifiers_tools.bind_tool_servers()


async def main():
    runtime = make_runtime(SubprocessConfig())
    await runtime.start()
    await runtime.run_background([sys.executable, "-m", "vf_server"], {}, "log")
    print(runtime._background[-1].pid, flush=True)
    await asyncio.sleep(600)


asyncio.run(main())
"""


def test_a_tool_server_dies_with_the_process_that_started_it(tmp_path):
    """verifiers starts a tool server (`python -m MODULE`) in a session of its own and stops
    it only when its serving context exits, which `kill -9` of the run never reaches: the
    server now dies with the process that started it, and still runs its module as
    `__main__` (its `Toolset.run()` block)."""
    import os
    import signal
    import time

    (tmp_path / "vf_server.py").write_text(
        "import time\nif __name__ == '__main__':\n"
        f"    open({str(tmp_path / 'main')!r}, 'w').close()\n    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    env.pop("RLBATCH_PARENT_PID", None)
    worker = subprocess.Popen([sys.executable, "-c", BINDS], stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    server = 0
    try:
        server = int(worker.stdout.readline())
        deadline = time.monotonic() + 60
        while not (tmp_path / "main").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "main").exists()  # ran as __main__
        worker.kill()
        worker.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the tool server {server} outlived the process that started it")
    finally:
        worker.kill()
        if server:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)


def test_a_tool_server_that_never_reports_its_port_is_named_with_the_fix(monkeypatch):
    """A tool server that runs but never writes its port file (its `__main__` block does not
    serve): an error within env.agent.verifiers_port_timeout_s naming that key and what its
    module must do, not verifiers' 180 s wait ending in no fix."""
    import uuid

    from verifiers.v1.mcp import launch
    from verifiers.v1.runtimes import SubprocessConfig, make_runtime

    from rlbatch.rollout.agent import verifiers_tools

    monkeypatch.setattr(verifiers_tools, "_PORT_TIMEOUT_S", [90.0])  # restored after
    verifiers_tools.fail_fast_tool_servers(0.5)  # env.agent.verifiers_port_timeout_s

    async def serve() -> None:
        runtime = make_runtime(SubprocessConfig())
        await runtime.start()
        try:
            await runtime.run_background(["sleep", "30"], {}, "log")
            await launch._read_back_port(runtime, f"/tmp/vf-port-{uuid.uuid4().hex}")
        finally:
            await runtime.stop()

    with pytest.raises(launch.ToolsetError, match=r"did not report its port within 0.5 s \(env.agent.verifiers_port_timeout_s=0.5\): .*\.run\(\)"):  # fmt: skip
        asyncio.run(serve())


def test_a_tool_server_that_died_mid_run_is_named_with_its_exit_code_and_log(tmp_path, monkeypatch):  # fmt: skip
    """A tool server that exits after it started (verifiers shows only the tool call's
    connection error, a traceback cut at its head): the episode's error names the server, its
    exit code and its log's tail, and a long verifiers message keeps its end."""
    import verifiers.v1 as vf
    from verifiers.v1.runtimes import SubprocessConfig, make_runtime

    from rlbatch.rollout.agent import verifiers_env, verifiers_tools

    (tmp_path / "vf_dying.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('no database')\n    sys.exit(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    verifiers_tools.bind_tool_servers()

    async def serve() -> list[str]:
        runtime = make_runtime(SubprocessConfig())
        await runtime.start()
        try:
            await runtime.run_background([sys.executable, "-m", "vf_dying"], {}, "vf_tool.log")
            await runtime._background[-1].wait()
            return verifiers_tools.dead_tool_servers()
        finally:
            await runtime.stop()

    (dead,) = asyncio.run(serve())
    assert "`python -m vf_dying`" in dead and "exited with code 3" in dead
    assert dead.endswith("ends: no database")
    assert verifiers_tools.dead_tool_servers() == []  # stopped with its runtime: not reported
    task = vf.TraceTask(type="Task", data=vf.TaskData(prompt="hi"), key="k", hash="h")
    message = (
        "Traceback: " + "frame\n" * 1000 + "httpx.ConnectError: All connection attempts failed"
    )
    failed = vf.Episode(task=task, errors=[vf.Error(type="HarnessError", message=message)])
    with pytest.raises(verifiers_env.VerifiersError, match="ConnectError: All connection attempts failed$"):  # fmt: skip
        verifiers_env.episode_result(failed)


def _owner(make: int, report) -> None:
    """A forked process (verifiers already imported): ``make`` runtimes started through the
    wrapped subprocess runtime, their folder names written to ``report``; then it waits to be
    killed."""
    import os
    import time

    try:
        from verifiers.v1.runtimes import SubprocessConfig, make_runtime

        async def start() -> list[str]:
            runtimes = [make_runtime(SubprocessConfig()) for _ in range(make)]
            for runtime in runtimes:
                await runtime.start()
            return [r.name for r in runtimes]

        report.write(" ".join(asyncio.run(start())) + "\n")
        report.flush()
        time.sleep(600)
    finally:
        os._exit(0)


def test_runtime_folders_a_killed_process_left_are_reclaimed_and_a_live_one_s_kept(tmp_path, monkeypatch):  # fmt: skip
    """verifiers' runtime folders (one per tool server and running episode, names without a
    pid) stay behind when their process is killed -9: the next start of verifiers
    environments removes exactly those of ended processes (killed, even a zombie not yet
    reaped; a record of another host or container whose owner ended), and leaves a live
    process's folders, also a live owner this process cannot see by its pid (another PID
    namespace: its lock is held), a record with no lock and a folder no record names; a
    cleanly stopped runtime leaves no record."""
    import fcntl
    import os
    import signal
    import time

    from verifiers.v1.runtimes import SubprocessConfig, make_runtime
    from verifiers.v1.runtimes import subprocess as vf_subprocess
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    from rlbatch.rollout.agent import verifiers_folders

    monkeypatch.setattr(vf_subprocess, "CACHE_DIR", tmp_path)
    for name in ("start", "teardown", "cleanup"):  # restored after the test
        monkeypatch.setattr(SubprocessRuntime, name, getattr(SubprocessRuntime, name))
    monkeypatch.setattr(verifiers_folders, "_OWNER", {})  # this test's own record
    verifiers_folders.record_runtime_folders()
    folders = tmp_path / "runtimes" / "subprocess"
    owners = tmp_path / "runtimes" / verifiers_folders.OWNERS

    def fork(make: int) -> tuple[int, list[str]]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _owner(make, os.fdopen(write, "w"))
        os.close(write)
        with os.fdopen(read) as report:
            return pid, report.readline().split()

    def plant(record: str, lock: bool) -> None:
        (owners / record).mkdir()
        (owners / record / f"vf-{record}").touch()
        (folders / f"vf-{record}").mkdir()
        if lock:
            (owners / f"{record}.lock").touch()

    killed, live = fork(2), fork(1)
    try:
        stopped = make_runtime(SubprocessConfig())

        async def start_stop() -> None:
            await stopped.start()
            await stopped.stop()

        asyncio.run(start_stop())
        assert not (owners / verifiers_folders.owner_name()).exists()  # stopped: no record
        (folders / "vf-stranger").mkdir()  # no record names it: not rlbatch's
        assert all((folders / n).is_dir() for n in killed[1] + live[1])
        plant("othernode-cafef00d-7-7", lock=True)  # its owner ended: the lock is free
        plant("nolock-0-1-1", lock=False)  # not a record this rlbatch made
        # a live owner in another PID namespace on this host: a pid no process here has
        host, boot, _, _ = verifiers_folders.owner_name().rsplit("-", 3)
        unseen = int(open("/proc/sys/kernel/pid_max").read()) + 1
        container = f"{host}-{boot}-{unseen}-1"
        plant(container, lock=True)
        held = os.open(owners / f"{container}.lock", os.O_RDWR)
        fcntl.flock(held, fcntl.LOCK_EX)
        os.kill(killed[0], signal.SIGKILL)
        deadline = time.monotonic() + 30  # dead, not yet reaped: a zombie
        while verifiers_folders._stat(killed[0])[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        verifiers_folders.record_runtime_folders()  # the next run starts
        left = sorted(p.name for p in folders.iterdir())
        want = [*live[1], "vf-stranger", "vf-nolock-0-1-1", f"vf-{container}"]
        assert left == sorted(want), (left, killed[1], live[1])
        records = sorted(p.name for p in owners.iterdir() if p.is_dir())
        live_record = verifiers_folders.owner_name(live[0])
        assert records == sorted([live_record, "nolock-0-1-1", container])
        locks = {p.name for p in owners.glob("*.lock")}
        assert f"{verifiers_folders.owner_name(killed[0])}.lock" not in locks
        assert "othernode-cafef00d-7-7.lock" not in locks
        assert {f"{live_record}.lock", f"{container}.lock"} <= locks
        os.close(held)
    finally:
        for pid, _ in (killed, live):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_runtime_folder_reclaims_at_once_neither_fail_nor_leave_a_record(tmp_path, monkeypatch):
    """Two processes reclaiming the same 300 ended records at once (a dp=2 run's ranks after a
    kill): both finish without an error, every folder and record is gone, each record is
    reclaimed by one of them."""
    import os

    from verifiers.v1.runtimes import subprocess as vf_subprocess

    from rlbatch.rollout.agent import verifiers_folders

    monkeypatch.setattr(vf_subprocess, "CACHE_DIR", tmp_path)
    owners = tmp_path / "runtimes" / verifiers_folders.OWNERS
    folders = tmp_path / "runtimes" / "subprocess"
    folders.mkdir(parents=True), owners.mkdir()
    for k in range(300):
        (owners / f"node-0-{k}-1").mkdir()
        (owners / f"node-0-{k}-1" / f"vf-{k}").touch()
        (owners / f"node-0-{k}-1.lock").touch()
        (folders / f"vf-{k}").mkdir()
    go_read, go_write = os.pipe()
    children = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # both wait for the word, then reclaim
            code = 1
            try:
                os.read(go_read, 1)
                reclaimed = verifiers_folders.reclaim()
                os.write(write, f"{len(reclaimed)}\n".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        children.append((pid, read))
    os.write(go_write, b"gg")
    counts = []
    for pid, read in children:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        counts.append(int(os.read(read, 64).decode() or "-1"))
    assert sum(counts) == 300, counts
    assert list(folders.iterdir()) == [] and list(owners.iterdir()) == []


SLOW = """
import time

import verifiers.v1 as vf


class Slow(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    @vf.tool
    async def noop(self) -> str:
        return ""


class Tasks(vf.Taskset[vf.Task]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"))

    @classmethod
    def toolsets(cls, config):
        return [Slow(vf.SharedToolsetConfig())]


__all__ = ["Tasks"]

if __name__ == "__main__":  # loads for a minute before it serves
    time.sleep(60)
    Slow.run()
"""


def test_the_pre_launch_wait_for_tool_servers_is_bounded_by_keys_and_says_what_it_waits_for(tmp_path, monkeypatch, capsys):  # fmt: skip
    """The pre-launch check of a taskset whose tool server is slow to start: past
    env.agent.verifiers_port_timeout_s the error names that key; past
    env.agent.verifiers_check_timeout_s (the wait for all of the taskset's servers) that one;
    while it waits, a line says what it waits for, how long so far and the bounding key."""
    from rlbatch.rollout.agent import verifiers_env, verifiers_tools

    monkeypatch.setattr(verifiers_tools, "_PORT_TIMEOUT_S", [90.0])  # restored after
    monkeypatch.setattr(verifiers_tools, "PROGRESS_AFTER_S", 0.3)
    path = _module(tmp_path, "vf_slow", SLOW)
    (problem,) = verifiers_env.check(path, check_timeout_s=60, port_timeout_s=0.5)
    assert "did not report its port within 0.5 s (env.agent.verifiers_port_timeout_s=0.5)" in problem  # fmt: skip
    assert "or raise env.agent.verifiers_port_timeout_s" in problem
    capsys.readouterr()
    (problem,) = verifiers_env.check(
        path, check_timeout_s=1.0, port_timeout_s=60, what=f"env.agent.verifiers={path}"
    )
    assert problem.startswith(
        "its taskset's tool servers (python -m vf_slow) did not start within 1 s"
        " (env.agent.verifiers_check_timeout_s=1): "
    ), problem
    assert "or raise env.agent.verifiers_check_timeout_s" in problem
    err = capsys.readouterr().err
    assert f"rlbatch: env.agent.verifiers={path}: waiting for its taskset's tool servers (python -m vf_slow) to start: 0 s so far, at most 1 s (env.agent.verifiers_check_timeout_s)" in err, err  # fmt: skip
