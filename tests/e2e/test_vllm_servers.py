"""rollout.backend=vllm_server through the real commands, with real vLLM servers on 127.0.0.1
(the ``vllm`` extra): rlbatch-serve starts one server per run config and prints its URL once
/health answers; rlbatch-train learns on two of them (rollout.servers.urls), the weights pushed
through vLLM's RL lifecycle by rlbatch's transfer plugin before every step, vLLM's behaviour
log-probs the trainer's own at every step, evaluation on the same servers; an unreachable URL,
one that is no vLLM server and one without a scheme are configuration errors before launch; rollout.servers.count=1 starts its server beside
training (an MoE policy at dp 2 x ep 2 rolled out by an agent harness, every rank syncing at
its round's start) and leaves no process behind, also when the launcher is SIGKILLed; with
rollout.servers.on_failure=restart, that server SIGKILLed while it samples is started again,
synced and probed, and the run finishes on the current weights; a server shorter
than the run is refused before launch; multi-turn episodes and a dp 2 trainer (resumed exactly from its step-1 checkpoint
while the servers hold its later weights, its weights broadcast over a gloo group with the
servers) run on the servers;
rows another client's pause aborts are sent again and train as on an undisturbed server; a
server restarted at its URL (unlabelled start-up weights) stops the run naming it;
an rlbatch-serve asked to stop (SIGTERM) while vLLM starts stops at once; an rlbatch-serve
SIGKILLed with its process group takes its vLLM server with it, and the run
on it stops within seconds naming the server, after saving the last completed step, with the
command that continues it; a server relabelled by another client stops the run (inline, or
from the generation worker of an overlapping run); a server whose engine stopped behind a
live HTTP server fails its requests within seconds and, with
rollout.servers.on_failure=continue, leaves the pool (and the broadcast group) while the run
finishes on the other one with the metrics of a run on that one alone with the file transfer;
async run-ahead overlaps training at dp 2 with the inline run's samples; an agent harness's
episodes keep their server and train on policy (rollout.servers.routing=least_loaded spreads
them: rlbatch-bench fleet); partial rollouts
continue rows across weight updates (abort:
bit-identical to the in-process vLLM stream, resumed exactly; keep: on the old prefix cache).
The servers (two shared, the second killed by the last test; a spare to relabel, restart and
kill) are started once for the session."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from vllm_pool import BLOCK, MODEL, PROCS, SERVED_LEN, free_port, serve, started_url

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.optional_extra]


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (vLLM's engine core names itself
    VLLM::EngineCore: its command line does not mention the run)."""
    members = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(pid))
    return members


def _health(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        return r.status


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:200]}")
    return found


@pytest.fixture(scope="module")
def all_servers(vllm_server_pool):
    """The session's three servers (tests/vllm_pool.py)."""
    return vllm_server_pool


@pytest.fixture(scope="module")
def servers(all_servers):
    """The two servers the run tests share."""
    return all_servers[:2]


@pytest.fixture(scope="module")
def spare_server(all_servers):
    """A server a test may kill."""
    return all_servers[2]


