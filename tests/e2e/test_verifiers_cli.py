"""verifiers environments through the real rlbatch-train (env.agent.verifiers): two small
verifiers 0.4 environments written here, loaded from local files. A single-turn one (four sums,
two weighted rewards) trains two steps on the tiny random policy and is evaluated after the
last on a held-out environment of two other sums (eval.verifiers); a multi-turn tool environment
(an MCP tool `add` that verifiers serves, an Env that answers every turn with "another" until
verifiers ends the exchange at env.max_turns=3) trains one step on a tiny policy made to call
the tool. Every trained token is one the policy sampled (the endpoint's records), the tool's
result enters the next call as environment tokens (not trained), the reward is the
environment's own scoring recomputed here from what the policy sampled, each reward is logged,
the taskset's tasks are the rows, later turns are spliced onto earlier ones. verifiers' chat
program runs with this interpreter: a `uv` first on PATH that marks its use is never called.
Before launch: what does not combine with env.agent.verifiers, every error at once with the
environments' own (two agent seats; a tool server that exits on start, with its log)."""

from __future__ import annotations

import json
import re
from importlib.util import find_spec

import pytest

from agent_runs import train as _run
from rlbatch.engine.tokenizer import ByteTokenizer

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.optional_extra,
    # found, not imported: importing verifiers.v1 takes seconds at every worker's collection
    pytest.mark.skipif(find_spec("verifiers") is None, reason="the verifiers extra"),
]

SUMS = """
import re

import verifiers.v1 as vf


class Sum(vf.TaskData):
    answer: str


class SumTask(vf.Task[Sum, vf.State]):
    @vf.reward(weight=0.5)
    async def opens_with_digit(self, task, trace) -> float:
        return float(trace.last_reply[:1].isdigit())

    @vf.reward
    async def exact(self, task, trace) -> float:
        numbers = re.findall(r"[0-9]+", trace.last_reply)
        return float(bool(numbers) and numbers[-1] == task.answer)


class Sums(vf.Taskset[SumTask]):
    def load(self):
        for a, b in {pairs}:
            yield SumTask(Sum(prompt=f"{{a}}+{{b}}=", answer=str(a + b)))


__all__ = ["Sums"]
"""

TURNS = """
import verifiers.v1 as vf


class Add(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # offered as `add`, not `add_add`

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        return str(a + b)


class Sum(vf.TaskData):
    answer: str


class AddTask(vf.Task[Sum, vf.State]):
    @vf.reward
    async def used_add(self, task, trace) -> float:
        return float(any(m.content == task.answer for m in trace.tool_messages))

    @vf.reward(weight=0.5)
    async def says_it(self, task, trace) -> float:
        return float(task.answer in [(m.content or "").strip() for m in trace.assistant_messages])


class Adds(vf.Taskset[AddTask]):
    def load(self):
        for name in ("a", "b", "c", "d"):
            yield AddTask(Sum(prompt="2+2=", system_prompt="Add.", answer="4", name=name))

    @classmethod
    def toolsets(cls, config):
        return [Add(vf.SharedToolsetConfig())]


class TwoTurnsConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurns(vf.Env[TwoTurnsConfig]):
    # asks again until the exchange ends: verifiers ends it at the run's env.max_turns
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            turn = await chat.turn()
            while not turn.terminated:
                turn = await chat.turn("another")


__all__ = ["Adds", "TwoTurns"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m turns`
    Add.run()
"""
TOOLS = [{"type": "function", "function": {"name": "add", "description": "", "parameters": {
    "type": "object", "properties": {"a": {"title": "A", "type": "integer"},
    "b": {"title": "B", "type": "integer"}}, "required": ["a", "b"], "title": "addArguments"}}}]  # fmt: skip
