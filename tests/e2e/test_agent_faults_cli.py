"""Agent harness faults through the real rlbatch-train: a harness that raises, returns a
non-number, asks n > 1, makes no call, sends a prompt past env.max_total_tokens, hangs or holds
the event loop, next to one whose calls run past env.max_turns and one that sends token ids to /v1/completions (streamed), in one run
under env.on_error=zero_reward; the harness holding the loop stopping the run under
raise_error, naming its episode and line without a traceback; a harness that raises on some of
the policy's replies under env.on_error=skip, whose errored episodes carry no loss and leave
their groups' baselines; and the configuration errors before launch, all at once."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict

import pytest
import yaml

from agent_runs import train as _run

pytestmark = pytest.mark.e2e

FAULTS = """
import asyncio
import threading
import time

import openai

BLOCKED = []

LATE = []  # the statuses the late calls were answered with

def late_call(base_url, key, model):  # a call after the harness returned, from a thread it left
    # behind (a thread, not a task: the harness holding the loop must not delay it past the round)
    time.sleep(0.5)
    late = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    try:
        late.chat.completions.create(model=model, messages=[{"role": "user", "content": "late"}])
    except openai.APIStatusError as err:
        LATE.append(err.status_code)
        with open(__file__[: -len("faults.py")] + "late_status.txt", "a") as out:
            out.write(f"{err.status_code} ")
    finally:
        late.close()

