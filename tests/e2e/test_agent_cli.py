"""Agent harnesses through the real rlbatch-train (env.harness): an openai-client harness whose
episodes make a chat call, a streamed chat call that continues it (spliced: the first call's
sampled ids, never re-tokenized) and, for half the rows, a call that rewrites the history (a
split, counted, and every segment trained); every trained token checked against the
endpoint's records, the step's loss against a float64 token-mean reference; the data reward,
the reference pass and evaluation through the harness, generation one step ahead; a run
resumed exactly; and env.agent.on_divergence=error stopping the run. The faults are in
test_agent_faults_cli.py."""

from __future__ import annotations

import json
import socket
import subprocess

import numpy as np
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
    first = await client.chat.completions.create(  # one seed on every call of the episode
        model="any-name", messages=messages, max_tokens=12, temperature=0.3, logprobs=True, seed=5)
    reply = first.choices[0].message
    assert first.choices[0].logprobs is not None
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": "once more"}]
    stream = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stop=["7"], seed=5)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    if int(row["answer"]) % 2:
        await client.chat.completions.create(  # a rewritten history: a new segment
            model=model, messages=[{"role": "user", "content": "fresh " + text[:4]}])
    advertised = float(client.base_url.host == "localhost")  # env.agent.advertise_host
    return {"reward": float(len(text) % 3 == 0), "length": float(len(text)), "auth": auth,
            "advertised": advertised}