"""The tool as verifiers' chat program offers it (the MCP server's schema of `add`)."""
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
RESULT = (
    "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
"""What follows the call (after its EOS): the tool's result in the qwen template, then the
generation prompt."""

SEATS = """
import verifiers.v1 as vf


class Tasks(vf.Taskset[vf.Task]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"))


class PairConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "docker", "image": "python:3.11-slim"})
    judge: vf.AgentConfig = vf.AgentConfig()


class Pair(vf.Env[PairConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["Tasks", "Pair"]
"""

BROKEN = """
if __name__ == "__main__":  # the tool server, which fails on start (before its imports)
    raise SystemExit("the tool server cannot start: no database")

import verifiers.v1 as vf


class Tools(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    @vf.tool
    async def noop(self) -> str:
        return ""


class Tasks(vf.Taskset[vf.Task]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"))

    @classmethod
    def toolsets(cls, config):
        return [Tools(vf.SharedToolsetConfig())]


__all__ = ["Tasks"]
"""

TRAIN = [(2, 2), (3, 4), (10, 5), (7, 1)]
HELD = [(5, 5), (6, 1)]
"""The sums of the training taskset and of the held-out one (eval.verifiers)."""
RUN = ("data.path=null", "data.reward=none", "rollout.max_new_tokens=8", "grpo.num_generations=2",
       "grpo.global_batch_size=8", "logging.samples=true")  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory, subprocess_env):
    """The environments' files, and the runs' environment: a `uv` first on PATH that writes
    uv_called when run (verifiers would run it to install its chat program)."""
    tmp = tmp_path_factory.mktemp("verifiers")
    files = {"sums": SUMS.format(pairs=TRAIN), "held": SUMS.format(pairs=HELD), "turns": TURNS,
             "seats": SEATS, "broken": BROKEN}  # fmt: skip
    for name, text in files.items():
        (tmp / f"{name}.py").write_text(text)
    (tmp / "bin").mkdir()
    (tmp / "bin" / "uv").write_text(f"#!/bin/sh\ntouch {tmp / 'uv_called'}\nexit 1\n")
    (tmp / "bin" / "uv").chmod(0o755)
    env = {**subprocess_env, "PATH": f"{tmp / 'bin'}:{subprocess_env['PATH']}"}
    return tmp, env


def _train(bin_dir, tmp, name, *overrides):
    """(the process, metrics records, samples per step) of a run on the environment ``name``."""
    tmp, env = tmp
    proc = _run(bin_dir, env, tmp, f"hydra.run.dir={tmp / name}", *RUN,
                f"env.agent.verifiers={name}.py", *overrides)  # fmt: skip
    assert (tmp / name / "metrics.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    samples = {
        r["step"]: [
            json.loads(x)
            for x in (tmp / name / f"samples/step_{r['step']:05d}.jsonl").read_text().splitlines()
        ]  # fmt: skip
        for r in records
    }
    return proc, records, samples


@pytest.fixture(scope="module")
def single_run(tmp, bin_dir):
    return _train(bin_dir, tmp, "sums", "trainer.max_steps=2", "eval.every_steps=2",
                  f"eval.verifiers={tmp[0] / 'held.py'}", "eval.at_start=false",
                  "eval.num_samples=2", "eval.temperature=1.0")  # fmt: skip


@pytest.fixture(scope="module")
def tool_policy(tmp):
    """A tiny policy that calls the tool: its output layer fitted so that it samples CALL after
    the environment's first prompt and "4" after the tool's result (a random policy never
    writes a tool call); its context 1536 positions (the qwen template's tool section alone is
    about 500 tokens of the byte tokenizer)."""
    from hf_reference import save_scripted_qwen2
    from rlbatch.config.enums import ChatTemplate
    from rlbatch.rollout.agent.chat import render

    tok = ByteTokenizer()
    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]
    first = tok.encode(render(ChatTemplate.qwen, prompt, tok, TOOLS))
    call, answer = tok.encode(CALL) + [tok.EOS], tok.encode("4") + [tok.EOS]
    ids = first + call + tok.encode(RESULT) + answer
    a, b = len(first), len(first) + len(call)
    save_scripted_qwen2(tmp[0] / "tool_policy", ids, [(a, b), (len(ids) - len(answer), len(ids))])
    return tmp[0] / "tool_policy"