def _train(bin_dir, env, run_dir, *overrides):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), *MODEL, "rollout.backend=vllm_server",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", *overrides],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600,
    )  # fmt: skip


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(records):
    """The records without their clock and memory figures (which differ between two runs)."""
    return [
        {k: v for k, v in r.items()
         if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
        for r in records
    ]  # fmt: skip


def _urls(urls):
    return "rollout.servers.urls=[" + ",".join(urls) + "]"


def test_rlbatch_serve_prints_its_url_once_healthy(all_servers):
    """stdout carries the URL alone (vLLM's own output goes to stderr), and the server answers
    /health there."""
    assert len(set(all_servers)) == 3
    for url in all_servers:
        assert _health(url) == 200


EVAL = (
    "eval.every_steps=2", "eval.at_start=false", "eval.max_prompts=4", "eval.num_samples=2",
    "eval.temperature=1.0", "eval.max_new_tokens=6",
)  # fmt: skip


def test_training_on_two_servers_is_on_policy_at_every_step(
    servers, bin_dir, subprocess_env, tmp_path
):
    """Two steps at temperature 0.7 on the two servers: before every step's generation the
    weights are pushed to both (rollout/weight_sync_s) and checked by the probe, and the
    servers' behaviour log-probs equal the training forward's to float32 rounding (a missed
    sync, a stale tied head or a stale prefix cache would show as importance weights far from
    1); the policy moves (kl > 0), and the evaluation after step 2 runs on the same servers.
    The weights file of a trainer killed mid-sync (a whole model, in rollout.servers.transfer_dir)
    is swept by the next sync on the machine; the run leaves none of its own."""
    run_dir = tmp_path / "run"
    transfer_dir = tmp_path / "transfer"
    transfer_dir.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = transfer_dir / f"rlbatch-weights-{gone.pid}-0123abcd-{socket.gethostname()}.safetensors"
    left.write_bytes(b"a whole model")
    urls = "[" + ",".join(servers) + "]"
    proc = _train(
        bin_dir, subprocess_env, run_dir, f"rollout.servers.urls={urls}", "trainer.max_steps=2",
        "rollout.temperature=0.7", "grpo.epsilon_low=0.01", "grpo.epsilon_high=0.01", *EVAL,
        f"rollout.servers.transfer_dir={transfer_dir}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(transfer_dir.iterdir()) == []
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/weight_sync_s"] > 0
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["clip_fraction"] == 0.0
    assert records[-1]["kl"] > 0
    assert any(k.startswith("eval/") for k in records[-1]), sorted(records[-1])
    assert (run_dir / "eval" / "step_00002.jsonl").exists()


def _post(url: str, path: str) -> None:
    request = urllib.request.Request(f"{url}{path}", data=b"", method="POST")
    urllib.request.urlopen(request, timeout=60).close()


def _keep_pausing(url: str, stop: threading.Event) -> None:
    """Another client of the server: POST /pause (its default mode aborts the requests in
    flight) and /resume, again and again until ``stop``."""
    while not stop.is_set():
        try:
            _post(url, "/pause")
            time.sleep(0.05)
            _post(url, "/resume")
        except urllib.error.HTTPError:  # refused during the run's own weight update
            pass
        stop.wait(0.25)


PAUSED = ("trainer.max_steps=3", "logging.samples=true")


def test_rows_another_client_aborts_are_sent_again_and_train_as_undisturbed(
    servers, bin_dir, subprocess_env, tmp_path
):
    """While another client keeps pausing the server (POST /pause aborts what is in flight,
    and vLLM answers an aborted request with HTTP 200, the tokens so far and the run's own
    label), every aborted row is sent again with its own seed (rollout/server_resubmits > 0):
    each trained response that is not truncated ends in EOS, and the run trains exactly the
    samples of the same run on an undisturbed server."""
    from rlbatch.engine.tokenizer import ByteTokenizer

    url = servers[0]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = _train(bin_dir, subprocess_env, ref_dir, _urls([url]), *PAUSED)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    stop = threading.Event()
    pauser = threading.Thread(target=_keep_pausing, args=(url, stop), daemon=True)
    pauser.start()
    try:
        proc = _train(bin_dir, subprocess_env, run_dir, _urls([url]), *PAUSED)
    finally:
        stop.set()
        pauser.join(60)
        _post(url, "/resume")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3]
    eos = set(ByteTokenizer().eos_ids)
    for step in (1, 2, 3):
        samples, expected = _samples(run_dir, step), _samples(ref_dir, step)
        for s in samples:
            assert s["truncated"] or s["response_ids"][-1] in eos, (step, s["response_ids"])
        assert [s["response_ids"] for s in samples] == [s["response_ids"] for s in expected]
        assert [s["truncated"] for s in samples] == [s["truncated"] for s in expected]
        for s, e in zip(samples, expected, strict=True):
            assert s["behaviour_logps"] == pytest.approx(e["behaviour_logps"], abs=1e-5)
    resubmits = [r["rollout/server_resubmits"] for r in _records(run_dir)]
    assert sum(resubmits) > 0, "no row was aborted: the test shows nothing"
    assert all(r["rollout/server_resubmits"] == 0 for r in _records(ref_dir))


def test_an_unreachable_server_is_refused_before_launch(bin_dir, subprocess_env, tmp_path):
    """Before any worker, one error per bad URL naming the key, the URL and what is wrong with
    it: nobody answers at the first (refused), the second answers HTTP but is no vLLM server
    (a plain file server: GET /health is 404), and the third has no scheme (said once, as
    such, not also as unreachable)."""
    pytest.importorskip("vllm")
    refused = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path, env=subprocess_env,
    )  # fmt: skip
    try:
        not_vllm = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not _answers(not_vllm):
            assert time.monotonic() < deadline, "python -m http.server did not start"
            time.sleep(0.2)
        no_scheme = f"127.0.0.1:{port}"
        urls = f"rollout.servers.urls=[{refused},{not_vllm},{no_scheme}]"
        proc = _train(bin_dir, subprocess_env, tmp_path / "run", urls)
    finally:
        other.terminate()
        other.wait()
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert f"rollout.servers.urls={refused}: is unreachable" in out, out[-3000:]
    assert "refused the connection" in out and "rlbatch-serve" in out
    assert f"rollout.servers.urls={not_vllm}: answers, but not as a vLLM rollout server" in out
    assert "GET /health answered 404" in out
    assert f"rollout.servers.urls={no_scheme}: is not an http:// or https:// URL" in out
    assert out.count(f"rollout.servers.urls={no_scheme}") == 1, out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except OSError:
        return False
    return True


def test_a_server_shorter_than_the_run_is_refused_before_launch(
    servers, bin_dir, subprocess_env, tmp_path
):
    """Servers started for sequences of 160 tokens and a run of 232: vLLM's token endpoint
    would silently stop every response at the server's --max-model-len (finish_reason
    "length", trained as truncated rows); instead each URL is named with both lengths and the
    fix, before any worker starts."""
    run_dir = tmp_path / "run"
    proc = _train(bin_dir, subprocess_env, run_dir, _urls(servers), "rollout.max_new_tokens=200")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for url in servers:
        assert (
            f"rollout.servers.urls={url}: serves sequences of at most {SERVED_LEN} tokens" in out
        ), out
    assert "this run's longest is 232" in out and "rlbatch-serve" in out
    assert not (run_dir / "metrics.jsonl").exists()


COUNTED_ENV = """
import os

from rlbatch.env.guess_number import GuessNumber


class Counted(GuessNumber):
    def step(self, state, text):
        with open(f"steps.{os.getpid()}", "a") as f:
            f.write("s")
        return super().step(state, text)
"""


def test_multi_turn_episodes_run_on_the_servers(servers, bin_dir, subprocess_env, tmp_path):
    """The guess-the-number recipe (the same tiny model) on the two servers from a trainer of
    tp 2 x pp 2 (one model-parallel group of four ranks: its first rank sends the requests and
    steps the environment, the weights are gathered from the four shards): a turn per request
    continuing the row's exact ids, the environment stepped by one process only, observations
    without loss, every turn of an episode on one server (new episodes on both), and the
    servers' behaviour log-probs of the assistant tokens the trainer's at both steps."""
    from rlbatch.engine.tokenizer import ByteTokenizer

    (tmp_path / "counted.py").write_text(COUNTED_ENV)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", *MODEL[1:],
         "rollout.backend=vllm_server", _urls(servers), "env.path=counted.py:Counted",
         "parallel.tp=2", "parallel.pp=2",
         "trainer.max_steps=2", "grpo.global_batch_size=32", "logging.samples=true",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1.0 <= r["turns_mean"] <= r["turns_max"] <= 4 and r["env_errors"] == 0
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert len(list(tmp_path.glob("steps.*"))) == 1
    tok, observed, used = ByteTokenizer(), 0, set()
    for step in (1, 2):
        lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
        for s in map(json.loads, lines):
            pos = 0
            for turn in s["turns"]:
                ids = s["response_ids"][pos : pos + turn["tokens"]]
                mask = s["loss_mask"][pos : pos + turn["tokens"]]
                if turn["role"] == "observation":
                    assert ids == tok.encode(turn["text"]) and mask == [0] * len(ids)
                    observed += 1
                else:
                    assert mask == [1] * len(ids)
                pos += turn["tokens"]
            assert pos == len(s["response_ids"])
            # every turn of an episode on one server (its prefix cache holds the conversation)
            said = {t.get("server") for t in s["turns"] if t["role"] == "assistant"}
            assert len(said) == 1 and said <= set(servers), said
            used |= said
    assert observed > 0
    assert used == set(servers)  # new episodes spread over both


