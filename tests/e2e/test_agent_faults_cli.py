"""Agent harness faults through the real rlbatch-train: a harness that raises, returns a
non-number, asks n > 1, makes no call or hangs, next to one whose calls run past env.max_turns
and one that sends token ids to /v1/completions (streamed), in one run under
env.on_error=zero_reward; the same harness stopping the run under raise_error, naming the harness
and the row without a traceback; a harness that raises on some of the policy's replies under
env.on_error=skip, whose errored episodes carry no loss and leave their groups' baselines; and
the configuration errors before launch, all at once."""

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
    try:  # ids outside the vocabulary: refused (400), the episode goes on
        await client.completions.create(model=model, prompt=[10**6], max_tokens=1)
        refused = 0.0
    except Exception as err:
        refused = float(type(err).__name__ == "BadRequestError")
    stream = await client.completions.create(  # token in, streamed out
        model=model, prompt=[104, 105, 58], max_tokens=5, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    return {"reward": 1.0, "chars": float(len(text)), "refused": refused}
"""


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
                "env.max_turns=3",
                # the hang detector's bound is below the episode deadline: the round's wait on
                # its harnesses is bounded by their deadlines, not by trainer.timeout_s
                "trainer.timeout_s=19")  # fmt: skip
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
            assert s["reward_parts"]["harness.refused"] == 1.0
            continue
        assert s["end"] == "error" and s["reward"] == 0.0
        assert "harness" in s["error"] and "faults.py:run" in s["error"]
        assert expected[int(s["answer"])] in s["error"], s["error"]


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
    among themselves (a float64 recomputation of their GRPO advantages)."""
    (fault_run / "crashes.py").write_text(CRASHES)
    run_dir = fault_run / "skip"
    proc = _run(bin_dir, subprocess_env, fault_run, f"hydra.run.dir={run_dir}",
                "env.harness=crashes.py:run", "env.on_error=skip", "env.max_error_fraction=1.0",
                "logging.samples=true", "trainer.max_steps=1")  # fmt: skip
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
                   "grpo.overlap_generation=false", "env.agent.port", "is not an async function"):  # fmt: skip
        assert needle in out, needle
