"""Agent harnesses through the real rlbatch-train (env.harness): an openai-client harness whose
episodes make a chat call, a streamed chat call that continues it (spliced: the first call's
sampled ids, never re-tokenized) and, for half the rows, a call that rewrites the history (a
split, counted); every trained token checked against the endpoint's records. Then the faults:
a harness that raises, returns a non-number, asks n > 1, makes no call, or hangs, in one run
under env.on_error=zero_reward; the same harness stopping the run under raise_error; and the
configuration errors before launch, all at once."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from rlbatch.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.e2e

HARNESS = '''
import httpx

async def auth_checked(client):
    """The endpoint refuses a call without the bearer token, and serves one with it."""
    async with httpx.AsyncClient() as http:
        url = str(client.base_url) + "models"
        bare = await http.get(url)
        signed = await http.get(url, headers={"Authorization": f"Bearer {client.api_key}"})
    return float(bare.status_code == 401 and signed.json()["data"][0]["id"] == "policy")

async def run(client, model, row):
    """Two turns (the second streamed, with a stop string); odd secrets then start over."""
    auth = await auth_checked(client) if row["answer"] == "0" else 1.0
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(
        model="any-name", messages=messages, max_tokens=12, temperature=0.3, logprobs=True)
    reply = first.choices[0].message
    assert first.choices[0].logprobs is not None
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": "once more"}]
    stream = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stop=["7"])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    if int(row["answer"]) % 2:
        await client.chat.completions.create(  # a rewritten history: a new segment
            model=model, messages=[{"role": "user", "content": "fresh " + text[:4]}])
    return {"reward": float(len(text) % 3 == 0), "length": float(len(text)), "auth": auth}
'''

FAULTS = """
import asyncio

