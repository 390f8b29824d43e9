"""Agent harnesses through the real rlbatch-train (env.harness): an openai-client harness whose
episodes make a chat call, a streamed chat call that continues it (spliced: the first call's
sampled ids, never re-tokenized) and, for half the rows, a call that rewrites the history (a
split, counted); every trained token checked against the endpoint's records; the data reward,
the reference pass and evaluation through the harness; a SIGKILLed run resumed exactly; and
env.agent.on_divergence=error stopping the run. The faults are in test_agent_faults_cli.py."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from agent_runs import train as _run
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

AGENT_RUN = (
    "env.harness=harness.py:run", "logging.samples=true", "trainer.max_steps=2",
    "env.max_concurrency=3", "env.agent.auth_token=s3cret", "data.reward_fn=bonus.py:bonus",
    "grpo.beta=0.02", "eval.every_steps=2", "eval.data.path=held_out.jsonl", "eval.num_samples=1",
    "eval.at_start=false", "eval.temperature=0",
)  # fmt: skip


QWEN_PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n<|im_start|>user\nguess 0-9:<|im_end|>\n<|im_start|>assistant\n"
)


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
    rows = [{"prompt": "guess 0-9:", "answer": str(a)} for a in (1, 2, 3, 4)]
    (tmp / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
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
            # the harness's message as Qwen2.5's template renders it
            assert first["prompt_ids"] == tok.encode(QWEN_PROMPT)
            assert s["prompt"] == tok.decode(
                s["prompt_ids"]
            )  # the logged prompt is the trained one
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


def test_evaluation_runs_the_harness(agent_run):
    """eval.every_steps with a harness: its episodes on the held-out rows, greedy, scored by the
    harness's reward plus the data reward."""
    _, metrics, _, tmp = agent_run
    assert "eval/reward_mean" in metrics[1]
    lines = (tmp / "run" / "eval" / "step_00002.jsonl").read_text().splitlines()
    results = [json.loads(x) for x in lines]
    assert [r["reference"] for r in results] == ["1", "2", "3", "4"]
    for r in results:
        (sample,) = r["samples"]
        assert sample["reward"] in (0.25, 1.25)  # the harness's 0 or 1, plus the 0.25 bonus


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


def test_rlbatch_eval_runs_the_harness_on_a_checkpoint(agent_run, bin_dir, subprocess_env):
    _, _, _, tmp = agent_run
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-eval"), str(tmp / "run"), "--json", "eval.num_samples=2",
         "eval.temperature=1.0"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["step"] == 2 and report["metrics"]["eval/num_prompts"] == 4.0
    for line in open(report["samples"]):
        for sample in json.loads(line)["samples"]:
            assert sample["reward"] in (0.25, 1.25)