@pytest.fixture(scope="module")
def multi_run(tmp, bin_dir, tool_policy):
    return _train(bin_dir, tmp, "turns", "trainer.max_steps=1", "env.max_turns=3",
                  "env.agent.episode_timeout_s=120", f"model.hf_path={tool_policy}",
                  "model.tokenizer=bytes", "env.max_total_tokens=1024",
                  "rollout.max_new_tokens=80", "batching.train.max_tokens=2048",
                  "batching.infer.max_tokens=4096")  # fmt: skip


def _text(ids):
    return ByteTokenizer().decode(list(ids))


def _every_trained_token_sampled(samples):
    for s in (s for step in samples.values() for s in step):
        calls = s["turns"]
        assert calls and s["calls"] == list(range(len(calls))) and s["segments"] == 1
        trained = [t for t, m in zip(s["response_ids"], s["loss_mask"], strict=True) if m]
        assert trained == [t for c in calls for t in c["completion_ids"]]
        logps = [lp for lp, m in zip(s["behaviour_logps"], s["loss_mask"], strict=True) if m]
        assert logps == [lp for c in calls for lp in c["logps"]]


def test_a_single_turn_environment_trains_on_its_tasks_and_rewards(single_run, tmp):
    """Two steps; each step's 8 episodes are the 4 tasks twice (the taskset is the dataset);
    the reward is 0.5 x (the reply opens with a digit) + 1 x (its last number is the sum),
    computed here from the reply the policy sampled, and each reward is logged."""
    proc, records, samples = single_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["env_errors"] == 0 for r in records)
    _every_trained_token_sampled(samples)
    sums = {f"{a}+{b}=": str(a + b) for a, b in TRAIN}
    for step in samples.values():
        asked = []
        for s in step:
            (call,) = s["turns"]
            task = next(q for q in sums if q in _text(call["prompt_ids"]))
            asked.append(task)
            assert s["answer"] == sums[task]
            reply = _text(call["completion_ids"]).strip()
            numbers = re.findall(r"[0-9]+", reply)
            digit, exact = float(reply[:1].isdigit()), float(bool(numbers) and numbers[-1] == sums[task])  # fmt: skip
            assert s["reward"] == pytest.approx(0.5 * digit + exact)
            parts = s["reward_parts"]
            assert parts["harness.opens_with_digit"] == digit and parts["harness.exact"] == exact
            assert parts["harness.turns"] == 1.0
        assert sorted(asked) == sorted(list(sums) * 2)
    assert not (tmp[0] / "uv_called").exists()  # verifiers' chat program ran without uv


def _scored_as_the_environment_scores(results, pairs):
    """Each prompt of an evaluation's samples file is a task of the held-out taskset, in its
    order, and each sample's reward is the environment's scoring of its sampled reply."""
    assert [r["reference"] for r in results] == [str(a + b) for a, b in pairs]
    for r, (a, b) in zip(
        results, pairs, strict=True
    ):  # the task's prompt, as the template renders it
        assert r["prompt"].endswith(f"user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n")
    for r in results:
        assert len(r["samples"]) == 2
        for sample in r["samples"]:
            reply = sample["text"].strip()
            numbers = re.findall(r"[0-9]+", reply)
            exact = float(bool(numbers) and numbers[-1] == r["reference"])
            assert sample["reward"] == pytest.approx(0.5 * float(reply[:1].isdigit()) + exact)
            assert sample["error"] is None


def test_evaluation_plays_the_held_out_environment(single_run, tmp):
    """eval.every_steps with eval.verifiers: after the last step, the held-out taskset's tasks
    (not the training taskset's) are the evaluation's prompts, played by that environment and
    scored by its rubric."""
    _, records, _ = single_run
    assert "eval/reward_mean" not in records[0] and records[1]["eval/num_prompts"] == 2.0
    lines = (tmp[0] / "sums" / "eval" / "step_00002.jsonl").read_text().splitlines()
    _scored_as_the_environment_scores([json.loads(x) for x in lines], HELD)