async def run(client, model, row):
    kind = int(row["answer"])
    if kind == 0:
        raise ValueError("broken harness")
    if kind == 1:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        return "not a number"
    if kind == 2:
        await client.chat.completions.create(model=model, n=2, messages=[{"role": "user", "content": "x"}])
    if kind == 3:
        return 1.0
    if kind == 4:
        await asyncio.sleep(120)
    if kind == 5:  # past env.max_turns=3 a call is answered with no tokens
        messages = [{"role": "user", "content": "x"}]
        for _ in range(5):
            out = await client.chat.completions.create(model=model, messages=messages, max_tokens=2)
            messages += [out.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "go on"}]
        return float(out.choices[0].finish_reason == "length" and out.choices[0].message.content == "")
    stream = await client.completions.create(  # token in, streamed out
        model=model, prompt=[104, 105, 58], max_tokens=5, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    return {"reward": 1.0, "chars": float(len(text))}
"""


def _run(bin_dir, env, cwd, *overrides):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", "logging.plot=false",
         "logging.tensorboard=false", "trainer.checkpoint.export_hf=false", "env=default",
         "data.chat_template=qwen", "data.max_prompt_len=192", "env.max_total_tokens=320",
         "rollout.max_new_tokens=16", "grpo.global_batch_size=16", "grpo.num_generations=4",
         "batching.train.max_tokens=1024", "batching.infer.max_tokens=2048", *overrides],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
    )  # fmt: skip


AGENT_RUN = (
    "env.harness=harness.py:run", "logging.samples=true", "trainer.max_steps=2",
    "env.max_concurrency=3", "env.agent.auth_token=s3cret", "data.reward_fn=bonus.py:bonus",
    "grpo.beta=0.02",
)  # fmt: skip


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
            for r in records]  # fmt: skip


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def agent_run(bin_dir, subprocess_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    (tmp / "harness.py").write_text(HARNESS)
    (tmp / "bonus.py").write_text("def bonus(completion):\n    return 0.25\n")
    run_dir = tmp / "run"
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={run_dir}", *AGENT_RUN,
                f"env.agent.port={_free_port()}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [
        [json.loads(line) for line in (run_dir / "samples" / f"step_{s:05d}.jsonl").read_text().splitlines()]
        for s in (1, 2)
    ]  # fmt: skip
    return proc, metrics, samples, tmp


def test_killed_and_resumed_agent_run_continues_exactly(agent_run, bin_dir, subprocess_env):
    """SIGKILLed during step 2 after the step-1 checkpoint, then resumed: the harness's episodes
    (same seeds, same calls) and every metric equal the uninterrupted run's."""
    _, expected, _, tmp = agent_run
    run_dir = tmp / "killed"
    common = [f"hydra.run.dir={run_dir}", *AGENT_RUN, "trainer.checkpoint.every_steps=1"]
    killed = _run(bin_dir, subprocess_env, tmp, *common, "debug.fail_at_step=2",
                  "debug.fail_kind=kill")  # fmt: skip
    assert killed.returncode != 0
    resumed = _run(bin_dir, subprocess_env, tmp, *common, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert _untimed(metrics) == _untimed(expected)
    name = "samples/step_00002.jsonl"
    assert (run_dir / name).read_text() == (tmp / "run" / name).read_text()


def test_every_trained_token_is_one_the_endpoint_sampled(agent_run):
    _, _, steps, _ = agent_run
    tok = ByteTokenizer()
    spliced = lossy = 0
    for samples in steps:
        assert len(samples) == 16
        for s in samples:
            calls = s["turns"]
            assert 2 <= len(calls) <= 3 and s["error"] is None
            first, second = calls[0], calls[1]
            # the same message as the data pipeline renders it (data.chat_template=qwen)
            assert first["prompt_ids"] == tok.encode(s["prompt"])
            # the second continues the first token for token: its sampled ids, not a re-render
            history = first["prompt_ids"] + first["completion_ids"]
            assert second["spliced"] and second["prompt_ids"][: len(history)] == history
            spliced += 1
            text = tok.decode(first["completion_ids"])
            lossy += tok.encode(text) != [t for t in first["completion_ids"] if t < 256]
            # the trained sample is the last segment: its sampled tokens are exactly the
            # calls' completions with their log-probs, everything else masked
            segment = calls[2:] if len(calls) == 3 else calls[:2]
            assert s["prompt_ids"] == segment[0]["prompt_ids"]
            trained = [t for t, m in zip(s["response_ids"], s["loss_mask"], strict=True) if m]
            assert trained == [t for c in segment for t in c["completion_ids"]]
            logps = [lp for lp, m in zip(s["behaviour_logps"], s["loss_mask"], strict=True) if m]
            assert logps == pytest.approx([lp for c in segment for lp in c["logps"]], abs=1e-6)
            assert all(c["version"] == s["policy_version"] for c in calls)
            full = s["prompt_ids"] + s["response_ids"]
            assert full[: len(segment[-1]["prompt_ids"])] == segment[-1]["prompt_ids"]
            assert len(full) <= 320
            if int(s["answer"]) % 2:
                assert calls[2]["diverged"] and not calls[2]["spliced"]
    assert spliced == 32
    assert lossy > 0  # some sampled bytes do not survive decode / encode: the splice kept them


def test_rewards_splits_and_metrics(agent_run):
    proc, metrics, steps, _ = agent_run
    assert [r["step"] for r in metrics] == [1, 2]
    for r, samples in zip(metrics, steps, strict=True):
        odd = sum(int(s["answer"]) % 2 for s in samples)
        assert r["episode_splits"] == odd
        assert r["turns_mean"] == pytest.approx(sum(len(s["turns"]) for s in samples) / 16)
        for s in samples:
            assert s["reward_parts"]["harness.auth"] == 1.0  # answer 0: checked against 401
            assert s["reward_parts"]["harness.length"] >= 0.0
            assert s["env_rewards"] in ([0.0], [1.0])
            # the data reward (data.reward_fn) adds to the harness's
            assert s["reward"] == s["env_rewards"][0] + 0.25
            assert (
                s["reward_parts"]["bonus"] == 0.25
                and s["reward_parts"]["env"] == s["env_rewards"][0]
            )
        assert r["kl"] is not None and r["kl"] >= 0.0  # the reference pass scored the episodes
    out = " ".join((proc.stderr + proc.stdout).split())
    assert "temperature=0.3 is ignored" in out
    assert "HTTP Request" not in out  # the harness clients' per-call lines stay off the run's log


@pytest.fixture(scope="module")
def fault_run(bin_dir, subprocess_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "faults.py").write_text(FAULTS)
    rows = [{"prompt": "guess 0-9:", "answer": str(a)} for a in range(7)]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def test_harness_faults_score_zero_under_zero_reward(fault_run, bin_dir, subprocess_env):
    run_dir = fault_run / "zero"
    proc = _run(bin_dir, subprocess_env, fault_run, f"hydra.run.dir={run_dir}",
                "env.harness=faults.py:run", "env.on_error=zero_reward", "data.path=rows.jsonl",
                "logging.samples=true", "trainer.max_steps=1", "grpo.global_batch_size=28",
                "env.agent.episode_timeout_s=20", "env.timeout_s=1", "env.max_error_fraction=1.0",
                "env.max_turns=3")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [json.loads(x) for x in (run_dir / "samples/step_00001.jsonl").read_text().splitlines()]  # fmt: skip
    expected = {
        0: "raised ValueError: broken harness",
        1: "returned str 'not a number'",
        2: "asked for n=2",
        3: "made no call to the endpoint",
        4: "took longer than env.agent.episode_timeout_s",
    }
    assert len(samples) == 28
    for s in samples:
        if s["answer"] == "5":  # the calls past env.max_turns were answered with no tokens
            assert s["end"] == "done" and s["reward"] == 1.0 and s["num_turns"] == 3
            assert len(s["turns"]) == 5 and s["turns"][3]["completion_ids"] == []
            continue
        if s["answer"] == "6":  # a completions call given token ids samples after them
            (call,) = s["turns"]
            assert call["prompt_ids"] == s["prompt_ids"] == [104, 105, 58]
            assert s["response_ids"] == call["completion_ids"]
            assert 1 <= len(call["completion_ids"]) <= 5
            assert s["reward_parts"]["harness.chars"] >= 0
            continue
        assert s["end"] == "error" and s["reward"] == 0.0
        assert "harness" in s["error"] and "faults.py:run" in s["error"]
        assert expected[int(s["answer"])] in s["error"], s["error"]


def test_harness_error_stops_the_run_naming_harness_and_row(fault_run, bin_dir, subprocess_env):
    proc = _run(bin_dir, subprocess_env, fault_run, f"hydra.run.dir={fault_run / 'raise'}",
                "env.harness=faults.py:run", "data.path=rows.jsonl", "trainer.max_steps=1",
                "grpo.global_batch_size=28", "env.agent.episode_timeout_s=3")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "faults.py:run on sample" in out and "prompt index" in out
    assert "Traceback" not in out


def test_configuration_errors_before_launch(fault_run, bin_dir, subprocess_env):
    (fault_run / "sync.py").write_text("def run(client, model, row):\n    return 1.0\n")
    proc = _run(bin_dir, subprocess_env, fault_run, "env.harness=sync.py:run",
                "env.path=rlbatch.env.guess_number:GuessNumber", "data.chat_template=none",
                "grpo.num_steps_async=1", "env.agent.port=70000")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    for needle in ("env.harness", "env.path=null for a harness", "data.chat_template",
                   "grpo.num_steps_async", "env.agent.port", "is not an async function"):  # fmt: skip
        assert needle in out, needle


def test_a_rewritten_history_stops_the_run_under_on_divergence_error(
    agent_run, bin_dir, subprocess_env
):
    tmp = agent_run[3]
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={tmp / 'diverge'}",
                "env.harness=harness.py:run", "trainer.max_steps=1", "env.agent.on_divergence=error")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "call 2 of episode" in out and "env.agent.on_divergence=error" in out, out[-2000:]
    assert "Traceback" not in out
