"""The agent endpoint's pure parts: conversations rendered as Qwen2.5 renders them, hermes tool
calls read back, the splice's continuation (a Qwen3-style template that drops earlier turns'
reasoning leaves the sampled turn alone), episodes assembled into segments from token ids
alone (the expected segments written out by hand) and ending in their last call's segment,
the seeds of calls that send their own, and calls after an episode ended refused."""

from __future__ import annotations

import json

import pytest

from rlbatch.config.enums import ChatTemplate, ToolParser
from rlbatch.engine.tokenizer import ByteTokenizer
from rlbatch.grpo.types import Prompt
from rlbatch.rollout.agent.chat import (
    continuation_text,
    parse_tool_calls,
    render,
    same_assistant_turn,
)
from rlbatch.rollout.agent.endpoint import CallError
from rlbatch.rollout.agent.episodes import Call, assemble, final_segment
from rlbatch.rollout.agent.session import AgentSession, Episode, _seed
from rlbatch.rollout.protocol import segment_seed

SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant"


def test_qwen_renders_tool_calls_and_results_as_qwen2_5_does():
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "tool", "tool_call_id": "c2", "content": "3"},
    ]
    text = render(ChatTemplate.qwen, messages, ByteTokenizer())
    assert text == (
        SYSTEM + ".<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    tools = [{"type": "function", "function": {"name": "calc"}}]
    with_tools = render(ChatTemplate.qwen, messages[:1], ByteTokenizer(), tools)
    assert with_tools.startswith(SYSTEM + ".\n\n# Tools\n\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "calc"}}\n</tools>' in with_tools


def test_hermes_tool_calls_are_parsed_and_bad_blocks_stay_text():
    text = 'Let me add.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ToolParser.hermes, ["id0"])
    assert content == "Let me add."
    assert calls == [
        {"id": "id0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    ]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, ToolParser.hermes) == (broken, [])
    assert parse_tool_calls(text, ToolParser.none) == (text, [])
    sent = {"role": "assistant", "content": "Let me add. ", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "calc", "arguments": '{"x":1}'}}
    ]}  # fmt: skip
    assert same_assistant_turn(sent, {"role": "assistant", "content": content, "tool_calls": calls})
    assert not same_assistant_turn({**sent, "tool_calls": []}, {"content": content, "tool_calls": calls})  # fmt: skip


def test_continuation_after_a_sampled_turn():
    tok = ByteTokenizer()
    added = [{"role": "user", "content": "again"}]
    after_eos = continuation_text(ChatTemplate.qwen, tok, added, None, ended_with_eos=True)
    assert after_eos == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    after_stop = continuation_text(ChatTemplate.qwen, tok, added, None, ended_with_eos=False)
    assert after_stop == "<|im_end|>" + after_eos  # no EOS sampled: the template closes the turn


class _Qwen3Like:
    """A jinja template that drops the reasoning of assistant turns before the last user turn
    (what Qwen3's template does), with '</s>' as its EOS."""

    chat_template = (
        "{% set last = namespace(i=0) %}{% for m in messages %}{% if m.role == 'user' %}"
        "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' and loop.index0 < last.i %}"
        "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}</s>"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    special_tokens = {"eos_token": "</s>"}


def test_continuation_leaves_earlier_reasoning_to_the_sampled_ids():
    tok = _Qwen3Like()
    sampled = "<think>hmm</think>4"
    history = [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": sampled}]
    added = [{"role": "user", "content": "and 3+3"}]
    whole = render(ChatTemplate.model, [*history, *added], tok)
    assert "<think>" not in whole  # a re-render would lose the sampled reasoning
    prefix = render(ChatTemplate.model, history[:1], tok)
    assert (
        prefix
        + sampled
        + continuation_text(ChatTemplate.model, tok, added, None, ended_with_eos=False)
        == prefix + sampled + "</s><user>and 3+3</s><assistant>"
    )
    assert continuation_text(ChatTemplate.model, tok, added, None, True) == "<user>and 3+3</s><assistant>"  # fmt: skip


def _call(i, prompt, completion, finish="stop"):
    call = Call(i, prompt, completion, [-0.5 - t for t in range(len(completion))], 3, finish, 0)
    call.truncated = finish == "length"
    return call


def test_assemble_joins_extending_calls_and_splits_the_rest():
    calls = [
        _call(0, [1, 2], [10, 11]),
        _call(1, [1, 2, 10, 11, 20, 21], [12]),  # extends: 20, 21 masked
        _call(2, [1, 2, 10, 11, 20, 21, 12], []),  # answered with no tokens (max_turns)
        _call(3, [1, 5], [13, 14], "length"),  # rewritten: a new segment
    ]
    first, second = assemble(calls)
    assert first.prompt_ids == [1, 2]
    assert first.ids == [10, 11, 20, 21, 12] and first.mask == [1, 1, 0, 0, 1]
    assert first.logps == [-0.5, -1.5, 0.0, 0.0, -0.5]
    assert first.calls == [0, 1] and not first.truncated
    assert second.prompt_ids == [1, 5] and second.ids == [13, 14] and second.mask == [1, 1]
    assert second.truncated and not second.branch
    assert json.dumps(calls[0].record())  # the episode record is plain JSON


def test_assemble_tells_branches_from_splits():
    calls = [
        _call(0, [1, 2], [10, 11]),
        _call(1, [1, 2], [12, 13]),  # the same prompt again (two calls at once): a branch
        _call(2, [1, 2, 10, 11, 20], [14]),  # goes on from call 0's reply: joins its segment
        _call(3, [1, 2, 12, 13, 21], [15]),  # goes on from call 1's: joins the branch
        _call(4, [1, 2, 10, 11, 22], [16]),  # call 0's reply, other new turns: a branch
        _call(5, [1, 3], [17]),  # none of the episode's points: a split (rewritten history)
    ]
    first, second, third, fourth = assemble(calls)
    assert (first.calls, second.calls, third.calls, fourth.calls) == ([0, 2], [1, 3], [4], [5])
    assert first.ids == [10, 11, 20, 14] and first.mask == [1, 1, 0, 1]
    assert second.ids == [12, 13, 21, 15] and second.mask == [1, 1, 0, 1]
    assert third.prompt_ids == [1, 2, 10, 11, 22] and third.ids == [16]
    assert [s.branch for s in (first, second, third, fourth)] == [False, True, True, False]
    # every sampled token is trained once
    segments = (first, second, third, fourth)
    trained = sorted(t for s in segments for t, m in zip(s.ids, s.mask, strict=True) if m)
    assert trained == sorted(t for c in calls for t in c.completion_ids)


def test_the_episode_ends_in_the_segment_of_its_last_call():
    """The row's segment holds the episode's last call, not the last-created segment: a best-of-2
    whose harness went on from the first reply ends in the first segment; a last call answered
    with no tokens (past env.max_turns) ends where its prompt continues, else where the latest
    sampled call is."""
    best_of_2 = [
        _call(0, [1, 2], [10, 11]),
        _call(1, [1, 2], [12, 13]),  # a branch, created after the main line
        _call(2, [1, 2, 10, 11, 20], [14], "length"),  # on from call 0's reply
    ]
    segments = assemble(best_of_2)
    assert [s.calls for s in segments] == [[0, 2], [1]]
    assert final_segment(segments, best_of_2) == 0
    out_of_turns = [*best_of_2, _call(3, [1, 2, 10, 11, 20, 14, 21], [])]
    assert final_segment(assemble(out_of_turns), out_of_turns) == 0
    elsewhere = [*best_of_2, _call(3, [9], [])]  # continues no segment: the latest sampled call's
    assert final_segment(assemble(elsewhere), elsewhere) == 0
    on_branch = [*best_of_2[:2], _call(2, [1, 2, 12, 13, 20], [])]
    assert final_segment(assemble(on_branch), on_branch) == 1


def test_a_client_seed_samples_fresh_noise_for_every_prompt_and_every_repeat():
    """A seed sent on every call of an episode: each turn (a longer prompt) and a prompt sent
    again draw other noise; the seed does not depend on the call's index (arrival order), and
    calls without a seed draw from (row seed, index)."""
    ep = Episode(0, Prompt(0, (1,), "a"), 1234)
    first = _seed(ep, 0, {"seed": 42}, [1, 2])
    call = _call(0, [1, 2], [10, 11])
    call.client_seed = 42
    ep.calls.append(call)
    next_turn = _seed(ep, 1, {"seed": 42}, [1, 2, 10, 11, 20])
    again = _seed(ep, 1, {"seed": 42}, [1, 2])  # the same prompt and seed once more
    other = _seed(ep, 1, {"seed": 43}, [1, 2])
    assert len({first, next_turn, again, other}) == 4
    fresh = Episode(0, Prompt(0, (1,), "a"), 1234)
    assert _seed(fresh, 7, {"seed": 42}, [1, 2]) == first  # whatever index it arrived at
    assert _seed(fresh, 3, {}, [1, 2]) == segment_seed(1234, 3)
    assert _seed(Episode(0, Prompt(0, (1,), "a"), 99), 0, {"seed": 42}, [1, 2]) != first


def test_a_call_after_its_episode_ended_is_refused_409_and_counted():
    ep = Episode(0, Prompt(0, (1,), "a"), 1)
    session = AgentSession(None, None, {"k": ep}, 30.0)  # type: ignore[arg-type]
    ep.calls.append(_call(0, [1, 2], [10]))
    ep.calls[0].reply = {"role": "assistant", "content": "x"}
    ep.calls.append(_call(1, [1, 2, 10, 5], []))  # a call it did not await: no reply yet
    session.end("k")
    assert [c.index for c in ep.calls] == [0] and ep.late_calls == 1
    with pytest.raises(CallError) as err:
        session.answer("k", "chat", {"messages": [{"role": "user", "content": "late"}]})
    assert err.value.status == 409 and ep.late_calls == 2 and "k" in session.keys()
    with pytest.raises(CallError) as err:
        session.answer("other", "chat", {"messages": [{"role": "user", "content": "x"}]})
    assert err.value.status == 404


def _reply(**over):
    reply = {
        "text": "ab",
        "ids": [97, 98, 258],
        "logps": [-0.1, -0.2, -0.3],
        "tokens": ["a", "b", ""],
        "finish_reason": "stop",
        "content": "ab",
        "tool_calls": [],
        "prompt_tokens": 7,
    }
    return {**reply, **over}


def test_responses_parse_as_the_openai_client_reads_them():
    """The endpoint's bodies validate as the openai package's own response types (the client's
    parser is the reference), streamed chunks joining back to the text and the tool calls."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from rlbatch.rollout.agent.endpoint import response, stream_chunks

    chat = ChatCompletion.model_validate(response("chat", {"logprobs": True}, _reply()))
    assert chat.choices[0].message.content == "ab" and chat.usage.completion_tokens == 3
    assert [t.logprob for t in chat.choices[0].logprobs.content] == [-0.1, -0.2, -0.3]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = _reply(content=None, tool_calls=[call], finish_reason="tool_calls")
    parsed = ChatCompletion.model_validate(response("chat", {}, tools)).choices[0]
    assert (
        parsed.finish_reason == "tool_calls" and parsed.message.tool_calls[0].function.name == "f"
    )
    text = Completion.model_validate(response("completion", {"logprobs": 1}, _reply()))
    assert text.choices[0].text == "ab" and text.choices[0].logprobs.token_logprobs[1] == -0.2
    body = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks("chat", body, _reply())]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ab"
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.total_tokens == 10
    streamed = [ChatCompletionChunk.model_validate(c) for c in stream_chunks("chat", {}, tools)]
    assert streamed[1].choices[0].delta.tool_calls[0].function.name == "f"
    stop_cut = _reply(text="a", content="a", tokens=["a", "b"], ids=[97, 98], logps=[-0.1, -0.2])
    pieces = stream_chunks("completion", {}, stop_cut)
    assert "".join(c["choices"][0]["text"] for c in pieces) == "a"  # the stop string's "b" unshown


def test_the_loop_watchdog_names_the_episode_and_line_that_hold_the_loop(tmp_path):
    """A harness that holds its event loop (time.sleep in async code) is seen from another
    thread: the loop's lag grows and the holder is the episode's key and the harness's line,
    through the same wait_for wrapping the engine uses."""
    import asyncio
    import importlib.util
    import time

    from rlbatch.rollout.agent.loop import HarnessLoop, run_harness

    path = tmp_path / "blocker.py"
    path.write_text("import time\n\nasync def run(client, model, row):\n    time.sleep(2)\n")
    spec = importlib.util.spec_from_file_location("blocker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loop = HarnessLoop()
    assert loop.holder(str(path))[0] is None  # idle: no episode holds it
    call = run_harness("ep-3", module.run, None, "policy", {})
    future = loop.submit(asyncio.wait_for(call, 30))
    deadline = time.monotonic() + 10
    while loop.lag() < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.lag() >= 1.0
    assert loop.holder(str(path)) == ("ep-3", f"{path}:4 in run")
    future.result(timeout=10)
    time.sleep(0.3)
    assert loop.lag() < 0.3  # the heartbeat runs again once the harness lets go


def test_the_watchdog_names_the_episode_whose_own_task_holds_the_loop(tmp_path):
    """Code that blocks in a task the episode started (verifiers scores a trace in tasks of
    its own, asyncio.gather) is that episode's: the holder is its key and the blocking line,
    not nobody (which left every episode of the rank to time out)."""
    import asyncio
    import importlib.util
    import time

    from rlbatch.rollout.agent.loop import HarnessLoop, run_harness

    path = tmp_path / "scorer.py"
    path.write_text(
        "import asyncio\nimport time\n\nasync def score():\n    time.sleep(2)\n\n"
        "async def run(client, model, row):\n    await asyncio.gather(score(), asyncio.sleep(0))\n"
    )
    spec = importlib.util.spec_from_file_location("scorer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loop = HarnessLoop()
    future = loop.submit(asyncio.wait_for(run_harness("ep-5", module.run, None, "p", {}), 30))
    deadline = time.monotonic() + 10
    while loop.lag() < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.holder(str(tmp_path / "harness.py")) == ("ep-5", f"{path}:5 in score")
    future.result(timeout=10)


def test_a_step_whose_every_harness_episode_failed_names_the_harness_fix():
    """The stop after a step where every episode failed points at the harness, not at
    env.timeout_s / env.max_concurrency (which an environment's calls use, a harness's not)."""
    from types import SimpleNamespace

    import pytest

    from rlbatch.env.protocol import EnvCallError
    from rlbatch.grpo.types import Prompt, Sample
    from rlbatch.train.episodes import check_env_errors

    error = "harness h.py:run on sample 0 (prompt index 3) raised ValueError: x"
    sample = Sample(Prompt(3, (1,), "a"), 0, [2], [0.0], False, 0, episode={"error": error})
    metrics = {"env_errors": 1.0, "env_episodes": 1.0}
    for harness, url, fix, other in (
        ("h.py:run", None, "fix the harness (env.harness)", "env.max_concurrency"),
        (None, "http://h:1", "check the OpenEnv server (env.agent.openenv_url)", "env.harness"),
        (None, None, "raise env.timeout_s / env.max_concurrency", "env.harness"),
    ):
        agent = SimpleNamespace(openenv_url=url)
        env = SimpleNamespace(harness=harness, agent=agent, max_error_fraction=0.5)
        with pytest.raises(EnvCallError) as caught:
            check_env_errors(metrics, [sample], env, step=1)
        assert error in str(caught.value) and fix in str(caught.value)
        assert other not in str(caught.value)


STAGGERED = '''
import asyncio
import random


async def run(client, model, row):
    """Two calls; the harness's own work after each takes a random while (up to 120 ms)."""
    for turn in range(2):
        await client.completions.create(model=model, prompt=f"{row['answer']}:{turn}", max_tokens=2)
        await asyncio.sleep(random.random() * 0.12)
    return 0.0
'''


class _Batches:
    """An AgentDecoder that records which episodes each decode batched (their round index)."""

    lockstep = False

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def agree(self, flags):
        return list(flags)

    def prepare(self, version):
        pass

    def release(self, episodes):
        pass

    def take_figures(self):
        return {}

    def __call__(self, prompt_ids, seeds, max_tokens, version, episodes):
        from rlbatch.rollout.protocol import DecodedRow

        self.batches.append([int(key.rsplit("-", 1)[1]) for key in episodes])
        return [DecodedRow([65] * n, [-1.0] * n, True) for n in max_tokens]


def test_decode_batches_do_not_depend_on_when_episodes_end(tmp_path):
    """Eight episodes, three at a time (env.max_concurrency), each working a random while
    between and after its calls: every round batches the same calls together, in the same
    order (a row's place in a batch can move its log-probabilities by a rounding). An episode
    that ends hands its slot to the next before the next decode, whether it ended before the
    engine looked or just after."""
    import random

    from rlbatch.config.schema import RunConfig
    from rlbatch.rollout.agent.engine import AgentRolloutEngine

    (tmp_path / "staggered.py").write_text(STAGGERED)
    cfg = RunConfig()
    cfg.env.harness = f"{tmp_path / 'staggered.py'}:run"
    cfg.env.max_concurrency = 3
    prompts = [Prompt(i, (65, 66), "ab") for i in range(8)]
    rounds = []
    for trial in range(6):
        random.seed(trial)  # the harnesses' timing
        decoder = _Batches()
        engine = AgentRolloutEngine(
            cfg, ByteTokenizer(), decoder, lambda p: {"answer": str(p.index)}, rank=0
        )
        engine.generate(prompts, 1, 0, seed=3)
        rounds.append(decoder.batches)
    assert sorted(i for batch in rounds[0] for i in batch) == sorted(list(range(8)) * 2)
    assert all(batches == rounds[0] for batches in rounds), rounds