def test_a_tool_environment_trains_the_policy_s_tool_calls(multi_run, tmp):
    """A multi-turn tool environment: the taskset's MCP tool `add` (a server verifiers starts),
    the environment saying "another" after each of the chat loop's turns until verifiers ends
    the exchange at env.max_turns=3. Each episode is one sample of three calls: the policy's
    tool call (sampled, parsed by the endpoint: finish_reason tool_calls), the tool's result
    "4" and the next generation prompt as environment tokens (loss mask 0), the policy's reply,
    "another", a third reply, and the episode truncated (verifiers cut it at
    env.max_turns). Every trained token is one the policy sampled; the reward is the
    environment's (the tool returned the answer: 1; a reply says it: 0.5) recomputed from what
    was sampled; the serving context (the tool server) is closed at exit."""
    proc, records, samples = multi_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records] == [1] and records[0]["env_errors"] == 0
    _every_trained_token_sampled(samples)
    tok = ByteTokenizer()
    for s in samples[1]:
        first, second, third = s["turns"]
        assert first["completion_ids"] == tok.encode(CALL) + [tok.EOS]  # sampled, not scripted
        assert first["finish_reason"] == "tool_calls"
        called = len(first["prompt_ids"]) + len(first["completion_ids"])
        assert second["prompt_ids"] == first["prompt_ids"] + first["completion_ids"] + tok.encode(RESULT)  # fmt: skip
        ids = s["prompt_ids"] + s["response_ids"]
        mask = [0] * len(s["prompt_ids"]) + s["loss_mask"]
        assert ids[: len(second["prompt_ids"])] == second["prompt_ids"]
        assert mask[len(first["prompt_ids"]) : called] == [1] * len(first["completion_ids"])
        assert mask[called : len(second["prompt_ids"])] == [0] * len(tok.encode(RESULT))
        head = second["prompt_ids"] + second["completion_ids"]
        assert third["prompt_ids"][: len(head)] == head
        assert _text(third["prompt_ids"][len(head) :]).count("another") == 1
        replies = [_text(c["completion_ids"]).strip() for c in (second, third)]
        says = float("4" in replies)
        assert s["reward"] == pytest.approx(1.0 + 0.5 * says)
        parts = s["reward_parts"]
        assert parts["harness.used_add"] == 1.0 and parts["harness.says_it"] == says
        assert parts["harness.turns"] == 3.0
        # verifiers ended the exchange at env.max_turns, not the environment: truncated
        assert third["finish_reason"] == "stop" and s["truncated"] is True
    assert "did not close" not in proc.stdout + proc.stderr


def test_configuration_errors_before_launch(tmp, bin_dir):
    """What does not combine with env.agent.verifiers, all at once with the environments' own
    problems: two agent seats, one of them in a Docker sandbox; the held-out environment's
    tool server, started before launch as the run starts it, exits: its log is shown (it is not
    an episode timing out at the first step); the tool servers' bounds not > 0 (the check
    still runs, at the defaults). Nothing runs. The other environments refused
    before launch: tests/unit/rollout/test_verifiers_env.py."""
    tmp, env = tmp
    proc = _run(bin_dir, env, tmp, "env.agent.verifiers=seats.py", "env.harness=h.py:run",
                "eval.every_steps=1", "eval.verifiers=broken.py", "data.reward=task",
                "env.agent.verifiers_port_timeout_s=0", "env.agent.verifiers_check_timeout_s=-1")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    for needle in ("are two ways to run episodes", "set data.path=null", "set data.reward=none",
                   "has 2 agent seats (agent, judge)",
                   "its seat 'agent' declares the docker runtime",
                   "env.agent.verifiers_on_host=true",
                   f"eval.verifiers={tmp / 'broken.py'}: its taskset's tool servers did not start",
                   "the server exited with code 1 before reporting its port",
                   "the tool server cannot start: no database",
                   "env.agent.verifiers_port_timeout_s=0.0: must be > 0 (the seconds a tool"
                   " server has to report its port): set a positive number of seconds (default"
                   " 90)",
                   "env.agent.verifiers_check_timeout_s=-1.0: must be > 0 (the seconds the"
                   " pre-launch check waits for the taskset's tool servers)"):  # fmt: skip
        assert needle in out, (needle, out[-3000:])
    assert "Nothing was run" in out