AGENT_HARNESS = """
async def run(client, model, row):
    prompt, score = f"count {row['answer']}:", 0.0
    for turn in range(3):  # each call's prompt: the last one, its completion, one more line
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=6)
        text = out.choices[0].text
        score += float(any(c.isdigit() for c in text)) / 3
        prompt += text + f" {turn}:"
    return score
"""


def test_agent_episodes_keep_their_server_and_train_on_policy(
    servers, bin_dir, subprocess_env, tmp_path
):
    """An openai-client harness of three completion calls per episode on the two servers
    (rollout.backend=vllm_server): every call of an episode goes to one server (its prefix
    cache holds the episode), new episodes spread over both, each call is trained with the
    log-probs the server sampled it with (the trainer's own at both steps, after the weights
    moved), and every sampled token of every segment is trained."""
    (tmp_path / "harness.py").write_text(AGENT_HARNESS)
    chat = [{"role": "system", "content": "count"}, {"role": "user", "content": "go"}]
    rows = [{"prompt": chat, "answer": str(k)} for k in range(8)]  # short under the template
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, _urls(servers), "env.harness=harness.py:run",
        "data.source=jsonl", "data.path=rows.jsonl", "data.reward=none",
        "data.chat_template=qwen", "data.max_prompt_len=96", "env.max_total_tokens=150",
        "rollout.max_new_tokens=8", "grpo.global_batch_size=8", "grpo.num_generations=2",
        "trainer.max_steps=2", "logging.samples=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["samples"] == 8 and r["turns_mean"] == 3.0
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    used = set()
    for step in (1, 2):
        lines = [json.loads(x) for x in (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()]  # fmt: skip
        episodes = [s for s in lines if s["segment"] == s["segments"] - 1]
        assert len(episodes) == 8
        for s in episodes:
            calls = s["turns"]
            assert len(calls) == 3 and len({c["server"] for c in calls}) == 1
            assert calls[0]["server"] in servers
            used.add(calls[0]["server"])
        sampled = sorted(t for s in episodes for c in s["turns"] for t in c["completion_ids"])
        trained = sorted(
            t for s in lines for t, m in zip(s["response_ids"], s["loss_mask"], strict=True) if m
        )
        assert trained == sampled  # every call of every segment, once
    assert used == set(servers)


def test_the_fleet_bench_compares_affine_and_least_loaded_routing(
    servers, bin_dir, subprocess_env, tmp_path
):
    """rlbatch-bench fleet on the two shared servers (--urls): a 4-call harness run with
    rollout.servers.routing=affine keeps every episode on one server, the same run with
    least_loaded spreads episodes' calls over both; each policy's prefix-cache hit rate (from
    the servers' /metrics) and step time are printed (figures for docs/agents.md, not a
    target)."""
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-bench"), "fleet", "--urls", ",".join(servers), "--steps", "1",
         "--warmup", "0", "--rows", "4", "--max-tokens", "6", "--json", "--",
         "rollout.vllm.kv_cache_space_gb=0.25"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads(proc.stdout)
    assert list(table) == ["affine", "least_loaded"]
    for row in table.values():
        assert row["refused"] is None, row
        assert row["prompt_tokens"] > 0 and 0.0 <= row["prefix_cache_hit_rate"] <= 1.0
        assert row["step_time_s"] > 0 and row["servers"] == 2
    assert table["affine"]["one_server_episodes"] == 1.0
    assert table["least_loaded"]["one_server_episodes"] < 1.0


DP2 = (
    "parallel.dp=2", "trainer.max_steps=2", "trainer.checkpoint.every_steps=1",
    "eval.every_steps=2", "eval.at_start=true", "eval.max_prompts=1", "eval.num_samples=2",
    "eval.max_new_tokens=6", "rollout.servers.transfer=broadcast",
)  # fmt: skip
"""Two data-parallel replicas (each sends its own rows to the servers; the first one pushes
the weights, broadcast over one group with both servers, the second waits for them) and an
evaluation of one prompt, which only the first replica has rows for."""


def test_a_dp2_run_on_servers_resumes_with_identical_metrics(
    servers, bin_dir, subprocess_env, tmp_path
):
    """A dp 2 trainer on the two servers, evaluated at steps 0 and 2 on one prompt (the second
    replica has no rows then): on-policy at every step (the second replica generates only
    once the servers hold the weights the first pushed). Step 2 again, resumed in a new run
    directory from step 1's checkpoint while the servers hold the finished run's step-2
    weights: the resumed trainer forms a new group, pushes the checkpoint's weights before it
    generates, and the metrics equal the uninterrupted run's exactly. (A trainer killed with
    its group still open on the servers: test_server_sync_cli.py, at every phase of a sync.)"""
    ref_dir = tmp_path / "ref"
    ref = _train(bin_dir, subprocess_env, ref_dir, _urls(servers), *DP2)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _records(ref_dir)
    assert [r["step"] for r in expected] == [0, 1, 2]
    for r in expected[1:]:
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert expected[0]["eval/num_prompts"] == expected[2]["eval/num_prompts"] == 1
    run_dir = tmp_path / "resumed"
    step_1 = ref_dir / "checkpoints" / "step_00000001"
    resumed = _train(bin_dir, subprocess_env, run_dir, _urls(servers), *DP2,
                     f"trainer.resume={step_1}")  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _untimed(_records(run_dir)) == _untimed(expected)


def _start_long_run(bin_dir, env, run_dir, *overrides) -> subprocess.Popen:
    """rlbatch-train on the servers for 20 steps, in the background (a test stops it)."""
    return subprocess.Popen(
        [str(bin_dir / "rlbatch-train"), *MODEL, "rollout.backend=vllm_server", *overrides,
         "trainer.max_steps=20", f"hydra.run.dir={run_dir}", "logging.plot=false",
         "logging.tensorboard=false", "trainer.checkpoint.export_hf=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=run_dir.parent,
    )  # fmt: skip


def _first_step(launcher: subprocess.Popen, run_dir) -> float:
    """Wait until the run logged its first step (it must not have ended); its deadline."""
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists():
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    return deadline


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_weights_another_process_put_on_a_server_stop_the_run(
    spare_server, bin_dir, subprocess_env, tmp_path, overlap
):
    """Once step 1 is recorded, another client keeps relabelling the server's weights (the last
    call of its own weight update, as a second run or rlbatch-eval sharing the server would
    make): the run stops naming the server and both labels, instead of training on samples of
    a policy it never had. With generation overlapping training (grpo.num_steps_async=1: the
    failure arrives from the generation worker's process) it reaches the loop as a rollout
    failure all the same: the ranks agree on it, and the launcher prints the command that
    continues the run."""
    run_dir = tmp_path / "run"
    extra = ("grpo.num_steps_async=1",) if overlap else ()
    launcher = _start_long_run(bin_dir, subprocess_env, run_dir, _urls([spare_server]), *extra)
    try:
        deadline = _first_step(launcher, run_dir)
        body = json.dumps({"new_version": "intruder"}).encode()
        while launcher.poll() is None and time.monotonic() < deadline:
            request = urllib.request.Request(
                f"{spare_server}/update_weight_version", data=body,
                headers={"Content-Type": "application/json"}, method="POST",
            )  # fmt: skip
            urllib.request.urlopen(request, timeout=10).close()
            time.sleep(0.2)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode != 0
    expected = f"rollout server {spare_server} sampled with weights labelled 'intruder'"
    assert expected in out, out[-3000:]
    assert "generation failed on rank 0" in out, out[-3000:]  # the ranks' agreement
    assert "Continue this run with:" in out, out[-3000:]
    assert len(_records(run_dir)) < 20


def _server_group(url: str) -> int:
    """The process group of the vLLM server listening at ``url`` (its own session)."""
    port = url.rsplit(":", 1)[1]
    (server,) = [p for p in _processes_mentioning(f"--port {port} ") if "-m vllm.entrypoints" in p]
    return os.getpgid(int(server.split(":")[0]))


def _serve_group(url: str) -> int:
    """The process group of the rlbatch-serve command that serves ``url`` (a group of its own,
    as a shell job has)."""
    port = url.rsplit(":", 1)[1]
    (serve,) = [
        p for p in _processes_mentioning(f"rollout.servers.port={port}") if "rlbatch-serve" in p
    ]
    return os.getpgid(int(serve.split(":")[0]))


RESTARTING_ENV = """
import pathlib
import time

from rlbatch.env.guess_number import GuessNumber


class Restarting(GuessNumber):
    def step(self, state, text):
        done = pathlib.Path("restart.done")
        if not done.exists():  # the test restarts the server meanwhile
            pathlib.Path("restart.request").touch()
            deadline = time.monotonic() + 500
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        return super().step(state, text)
"""


def _restart(url: str, bin_dir, env, cwd) -> None:
    """Stop the vLLM server at ``url`` (SIGTERM to its process group) and start a fresh
    rlbatch-serve on the same port, which serves its start-up weights."""
    pgid = _server_group(url)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _group_members(pgid):
        os.killpg(pgid, signal.SIGKILL)
    port = int(url.rsplit(":", 1)[1])
    proc = serve(bin_dir, env, cwd, port)
    PROCS.append(proc)
    assert started_url(proc, cwd, port) == url


def test_a_server_restarted_at_its_url_mid_run_stops_the_run_naming_it(
    spare_server, bin_dir, subprocess_env, tmp_path
):
    """Multi-turn episodes on the spare server; while the environment steps the first turns
    (no request in flight), the server is restarted at the same URL: the next turn's tokens
    come from its start-up weights (vLLM labels them "default"), and the run stops naming the
    server and the restart instead of training on a policy it never had. (The restarted server stays for the later tests.)"""
    (tmp_path / "restarting.py").write_text(RESTARTING_ENV)
    run_dir = tmp_path / "run"
    with open(tmp_path / "out.txt", "w") as out:
        launcher = subprocess.Popen(
            [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", *MODEL[1:],
             "rollout.backend=vllm_server", _urls([spare_server]),
             "env.path=restarting.py:Restarting", "env.timeout_s=900", "trainer.timeout_s=900",
             "trainer.max_steps=2",
             f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
             "trainer.checkpoint.export_hf=false"],
            stdout=out, stderr=subprocess.STDOUT, env=subprocess_env, cwd=tmp_path,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "restart.request").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        _restart(spare_server, bin_dir, subprocess_env, tmp_path)
        (tmp_path / "restart.done").touch()
        launcher.wait(300)
    finally:
        launcher.kill()
        launcher.wait()
    text = (tmp_path / "out.txt").read_text()
    assert launcher.returncode != 0, text[-3000:]
    assert f"rollout server {spare_server} sampled with its start-up weights" in text, text[-3000:]
    assert "restarted at the same URL" in text
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_server_killed_mid_run_stops_the_run_naming_it(
    servers, spare_server, bin_dir, subprocess_env, tmp_path
):
    """Training on a shared server and the spare one (rollout.servers.timeout_s at its default
    of 300 s), saving every 50 steps; the spare's rlbatch-serve SIGKILLed with its whole
    process group once step 1 is recorded (what a closed terminal or a job scheduler sends):
    the vLLM server it started, in a session of its own, dies with it at once (API server and
    engine core), the run stops within seconds with an error naming the dead server and the
    command that continues it, leaves no worker behind, and the last step it completed was
    saved before it stopped (trainer.resume=auto continues there)."""
    run_dir = tmp_path / "run"
    pgid = _server_group(spare_server)
    assert len(_group_members(pgid)) >= 2  # the API server and its engine core
    launcher = _start_long_run(bin_dir, subprocess_env, run_dir, _urls([servers[0], spare_server]))
    try:
        _first_step(launcher, run_dir)
        os.killpg(_serve_group(spare_server), signal.SIGKILL)
        killed_at = time.monotonic()
        while _group_members(pgid) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        server_gone_after = time.monotonic() - killed_at
        out, _ = launcher.communicate(timeout=400)
        stopped_after = time.monotonic() - killed_at
    finally:
        launcher.kill()
        launcher.wait()
    print(f"vLLM gone {server_gone_after:.1f} s, run stopped {stopped_after:.1f} s after the kill")
    assert _group_members(pgid) == [], "vLLM outlived the rlbatch-serve that started it"
    assert server_gone_after < 5
    assert launcher.returncode != 0
    assert f"rollout server {spare_server}" in out, out[-3000:]
    # seconds (the save of the last step included), not rollout.servers.timeout_s (300 s)
    assert stopped_after < 90, f"the run took {stopped_after:.0f} s to stop"
    assert "Continue this run with:" in out and "trainer.resume=auto" in out, out[-3000:]
    assert f"hydra.run.dir={run_dir.resolve()}" in out.split("Continue this run with:")[1]
    done = len(_records(run_dir))
    assert 1 <= done < 20
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{done:08d}"]
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(run_dir)) == []


MOE_HARNESS = """
import os

_episodes = 0


async def run(client, model, row):
    global _episodes
    _episodes += 1
    if os.environ["RANK"] == "1" and _episodes <= 8:  # rank 1's first round: no call at all
        raise RuntimeError("the tool failed before the first call")
    prompt, score = f"count {row['answer']}:", 0.0
    for turn in range(3):
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=6)
        score += float(any(c.isdigit() for c in out.choices[0].text)) / 3
        prompt += out.choices[0].text + f" {turn}:"
    return score
"""


def test_servers_started_by_the_run_stop_with_it(bin_dir, subprocess_env, tmp_path):
    """rollout.servers.count=1: the launcher starts a server, trains on it, and stops it: no
    process of the run is left once rlbatch-train returns. The policy is MoE (tiny Qwen3-MoE)
    with its experts split over dp 2 x ep 2, rolled out by an agent harness (three calls an
    episode): the first replica's stream gathers the other replica's experts, the transfer
    plugin's check finds every layer whole, and the probe passes after each sync.
    Each sync is collective over the expert group, so every rank syncs at its round's start,
    not at its first call: in round 1 rank 1's episodes make no call at all (they fail, scored
    0 under env.on_error=zero_reward), and the run goes on; at both steps (the second with
    updated experts) vLLM's logprobs of the sampled tokens are the trainer's."""
    pytest.importorskip("vllm")
    (tmp_path / "harness.py").write_text(MOE_HARNESS)
    chat = [{"role": "system", "content": "count"}, {"role": "user", "content": "go"}]
    rows = [{"prompt": chat, "answer": str(k)} for k in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, "rollout.servers.count=1", "trainer.max_steps=2",
        "model=tiny_moe", "model.head_dim=32", "parallel.dp=2", "parallel.ep=2",
        "env.harness=harness.py:run", "env.on_error=zero_reward", "data.source=jsonl",
        "data.path=rows.jsonl", "data.reward=none", "data.chat_template=qwen",
        "data.max_prompt_len=96", "env.max_total_tokens=150", "rollout.max_new_tokens=8",
        "grpo.global_batch_size=16", "grpo.num_generations=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2] and records[-1]["kl"] > 0
    assert [r["env_errors"] for r in records] == [8, 0]  # rank 1's first round
    for record in records:
        assert abs(record["mismatch_kl_k1"]) < 1e-6 and record["rollout/weight_sync_s"] > 0
        assert record["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(run_dir)) == []


def _sampling(url: str) -> bool:
    """The server is sampling requests now; False also while it cannot be reached."""
    try:
        return _requests_running(url) > 0
    except OSError:
        return False


def test_a_server_the_run_started_is_restarted_and_resynced_after_a_sigkill(
    bin_dir, subprocess_env, tmp_path
):
    """rollout.servers.on_failure=restart: once the first step trained, the run's only server
    (vLLM's whole process group) is SIGKILLed while it samples a later step's rows (or, should
    the test not see it sampling within a second, wherever the run is then). The launcher starts it
    again at the same URL; the worker's requests fail (or the sync finds it down), wait for it,
    push it the current weights and probe it, then go on: one restart counted, and every step's
    samples, the step after the restart's included, from the weights the trainer held (vLLM's
    log-probs the trainer's own). Then the launcher is SIGKILLed while the restarted server
    runs: the server (vLLM's whole process group) and the workers end by themselves, and no
    process of the run (the first server's group, the restarted one) is left."""
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = subprocess.Popen(
        [str(bin_dir / "rlbatch-train"), *MODEL, "rollout.backend=vllm_server",
         "rollout.servers.count=1", "rollout.servers.on_failure=restart",
         "rollout.servers.max_restarts=1", "trainer.max_steps=50", f"hydra.run.dir={run_dir}",
         "logging.plot=false", "logging.tensorboard=false", "trainer.checkpoint.export_hf=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env,
        cwd=tmp_path,
    )  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(launcher.communicate()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 400
        while not (run_dir / "metrics.jsonl").exists():  # trained a step on its server
            assert launcher.poll() is None and time.monotonic() < deadline, out
            time.sleep(0.05)
        (server,) = [p for p in _processes_mentioning(str(run_dir)) if "-m vllm.entrypoints" in p]
        pgid = os.getpgid(int(server.split(":")[0]))
        url = "http://127.0.0.1:" + server.split("--port ")[1].split()[0]
        # a later step's rows, when the test sees them within a second (vLLM's gauge of
        # running requests may lag a fast step)
        sampling_by = time.monotonic() + 1.0
        while not _sampling(url) and time.monotonic() < sampling_by:
            time.sleep(0.02)
        assert launcher.poll() is None, out
        os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 400
        while not _restarted_then_stepped(_complete_records(run_dir)):
            assert launcher.poll() is None and time.monotonic() < deadline, out
            time.sleep(0.2)
        (restarted,) = [
            p for p in _processes_mentioning(str(run_dir)) if "-m vllm.entrypoints" in p
        ]
        new_pgid = os.getpgid(int(restarted.split(":")[0]))
        assert new_pgid != pgid and len(_group_members(new_pgid)) >= 2  # API server, engine
    finally:
        launcher.kill()
        reader.join(30)
    stderr = out[1] if len(out) == 2 else ""
    records = _records(run_dir)
    restarts = [r["rollout/server_restarts"] for r in records]
    assert restarts[0] == 0.0 and sum(restarts) == 1.0, restarts
    for record in records:  # on the weights the trainer held, before and after the restart
        assert abs(record["mismatch_kl_k1"]) < 1e-6
        assert record["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert record["rollout/servers_alive"] == 1.0
    assert records[-1]["kl"] > 0  # the policy moved: the restarted server took new weights
    assert "is down: out of the pool until it is restarted" in stderr, stderr[-5000:]
    assert "is back in the pool (restart 1)" in stderr, stderr[-5000:]
    deadline = time.monotonic() + 60
    while (
        _processes_mentioning(str(run_dir)) or _group_members(pgid) or _group_members(new_pgid)
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(run_dir)) == []
    assert _group_members(pgid) == [] and _group_members(new_pgid) == []


def _complete_records(run_dir) -> list[dict]:
    """The records of a running run: a line still being written is left for the next look."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _restarted_then_stepped(records: list[dict]) -> bool:
    """A step counted the server's restart, and a later step trained (its samples from the
    restarted server, which took that step's weights)."""
    restarts = [r["rollout/server_restarts"] for r in records]
    return 1.0 in restarts and restarts.index(1.0) < len(restarts) - 1


def _samples(run_dir, step):
    lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


ASYNC = ("grpo.num_steps_async=1", "trainer.max_steps=3")


def test_async_run_ahead_on_servers_overlaps_training_with_the_inline_samples(
    servers, bin_dir, subprocess_env, tmp_path
):
    """grpo.num_steps_async=1 on the servers at dp 2: each replica's generation worker (its
    own ServerBackend; DP rank 0's pushes, the other waits for its label) samples round t on
    the servers while step t trains, the replicas' generation threads meeting before each new
    version; the batches come from versions 0, 0, 1 (staleness 0, 1, 1), step 1 is on-policy
    to float32 rounding and the later steps carry the staleness the importance weight
    corrects; the same run generating inline (grpo.overlap_generation=false) trains exactly
    the same samples and metrics. (dp 1 overlaps in the partial-rollout tests below.)"""
    overlap_dir, inline_dir = tmp_path / "overlap", tmp_path / "inline"
    for run_dir, extra in ((overlap_dir, ()), (inline_dir, ("grpo.overlap_generation=false",))):
        proc = _train(
            bin_dir, subprocess_env, run_dir, _urls(servers), "parallel.dp=2", *ASYNC, *extra
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(overlap_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["staleness_mean"] for r in records] == [0.0, 1.0, 1.0]
    assert abs(records[0]["mismatch_kl_k1"]) < 1e-6
    assert records[0]["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert all(abs(r["mismatch_kl_k1"]) > 1e-6 for r in records[1:])  # the policy moved
    assert _untimed(records) == _untimed(_records(inline_dir))


PARTIAL = (
    "grpo.num_steps_async=1", "grpo.max_staleness=3", "grpo.partial_rollouts=true",
    "grpo.consumption_granularity=group", "debug.response_length_median=12",
    "rollout.max_new_tokens=48", "rollout.vllm.segment_tokens=8", "trainer.max_steps=3",
    "logging.samples=true", "trainer.checkpoint.every_steps=1",
)  # fmt: skip
"""The partial-rollout stream on the servers, in segments of 8 tokens, with long-tailed
lengths: rows outlive rounds and continue under newer weights."""


def _continued_rows(run_dir, records) -> int:
    """Rows whose tokens came from more than one version; every row's versions well formed."""
    continued = 0
    for r in records:
        trained = r["step"] - 1
        for s in _samples(run_dir, r["step"]):
            versions = s["token_versions"]
            assert len(versions) == len(s["response_ids"]) == len(s["behaviour_logps"])
            assert versions == sorted(versions) and trained - 3 <= versions[0] <= trained
            continued += len(set(versions)) > 1
    return continued


@pytest.fixture(scope="module")
def abort_on_one_server(servers, bin_dir, subprocess_env, tmp_path_factory):
    """The partial-rollout stream on one server with rollout.servers.on_update=abort (the
    default): the run directory of 3 steps, the reference of the two tests below."""
    run_dir = tmp_path_factory.mktemp("abort") / "run"
    proc = _train(bin_dir, subprocess_env, run_dir, _urls(servers[:1]), *PARTIAL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def test_partial_rollouts_on_servers_continue_rows_exactly_and_resume(
    servers, abort_on_one_server, bin_dir, subprocess_env, tmp_path
):
    """rollout.servers.on_update=abort (the default): rows still decoding at a weight update
    continue as new requests of prompt + tokens so far, their prefix recomputed under the new
    weights, so a row's tokens carry mixed versions and every token's behaviour log-prob is
    its own version's: the samples (ids, log-probs, versions) of a run on one server are
    bit-identical to the in-process vLLM stream's (rollout.backend=vllm, the same seeds), whose
    rows continue by the same cache-recompute rule; a run on two servers (a continued row may
    go to either), SIGKILLed at step 3 (its step-2 checkpoint holds rows in mid-decode) and
    resumed with trainer.resume=auto, trains exactly the one-server run's samples and
    metrics."""
    ref_dir = abort_on_one_server
    expected = _records(ref_dir)
    assert [r["step"] for r in expected] == [1, 2, 3]
    assert _continued_rows(ref_dir, expected) > 0, "no row outlived a round"
    colocated_dir = tmp_path / "colocated"
    colocated = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *MODEL, "rollout.backend=vllm", *PARTIAL,
         f"hydra.run.dir={colocated_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert colocated.returncode == 0, colocated.stdout[-3000:] + colocated.stderr[-3000:]
    for step in (1, 2, 3):
        assert _samples(ref_dir, step) == _samples(colocated_dir, step)
    killed_dir = tmp_path / "killed"
    killed = _train(
        bin_dir, subprocess_env, killed_dir, _urls(servers), *PARTIAL, "debug.fail_at_step=3",
        "debug.fail_kind=kill",
    )  # fmt: skip
    assert killed.returncode != 0 and len(_records(killed_dir)) == 2
    resumed = _train(
        bin_dir, subprocess_env, killed_dir, _urls(servers), *PARTIAL, "trainer.resume=auto"
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    got = _untimed(_records(killed_dir))
    assert [r.pop("rollout/servers_alive") for r in got] == [2.0, 2.0, 2.0]
    assert got == [{k: v for k, v in r.items() if k != "rollout/servers_alive"}
                   for r in _untimed(expected)]  # fmt: skip
    for step in (1, 2, 3):
        assert _samples(killed_dir, step) == _samples(ref_dir, step)


def _carried(sample) -> int:
    """The tokens a row's last request carried from before its newest weights: the prompt and
    the tokens older versions sampled (with on_update=keep, their KV is cached by the older
    weights)."""
    versions = sample["token_versions"]
    return len(sample["prompt_ids"]) + sum(v < versions[-1] for v in versions)


def test_partial_rollouts_on_servers_keep_continues_on_the_old_cache(
    servers, abort_on_one_server, bin_dir, subprocess_env, tmp_path
):
    """rollout.servers.on_update=keep: the server keeps its prefix cache across a weight
    update, so a continued row whose prompt and older tokens fill a whole KV block (and one
    token more: vLLM recomputes at least a request's last token) goes on from KV the old
    weights computed: its newest tokens' behaviour log-probs differ from abort's, where the
    prefix is recomputed (the same seeds, the same step-1 samples); every other row is
    abort's exactly. Both runs on one server, whatever ran on it before: the run's first sync
    drops its cache, and a row's cached blocks are on the server that computed them (with two,
    a continued row may go to the other one and find nothing to keep). The prompts are
    shorter than a block, so only continued rows can reach one. rollout/kv_cache_age shows how
    old, in versions, the KV keep's cache may hold is (always 0 with abort)."""
    keep_dir, abort_dir = tmp_path / "keep", abort_on_one_server
    proc = _train(
        bin_dir, subprocess_env, keep_dir, _urls(servers[:1]), *PARTIAL,
        "rollout.servers.on_update=keep",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(keep_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert _continued_rows(keep_dir, records) > 0
    # the cache's age in versions (rollout/kv_cache_age): 0 at the first sync, growing while
    # kept, never reaching grpo.max_staleness (3 here); always 0 with abort
    ages = [r["rollout/kv_cache_age"] for r in records]
    assert ages[0] == 0 and 0 < max(ages) < 3, ages
    assert [r["rollout/kv_cache_age"] for r in _records(abort_dir)] == [0, 0, 0]
    assert _samples(keep_dir, 1) == _samples(abort_dir, 1)
    # per continued row that reached a cached block: its newest tokens' largest log-prob
    # difference from abort's
    offs = []
    for step in (2, 3):
        for k, a in zip(_samples(keep_dir, step), _samples(abort_dir, step), strict=True):
            versions = k["token_versions"]
            if len(set(versions)) > 1 and _carried(k) > BLOCK:
                if k["response_ids"] != a["response_ids"]:  # the old KV sampled other tokens
                    offs.append(math.inf)
                    continue
                newest = [i for i, v in enumerate(versions) if v == versions[-1]]
                offs.append(
                    max(abs(k["behaviour_logps"][i] - a["behaviour_logps"][i]) for i in newest)
                )
            else:
                row = ("response_ids", "behaviour_logps", "token_versions")
                assert [k[f] for f in row] == [a[f] for f in row], (step, k["prompt_index"])
    assert offs, "no continued row filled a KV block before its update: nothing to keep"
    assert min(offs) > 1e-4, (
        f"keep computed abort's log-probs on a cached block (differences {offs}): was the "
        "cache dropped?"
    )


def test_rlbatch_serve_asked_to_stop_while_vllm_starts_stops_within_seconds(
    bin_dir, subprocess_env, tmp_path
):
    """SIGTERM to rlbatch-serve alone (``kill PID``, a service manager's stop) while its vLLM
    server is still starting: it used to wait until the server answered /health (a minute or
    two here) before stopping it. It stops at once, vLLM with it, and exits 0."""
    pytest.importorskip("vllm")
    port = free_port()
    proc = subprocess.Popen(
        [str(bin_dir / "rlbatch-serve"), *MODEL, f"rollout.servers.port={port}",
         f"rollout.vllm.max_model_len={SERVED_LEN}", f"rollout.vllm.block_size={BLOCK}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=subprocess_env,
        cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    api = "vllm.entrypoints.openai.api_server --model"
    try:
        deadline = time.monotonic() + 120
        while not [c for c in _processes_mentioning(api) if f"--port {port} " in c]:
            assert time.monotonic() < deadline and proc.poll() is None, "vLLM never started"
            time.sleep(0.2)
        time.sleep(2.0)  # vLLM is importing, far from answering /health
        with pytest.raises(urllib.error.URLError):
            _health(f"http://127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code = proc.wait(300)
        stopped_after = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = [c for c in _processes_mentioning(f"--port {port} ")]
    print(f"rlbatch-serve stopped {stopped_after:.1f} s after SIGTERM")
    assert code == 0 and proc.stdout.read() == ""  # never printed its URL
    assert stopped_after < 30, f"stopped {stopped_after:.0f} s after SIGTERM"
    assert left == []


def test_rlbatch_serve_sweeps_dead_trainers_weight_files_not_live_ones(
    bin_dir, subprocess_env, tmp_path
):
    """rlbatch-serve sweeps rollout.servers.transfer_dir before it starts vLLM. A live trainer
    in another PID namespace (a container sharing /dev/shm and the host name) writes a pid this
    machine cannot see: its file was removed while in use. A trainer holds its file's lock
    while the file lives, so the sweep leaves it; a dead trainer's file and lock are removed."""
    pytest.importorskip("vllm")
    host = socket.gethostname()
    unseen = int(open("/proc/sys/kernel/pid_max").read()) + 1  # no process of ours has it
    live = tmp_path / f"rlbatch-weights-{unseen}-abc123-{host}.safetensors"
    dead = tmp_path / f"rlbatch-weights-{unseen}-def456-{host}.safetensors"
    for path in (live, dead):
        path.write_bytes(b"weights")
        path.with_name(path.name + ".lock").write_bytes(b"")
    holder = subprocess.Popen(  # the live trainer: holds its lock until told to stop
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR);"
         " fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         f"{live}.lock"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    proc = subprocess.Popen(
        [str(bin_dir / "rlbatch-serve"), *MODEL, f"rollout.servers.port={free_port()}",
         f"rollout.servers.transfer_dir={tmp_path}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env,
        cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()  # printed after the sweep, before vLLM starts
        assert "rlbatch-serve: starting vLLM" in line, line
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        holder.stdin.close()
        holder.wait(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, f"{live.name}.lock"]


CONTINUED = ("trainer.max_steps=4", "rollout.servers.on_failure=continue")


def _requests_running(url: str) -> float:
    """Requests the server is decoding now (vLLM's /metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running{")
    )


def test_with_on_failure_continue_a_killed_server_leaves_the_pool_and_the_run_finishes(
    servers, bin_dir, subprocess_env, tmp_path
):
    """rollout.servers.on_failure=continue on the two shared servers (the module's last test:
    the second one is killed), with the weights
    broadcast over one group of the trainer and both servers (rollout.servers.transfer=
    broadcast); the spare's vLLM API server SIGTERMed while it decodes a round after step 1 is
    recorded (vLLM then shuts its engine down, stops listening, and either resets the
    connections of the requests in flight or holds them unanswered; a request sent after
    that is refused): within seconds, not rollout.servers.timeout_s (300 s here), a warning
    names it and the requests it held, its rows go to the other server, the next sync forms
    the group again without it, rollout/servers_alive falls from 2 to 1, and the run finishes
    with the metrics of the same run on the first server alone with the file transfer (each
    row carries its own seed, so the row a dead server would have sampled is the one the other
    server samples; the broadcast delivers the same weights as the file)."""
    ref_dir = tmp_path / "ref"
    ref = _train(bin_dir, subprocess_env, ref_dir, _urls([servers[0]]), *CONTINUED)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    run_dir = tmp_path / "run"
    port = servers[1].rsplit(":", 1)[1]
    (api,) = [p for p in _processes_mentioning(f"--port {port} ") if "-m vllm.entrypoints" in p]
    launcher = subprocess.Popen(
        [str(bin_dir / "rlbatch-train"), *MODEL, "rollout.backend=vllm_server",
         _urls([servers[0], servers[1]]), *CONTINUED, "rollout.servers.transfer=broadcast",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env,
        cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = _first_step(launcher, run_dir)
        # during a generation round, not a weight sync: a server that fails in the middle of a
        # broadcast stops the run in either mode (the group's other servers wait for it)
        while _requests_running(servers[1]) == 0:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(int(api.split(":")[0]), signal.SIGTERM)
        killed_at = time.monotonic()
        out, _ = launcher.communicate(timeout=600)
        finished_after = time.monotonic() - killed_at
    finally:
        launcher.kill()
        launcher.wait()
    print(f"the run finished {finished_after:.1f} s after the server's engine stopped")
    assert launcher.returncode == 0, out[-3000:]
    assert f"rollout server {servers[1]} left the pool" in out, out[-3000:]
    # the round's requests to it fail at once, however far vLLM's shutdown had got: the
    # connections of those in flight reset, or held unanswered behind a failing /health, or a
    # request sent after it stopped listening refused, or answered 500 by an API server whose
    # engine core had already stopped (all four seen on these machines); or,
    # when the round's last rows were answered before the engine stopped, the next sync's
    # first request to it, whichever of the sync's requests that is (before any tensor is
    # sent: the run goes on). Never a request left to time out.
    (warning,) = [line for line in out.splitlines() if "left the pool" in line]
    ways = (
        "closed the connection during /",
        "failed while /",
        "refused the connection (/",
        "failed (500): ",
    )
    assert any(way in warning for way in ways) and "did not answer" not in warning, warning
    assert finished_after < 150
    records = _records(run_dir)
    alive = [r["rollout/servers_alive"] for r in records]
    assert alive[0] == 2 and alive[-1] == 1, alive
    expected = _records(ref_dir)
    assert [r["rollout/servers_alive"] for r in expected] == [1] * 4

    def compared(rs):  # the pool's history aside: its size, and rows the dying server
        # aborted (finish_reason abort as vLLM shuts down), sent again with their own seeds
        pool = ("rollout/servers_alive", "rollout/server_resubmits")
        return [{k: v for k, v in r.items() if k not in pool} for r in _untimed(rs)]

    assert compared(records) == compared(expected)