'''

AGENT_RUN = (
    "env.harness=harness.py:run", "logging.samples=true", "trainer.max_steps=2",
    "env.max_concurrency=3", "env.agent.auth_token=s3cret", "data.reward_fn=bonus.py:bonus",
    "env.agent.host=0.0.0.0", "env.agent.advertise_host=localhost",
    "grpo.beta=0.02", "eval.every_steps=2", "eval.data.path=held_out.jsonl", "eval.num_samples=1",
    "eval.at_start=false", "eval.temperature=0", "grpo.num_steps_async=1",
    "grpo.overlap_generation=false",
)  # fmt: skip
"""Generation one step ahead (inline: a harness runs in the training process): step 2 trains
the episodes the step-1 policy (version 0) ran, as the schedule names."""


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
                f"env.agent.port={_free_port()}", "trainer.checkpoint.every_steps=1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [
        [json.loads(line) for line in (run_dir / "samples" / f"step_{s:05d}.jsonl").read_text().splitlines()]
        for s in (1, 2)
    ]  # fmt: skip
    return proc, metrics, samples, tmp


def test_a_resumed_agent_run_continues_exactly(agent_run, bin_dir, subprocess_env):
    """Step 2 again, resumed in a new run directory from step 1's checkpoint (which holds the
    round generated ahead): the harness's episodes (same seeds, same calls, decoded in the
    same batches) and every metric equal the uninterrupted run's."""
    _, expected, _, tmp = agent_run
    run_dir = tmp / "resumed"
    step_1 = tmp / "run" / "checkpoints" / "step_00000001"
    resumed = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={run_dir}", *AGENT_RUN,
                   f"trainer.resume={step_1}")  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert _untimed(metrics) == _untimed(expected)
    name = "samples/step_00002.jsonl"
    assert (run_dir / name).read_text() == (tmp / "run" / name).read_text()


def _episodes(lines):
    """The logged lines of a step grouped by episode: a split episode's earlier segments, then
    its last (which carries the episode's calls under ``turns``)."""
    episodes, current = [], []
    for line in lines:
        current.append(line)
        assert line["segment"] == len(current) - 1 and line["segments"] == current[0]["segments"]
        if line["segment"] == line["segments"] - 1:
            episodes.append(current)
            current = []
    assert not current
    return episodes


def test_every_trained_token_is_one_the_endpoint_sampled(agent_run):
    """Every sampled token of every segment is trained, exactly once, with the log-probability
    the endpoint recorded; a split episode trains each of its segments; a client seed sent on
    both turns does not replay the first turn's sampling noise on the second."""
    _, _, steps, _ = agent_run
    tok = ByteTokenizer()
    spliced = lossy = same = compared = 0
    for lines in steps:
        episodes = _episodes(lines)
        assert len(episodes) == 16
        for segments in episodes:
            s = segments[-1]
            calls = s["turns"]
            assert 2 <= len(calls) <= 3 and s["error"] is None
            assert all(not part["turns"] for part in segments[:-1])
            first, second = calls[0], calls[1]
            # the harness's message as Qwen2.5's template renders it
            assert first["prompt_ids"] == tok.encode(QWEN_PROMPT)
            # the second continues the first token for token: its sampled ids, not a re-render
            history = first["prompt_ids"] + first["completion_ids"]
            assert second["spliced"] and second["prompt_ids"][: len(history)] == history
            spliced += 1
            pairs = list(zip(first["completion_ids"], second["completion_ids"], strict=False))
            same += sum(a == b for a, b in pairs)
            compared += len(pairs)
            text = tok.decode(first["completion_ids"])
            lossy += tok.encode(text) != [t for t in first["completion_ids"] if t < 256]
            # odd secrets rewrote their history at call 2: two segments, both trained
            assert len(segments) == (2 if int(s["answer"]) % 2 else 1)
            assert [c for part in segments for c in part["calls"]] == list(range(len(calls)))
            for part in segments:
                mine = [calls[i] for i in part["calls"]]
                assert part["prompt_ids"] == mine[0]["prompt_ids"]
                assert part["prompt"] == tok.decode(part["prompt_ids"])  # the trained prompt
                mask = part["loss_mask"]
                trained = [t for t, m in zip(part["response_ids"], mask, strict=True) if m]
                assert trained == [t for c in mine for t in c["completion_ids"]]
                logps = [lp for lp, m in zip(part["behaviour_logps"], mask, strict=True) if m]
                assert logps == pytest.approx([lp for c in mine for lp in c["logps"]], abs=1e-6)
                full = part["prompt_ids"] + part["response_ids"]
                assert full[: len(mine[-1]["prompt_ids"])] == mine[-1]["prompt_ids"]
                assert len(full) <= 320
                # the episode's reward and advantage, on every one of its samples
                assert (part["reward"], part["advantage"]) == (s["reward"], s["advantage"])
                assert part["truncated"] == s["truncated"]  # masked as the episode is
                assert part["group_id"] == s["group_id"]
            assert all(c["version"] == s["policy_version"] for c in calls)
            if int(s["answer"]) % 2:
                assert calls[2]["diverged"] and not calls[2]["spliced"]
    assert spliced == 32
    # both calls send seed=5, yet the second samples fresh noise (its seed is drawn from its
    # prompt too): on the near-uniform tiny model, replayed noise repeats the first reply's
    # token at most positions, fresh noise at about 1 in 256
    assert compared > 100 and same / compared < 0.1, (same, compared)
    assert lossy > 0  # some sampled bytes do not survive decode / encode: the splice kept them


def test_advantages_per_episode_and_the_token_mean_loss_in_float64(agent_run):
    """Advantages are the group's episodes' (float64 reference from the logged rewards), and the
    step-1 loss is the token mean over every trained token of every segment: at step 1 the
    policy is the sampling one and the reference (ratio 1, weight 1, KL 0), so under token_mean
    loss = -sum_i A_i n_i / sum_i n_i over the trained samples i with n_i loss tokens."""
    _, metrics, steps, _ = agent_run
    episodes = _episodes(steps[0])
    groups = {}
    for k, e in enumerate(episodes):
        groups.setdefault(e[-1]["group_id"], []).append(k)
    assert sorted(len(g) for g in groups.values()) == [4] * 4
    want = np.zeros(len(episodes), dtype=np.float64)
    for members in groups.values():
        r = np.array([episodes[k][-1]["reward"] for k in members], dtype=np.float64)
        want[members] = (r - r.mean()) / (r.std(ddof=1) + 1e-4)
    assert [e[-1]["advantage"] for e in episodes] == pytest.approx(want, abs=1e-9)
    tokens = [(want[k], float(sum(p["loss_mask"]))) for k, e in enumerate(episodes) for p in e]
    loss = -sum(a * n for a, n in tokens) / sum(n for _, n in tokens)
    last_only = [(want[k], float(sum(e[-1]["loss_mask"]))) for k, e in enumerate(episodes)]
    dropped = -sum(a * n for a, n in last_only) / sum(n for _, n in last_only)
    assert abs(loss - dropped) > 1e-3  # the earlier segments weigh: the check can tell
    assert metrics[0]["loss"] == pytest.approx(loss, abs=2e-5)


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
    assert sum(r["episode_splits"] for r in metrics) > 0
    # run-ahead by one step: both rounds' episodes ran on version 0, step 2's one step stale
    assert [r["staleness_mean"] for r in metrics] == [0.0, 1.0]
    assert {s["policy_version"] for lines in steps for s in lines} == {0}
    for r, lines in zip(metrics, steps, strict=True):
        samples = [e[-1] for e in _episodes(lines)]
        odd = sum(int(s["answer"]) % 2 for s in samples)
        assert r["episode_splits"] == odd
        assert len(lines) == 16 + odd  # each split is one more trained sample
        assert r["samples"] == 16  # grpo.global_batch_size counts episodes
        assert "episode_untrained_tokens" not in r
        assert r["turns_mean"] == pytest.approx(sum(len(s["turns"]) for s in samples) / 16)
        for s in samples:
            assert s["reward_parts"]["harness.auth"] == 1.0  # answer 0: checked against 401
            # bound to every interface, the harness's base_url names the advertised host
            assert s["reward_parts"]["harness.advertised"] == 1.0
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
    """The MoE policy's episodes (tiny_moe: the per-row decoder runs megatron's MoE layers)
    decode their first calls, and the rewritten history of a second call stops the run."""
    tmp = agent_run[3]
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={tmp / 'diverge'}",
                "env.harness=harness.py:run", "trainer.max_steps=1", "env.agent.on_divergence=error",
                "model=tiny_moe")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "call 2 of episode" in out and "env.agent.on_divergence=error" in out, out[-2000:]
    assert "Traceback" not in out


def test_an_moe_policy_runs_harnesses_at_dp2_ep2(bin_dir, subprocess_env, tmp_path):
    """A transformers-made Qwen3-MoE (decisive routing) at dp 2 x ep 2 on the built-in engine:
    each rank's harnesses call when they like (odd answers make a third call), so a rank
    decodes while its expert-parallel peer has no call, or has ended its calls first; the peer
    runs idle forwards in step (rlbatch.rollout.agent.decoders; 312 in these 2 steps, counted
    by hand). Both steps complete and train on-policy: the behaviour log-probs the decoder
    sampled with at ep 2 are the trainer's, and at step 1 transformers' float64 forward of
    the checkpoint. Evaluation's harness episodes run in step too. (By hand: the same run at
    ep 1 samples the same 22 and 24 segments, and its losses agree to 1e-6.)"""
    from hf_reference import moe_reference, save_tiny_qwen3_moe

    tmp = tmp_path
    (tmp / "harness.py").write_text(HARNESS)
    rows = [{"prompt": "guess 0-9:", "answer": str(a)} for a in (1, 2, 3, 4)]
    (tmp / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = tmp / "moe_hf"
    save_tiny_qwen3_moe(hf, max_positions=512)
    run_dir = tmp / "moe_ep2"
    proc = _run(bin_dir, subprocess_env, tmp, f"hydra.run.dir={run_dir}", "env.harness=harness.py:run",
                "trainer.max_steps=2", "env.max_concurrency=3", f"model.hf_path={hf}",
                "model.tokenizer=bytes", "parallel.dp=2", "parallel.ep=2",
                "grpo.num_generations=2", "logging.samples=true", "eval.every_steps=2",
                "eval.data.path=held_out.jsonl", "eval.num_samples=1", "eval.at_start=false")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(abs(r["mismatch_kl_k1"]) < 1e-6 for r in metrics)
    assert all(r["episode_splits"] > 0 and r["samples"] == 16 for r in metrics)
    assert metrics[-1]["eval/num_prompts"] == 4.0  # evaluation's episodes, in step too
    lines = (run_dir / "samples" / "step_00001.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    rows = [s["prompt_ids"] + s["response_ids"] for s in samples]
    want, _ = moe_reference(hf, rows)
    error = max(  # the sampled tokens (the others: the harness's messages, spliced in)
        abs(a - b)
        for s, ref in zip(samples, want, strict=True)
        for a, b, m in zip(
            s["behaviour_logps"], ref[len(s["prompt_ids"]) - 1 :], s["loss_mask"], strict=True
        )
        if m
    )
    assert error <= 1e-5  # 2.8e-7 measured


def test_rlbatch_eval_runs_the_harness_on_a_checkpoint(agent_run, bin_dir, subprocess_env):
    _, _, _, tmp = agent_run
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-eval"), str(tmp / "run"), "--json", "eval.num_samples=2",
         "eval.temperature=1.0",
         # the run's port was free when it trained, minutes ago: anything may hold it now
         f"env.agent.port={_free_port()}"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["step"] == 2 and report["metrics"]["eval/num_prompts"] == 4.0
    for line in open(report["samples"]):
        for sample in json.loads(line)["samples"]:
            assert sample["reward"] in (0.25, 1.25)