async def run(client, model, row):
    kind = int(row["answer"])
    if kind == 7:  # the first one holds the event loop (synchronous code), the others call once
        if not BLOCKED:
            BLOCKED.append(1)
            time.sleep(40)  # BLOCKS HERE
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        return 1.0
    if kind == 8:  # two calls at once on one prompt (best-of-2, its own seeds), then on from the
        # 1st up to the run's limit (rollout.max_new_tokens): the episode ends in the 1st's segment
        messages = [{"role": "user", "content": "x"}]
        a, b = await asyncio.gather(*[client.chat.completions.create(
            model=model, messages=messages, max_tokens=3, seed=s) for s in (0, 1)])
        messages += [a.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "y"}]
        await client.chat.completions.create(model=model, messages=messages)
        return 1.0
    if kind == 0:
        raise ValueError("broken harness")
    if kind == 1:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        return "not a number"
    if kind == 2:
        await client.chat.completions.create(model=model, n=2, messages=[{"role": "user", "content": "x"}])
    if kind == 3:
        return 1.0
    if kind == 9:  # a prompt longer than env.max_total_tokens: answered with no tokens
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * 4000}])
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
    try:  # ids outside the vocabulary: refused (400), the episode goes on
        await client.completions.create(model=model, prompt=[10**6], max_tokens=1)
        refused = 0.0
    except Exception as err:
        refused = float(type(err).__name__ == "BadRequestError")
    stream = await client.completions.create(  # token in, streamed out
        model=model, prompt=[104, 105, 58], max_tokens=5, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    # the group's first episode keeps the round running until the other three's late calls
    # were answered (its samples may be the round's last to end); the others leave one each
    if str(client.base_url).rstrip("/").split("/")[-2].split("-")[1] == "0":
        for _ in range(400):
            if len(LATE) >= 3:
                break
            await asyncio.sleep(0.05)
    else:
        threading.Thread(target=late_call, args=(str(client.base_url), client.api_key, model), daemon=True).start()
    return {"reward": 1.0, "chars": float(len(text)), "refused": refused}
"""


@pytest.fixture(scope="module")
def fault_run(bin_dir, subprocess_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "faults.py").write_text(FAULTS)
    rows = [{"prompt": "guess 0-9:", "answer": str(a)} for a in range(10)]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "blocking.jsonl").write_text("".join(json.dumps(rows[k]) + "\n" for k in (6, 7, 6, 6)))
    return tmp


def _blocking_line() -> int:
    return next(n for n, line in enumerate(FAULTS.splitlines(), 1) if "BLOCKS HERE" in line)


@pytest.fixture(scope="module")
def zero_run(fault_run, bin_dir, subprocess_env):
    """One step of every kind of harness under env.on_error=zero_reward: (metrics, samples)."""
    run_dir = fault_run / "zero"
    proc = _run(bin_dir, subprocess_env, fault_run, f"hydra.run.dir={run_dir}",
                "env.harness=faults.py:run", "env.on_error=zero_reward", "data.path=rows.jsonl",
                "logging.samples=true", "trainer.max_steps=1", "grpo.global_batch_size=40",
                "env.agent.episode_timeout_s=30", "env.timeout_s=1", "env.max_error_fraction=1.0",
                "env.max_turns=3", "env.agent.block_timeout_s=4",
                "grpo.mask_truncated_completions=true",
                # the hang detector's bound is below the episode deadline: the round's wait on
                # its harnesses is bounded by their deadlines, not by trainer.timeout_s
                "trainer.timeout_s=29")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (metrics,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run_dir / "samples/step_00001.jsonl").read_text().splitlines()]  # fmt: skip
    return metrics, samples


def test_harness_faults_score_zero_under_zero_reward(zero_run):
    _, samples = zero_run
    expected = {
        0: "raised ValueError: broken harness",
        1: "returned str 'not a number'",
        2: "asked for n=2",
        3: "made no call to the endpoint",
        4: "took longer than env.agent.episode_timeout_s",
        # named as the budget, not as a harness that made no call
        9: "sampled no token: its first call's prompt is 4",
    }
    assert len(samples) == 40 + 4  # each best-of-2 episode (answer 8) trains 2 samples
    # one episode held the loop: it alone is the error, named with the line it blocked at; the
    # episodes beside it restarted on a fresh loop and ended as they would have
    blocked = [s for s in samples if s["answer"] == "7" and s["end"] == "error"]
    assert len(blocked) == 1, [s["error"] for s in samples if s["answer"] == "7"]
    assert "held the rank's event loop" in blocked[0]["error"]
    assert f"faults.py:{_blocking_line()} in run" in blocked[0]["error"], blocked[0]["error"]
    for s in samples:
        if s["answer"] == "8":
            continue
        if s["answer"] == "7" and s["end"] == "done":
            assert s["reward"] == 1.0 and s["num_turns"] == 1
            continue
        if s["answer"] == "7":
            continue
        if s["answer"] == "5":  # the calls past env.max_turns were answered with no tokens
            assert s["end"] == "done" and s["reward"] == 1.0 and s["num_turns"] == 3
            assert len(s["turns"]) == 5 and s["turns"][3]["completion_ids"] == []
            continue
        if s["answer"] == "6":  # a completions call given token ids samples after them
            # (and the call its harness left behind, made after it returned, is not in the
            # episode: refused 409, counted in episode_late_calls)
            (call,) = s["turns"]
            assert call["prompt_ids"] == s["prompt_ids"] == [104, 105, 58]
            assert s["response_ids"] == call["completion_ids"]
            assert 1 <= len(call["completion_ids"]) <= 5
            assert s["reward_parts"]["harness.chars"] >= 0
            assert s["reward_parts"]["harness.refused"] == 1.0
            continue
        assert s["end"] == "error" and s["reward"] == 0.0
        assert "harness" in s["error"] and "faults.py:run" in s["error"]
        assert expected[int(s["answer"])] in s["error"], s["error"]


def test_a_call_after_the_harness_returned_is_refused_and_counted(zero_run, fault_run):
    """Three answer-6 harnesses leave a thread that calls their episode's address 0.5 s after
    returning, while the round still runs (their group's first episode waits for the calls to
    be answered): each call is answered 409, counted, and neither sampled nor trained (the
    sample holds the episode's one call)."""
    metrics, samples = zero_run
    assert metrics["episode_late_calls"] == 3
    assert (fault_run / "late_status.txt").read_text().split() == ["409"] * 3
    for s in samples:
        if s["answer"] == "6":
            assert len(s["turns"]) == 1
            assert sum(s["loss_mask"]) == len(s["turns"][0]["completion_ids"])


def test_concurrent_calls_on_one_prompt_are_branches_and_every_one_trains(zero_run):
    """A harness sending two calls at once on one prompt (answer 8), then going on from the
    first's reply: the second call is a branch (a sample of its own, no split), the third joins
    the first's sample by the splice, and every sampled token is trained once."""
    metrics, samples = zero_run
    assert metrics["episode_splits"] == 0  # no harness of this run rewrote its history
    assert metrics["episode_branches"] == 4  # one per best-of-2 episode
    lines = [s for s in samples if s["answer"] == "8"]
    assert len(lines) == 8
    for first, last in zip(lines[::2], lines[1::2], strict=True):
        assert (first["segment"], last["segment"], first["segments"]) == (0, 1, 2)
        calls = last["turns"]
        assert len(calls) == 3 and calls[0]["prompt_ids"] == calls[1]["prompt_ids"]
        assert not any(c["diverged"] for c in calls) and calls[2]["spliced"]
        on = [i for i in (0, 1) if calls[2]["prompt_ids"][: len(calls[i]["prompt_ids"]) + len(calls[i]["completion_ids"])] == calls[i]["prompt_ids"] + calls[i]["completion_ids"]]  # fmt: skip
        assert len(on) == 1  # it went on from one of the two replies
        # the row (its last line) is the segment of the episode's last call, whichever of the
        # two calls at once came first
        assert (last["calls"], first["calls"]) == ([on[0], 2], [1 - on[0]])
        for part in (first, last):
            mine = [calls[i] for i in part["calls"]]
            trained = [t for t, m in zip(part["response_ids"], part["loss_mask"], strict=True) if m]  # fmt: skip
            assert trained == [t for c in mine for t in c["completion_ids"]]
            assert part["prompt_ids"] == mine[0]["prompt_ids"]
            # the episode's truncation is its last call's, on both segments
            assert part["reward"] == 1.0 and part["truncated"] == calls[2]["truncated"]


def test_truncated_means_a_limit_of_the_run(zero_run):
    """A call cut by the client's own max_tokens (3 or 5 here) answers finish_reason=length but
    is not truncated (grpo.mask_truncated_completions leaves it in the loss); one cut by
    rollout.max_new_tokens (16) or refused past env.max_turns is. An episode is truncated when
    its last call is, whichever segment that call is in."""
    metrics, samples = zero_run
    calls = [c for s in samples for c in s["turns"]]
    client_cut = [c for c in calls if c["finish_reason"] == "length" and 0 < len(c["completion_ids"]) < 16]  # fmt: skip
    assert len(client_cut) >= 8  # the best-of-2 calls mostly stop at their max_tokens=3
    for c in calls:
        run_cut = c["finish_reason"] == "length" and len(c["completion_ids"]) in (0, 16)
        assert c["truncated"] == run_cut, c
    rows = [s for s in samples if s["segment"] == s["segments"] - 1]
    assert metrics["episodes_truncated"] == sum(bool(s["turns"]) and s["turns"][-1]["truncated"] for s in rows)  # fmt: skip
    # an episode is truncated when its last call is, and so is every one of its samples: the
    # calls past env.max_turns (answer 5, answered with no tokens) truncate theirs, as does a
    # best-of-2 whose last call (in the first segment, answer 8) met rollout.max_new_tokens
    episode = []
    for s in samples:  # an episode's earlier segments, then its row (which lists its calls)
        episode.append(s)
        if s is not rows[0]:
            continue
        rows.pop(0)
        cut = bool(s["turns"]) and s["turns"][-1]["truncated"]
        assert [p["truncated"] for p in episode] == [cut] * len(episode), s["answer"]
        assert cut or s["answer"] != "5"
        episode = []
    assert not rows and not episode
    # grpo.mask_truncated_completions masks every sample of a truncated episode, and only those
    assert metrics["masked_truncated"] == sum(s["truncated"] for s in samples) > 4


CRASHES = """
import json

async def run(client, model, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    out = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    text = out.choices[0].message.content
    if ord(text[:1] or "a") % 3 == 0:  # a reply the harness's parser chokes on
        json.loads("{" + text)
    if text.strip() == row["answer"]:
        return 1.0
    return -1.0 + 0.25 * (ord(text[-1:]) % 3)  # wrong answers score below 0, graded
"""


def test_skip_leaves_errored_episodes_out_of_the_loss_and_the_baselines(
    fault_run, bin_dir, subprocess_env
):
    """A crash scored 0 beside wrong answers scored -1 would get a positive advantage under
    zero_reward; under skip it carries no loss and its group's other episodes are compared
    among themselves (a float64 recomputation of their GRPO advantages). Evaluation through
    the same harness counts its crashes (eval/env_errors), marks them in its samples file, and
    leaves them out of eval/reward_mean: a policy that breaks the harness does not evaluate
    better than one that answers wrong."""
    (fault_run / "crashes.py").write_text(CRASHES)
    held = [{"prompt": "guess 0-9:", "answer": str(a)} for a in (1, 2, 3, 4)]
    (fault_run / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    run_dir = fault_run / "skip"
    proc = _run(bin_dir, subprocess_env, fault_run, f"hydra.run.dir={run_dir}",
                "env.harness=crashes.py:run", "env.on_error=skip", "env.max_error_fraction=1.0",
                "logging.samples=true", "trainer.max_steps=1", "eval.every_steps=1",
                "eval.at_start=false", "eval.data.path=held.jsonl", "eval.num_samples=4",
                "eval.temperature=1.0")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [json.loads(x) for x in (run_dir / "samples/step_00001.jsonl").read_text().splitlines()]  # fmt: skip
    grpo = yaml.safe_load((run_dir / "resolved.yaml").read_text())["grpo"]
    assert (grpo["advantage_estimator"], grpo["scale_rewards"]) == ("grpo", "group")
    groups = defaultdict(list)
    for s in samples:
        groups[s["group_id"]].append(s)
    errored = [s for s in samples if s["end"] == "error"]
    assert 0 < len(errored) < len(samples) and len(groups) == 4
    for s in errored:
        assert "json" in s["error"].lower() or "Expecting" in s["error"], s["error"]
        assert s["skipped"] and s["advantage"] == 0.0 and s["reward"] == 0.0
        assert sum(s["loss_mask"]) == 0  # none of its tokens carries loss
    lone = 0
    for members in groups.values():
        kept = [s["reward"] for s in members if s["end"] != "error"]
        lone += len(kept) < 2 and len(kept) < len(members)
        for s in members:
            if s["end"] == "error":
                continue
            assert not s["skipped"] and sum(s["loss_mask"]) > 0
            if len(kept) < 2:
                want = 0.0
            else:
                mean = math.fsum(kept) / len(kept)
                want = (s["reward"] - mean) / (statistics.stdev(kept) + grpo["advantage_eps"])
            assert s["advantage"] == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert any(s["advantage"] > 0 for s in samples) and any(s["advantage"] < 0 for s in samples)
    (record,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["env_errors"] == len(errored)
    assert record["env_error_groups_untrained"] == lone
    lines = (run_dir / "eval" / "step_00001.jsonl").read_text().splitlines()
    scored = [x for line in lines for x in json.loads(line)["samples"]]
    crashed = [x for x in scored if x["error"] is not None]
    assert 0 < len(crashed) < len(scored) == 16
    for x in crashed:
        assert "crashes.py:run" in x["error"] and not x["correct"]
    assert record["eval/env_errors"] == len(crashed)
    kept = [x["reward"] for x in scored if x["error"] is None]
    assert record["eval/reward_mean"] == pytest.approx(math.fsum(kept) / len(kept), abs=1e-9)


def test_harness_error_stops_the_run_naming_harness_and_row(fault_run, bin_dir, subprocess_env):
    """A harness holding the event loop (the second of four rows blocks, the others stream) stops
    the run within env.agent.block_timeout_s, naming its episode and line, not a bystander."""
    proc = _run(bin_dir, subprocess_env, fault_run, f"hydra.run.dir={fault_run / 'raise'}",
                "env.harness=faults.py:run", "data.path=blocking.jsonl", "trainer.max_steps=1",
                "grpo.global_batch_size=16", "env.agent.block_timeout_s=4")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "faults.py:run on sample" in out and "(prompt index 1) held the rank's event loop" in out
    assert f"faults.py:{_blocking_line()} in run" in out and "asyncio.to_thread" in out
    assert "Traceback" not in out


def test_configuration_errors_before_launch(fault_run, bin_dir, subprocess_env):
    (fault_run / "sync.py").write_text("def run(client, model, row):\n    return 1.0\n")
    proc = _run(bin_dir, subprocess_env, fault_run, "env.harness=sync.py:run",
                "env.path=rlbatch.env.guess_number:GuessNumber", "data.chat_template=none",
                "grpo.num_steps_async=1", "env.agent.port=70000", "env.agent.block_timeout_s=0")  # fmt: skip
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    for needle in ("env.harness", "env.path=null for a harness", "data.chat_template",
                   "grpo.overlap_generation=false", "env.agent.port", "is not an async function",
                   "env.agent.block_timeout_s=0.0: must be > 0"):  # fmt: skip
        assert needle in out, needle
