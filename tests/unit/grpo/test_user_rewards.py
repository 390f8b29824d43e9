"""Reward functions by import path: loading, signatures, sync/async, batch, errors, weights."""

from __future__ import annotations

import json
import textwrap

import pytest

from rlbatch.config.schema import DataConfig, DataSource, RewardKind, RunConfig
from rlbatch.grpo.preflight import check_before_launch
from rlbatch.grpo.rewards import RewardInput, build_rewards
from rlbatch.grpo.user_rewards import RewardCallError, RewardSpecError, load_reward

REWARDS = """
import asyncio

def length(completion):
    return float(len(completion))

def contains_answer(prompt, completion, completion_ids, answer, difficulty):
    return (1.0 if answer in completion else 0.0) * difficulty

def batch_ids(completions, completion_ids, **fields):
    return [len(ids) + len(fields["difficulty"]) * 0 for ids in completion_ids]

async def slow_len(completion):
    await asyncio.sleep(0)
    return float(len(completion))

async def batch_async(completions):
    await asyncio.sleep(0)
    return [1.0] * len(completions)

def divide(completion):
    return 1 / (len(completion) - 2)

def infinite(completion):
    return float("inf") if completion == "bad" else 0.0

def short(completions):
    return [1.0]

def mixed(prompt, completions):
    return 0.0

def neither(text):
    return 0.0

def ids_only(completion_ids, difficulty):
    return float(sum(completion_ids)) + difficulty

not_a_function = 3
"""


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def inputs(*responses, answer="42", difficulty=2.0):
    return [
        RewardInput(
            prompt="p",
            response=r,
            answer=answer,
            num_response_tokens=len(r),
            response_ids=tuple(range(len(r))),
            fields={"difficulty": difficulty},
            prompt_index=10 + i,
        )
        for i, r in enumerate(responses)
    ]


def score(path, *names, weights=None, batch=None):
    cfg = DataConfig(
        source=DataSource.jsonl,
        reward_fn=[f"{path}:{n}" for n in names],
        reward_weights=weights,
    )
    return build_rewards(cfg).score(batch or inputs("x42", "abcd"))


def test_per_sample_batch_and_async_functions(rewards_file):
    totals, parts = score(rewards_file, "length", "contains_answer", "batch_ids", "slow_len")
    assert parts == {
        "length": [3.0, 4.0],
        "contains_answer": [2.0, 0.0],  # difficulty field of the row, x 1 when answer found
        "batch_ids": [3.0, 4.0],
        "slow_len": [3.0, 4.0],
    }
    assert totals == [11.0, 12.0]
    assert score(rewards_file, "batch_async")[0] == [1.0, 1.0]


def test_completion_ids_alone_is_a_per_sample_function(rewards_file):
    """completion_ids is a parameter of both kinds: declared alone (with a field) the function
    is called once per sample with that sample's ids and the row's field."""
    assert not load_reward(f"{rewards_file}:ids_only").batched
    _, parts = score(rewards_file, "ids_only")
    assert parts == {"ids_only": [0 + 1 + 2 + 2.0, 0 + 1 + 2 + 3 + 2.0]}


def test_weights_scale_each_component(rewards_file):
    totals, _ = score(rewards_file, "length", "contains_answer", weights=[0.5, -1.0])
    assert totals == [0.5 * 3 - 2.0, 0.5 * 4]


def test_builtin_names_mix_with_paths(rewards_file):
    cfg = DataConfig(source=DataSource.jsonl, reward_fn=["exact_match", f"{rewards_file}:length"])
    totals, parts = build_rewards(cfg).score(inputs("42", "4 2"))
    assert parts == {"exact_match": [1.0, 0.0], "length": [2.0, 3.0]} and totals == [3.0, 3.0]


def test_same_function_name_twice_gets_unique_metric_names(rewards_file, tmp_path):
    other = tmp_path / "other.py"
    other.write_text("def length(completion):\n    return 1.0\n")
    cfg = DataConfig(reward_fn=[f"{rewards_file}:length", f"{other}:length"])
    assert [c.name for c in build_rewards(cfg).components] == ["length", "length_2"]


def test_exception_names_function_and_sample(rewards_file):
    with pytest.raises(RewardCallError) as err:
        score(rewards_file, "divide", batch=inputs("abcd", "ab"))
    msg = str(err.value)
    assert f"{rewards_file}:divide raised ZeroDivisionError" in msg
    assert "sample 1 (prompt index 11)" in msg and "'ab'" in msg


def test_non_finite_and_wrong_length_are_errors(rewards_file):
    with pytest.raises(RewardCallError, match=r"infinite returned inf for sample 1 \(prompt index"):
        score(rewards_file, "infinite", batch=inputs("ok", "bad"))
    with pytest.raises(RewardCallError, match="returned 1 rewards for a batch of 2"):
        score(rewards_file, "short")


@pytest.mark.parametrize(
    "name,message",
    [
        ("mixed", "mixes per-sample"),
        ("neither", "declares none of"),
        ("missing", "has no function 'missing'"),
        ("not_a_function", "is a int, not a function"),
    ],
)
def test_unusable_functions_are_spec_errors(rewards_file, name, message):
    with pytest.raises(RewardSpecError, match=message):
        load_reward(f"{rewards_file}:{name}")


def test_module_path_spec_imports_from_the_working_directory(rewards_file, monkeypatch):
    monkeypatch.chdir(rewards_file.parent)
    reward = load_reward("my_rewards:length")
    assert reward.name == "length" and not reward.batched
    with pytest.raises(RewardSpecError, match="no module 'nowhere'"):
        load_reward("nowhere:length")


def _run_cfg(tmp_path, rows, **data):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = RunConfig()
    cfg.data = DataConfig(source=DataSource.jsonl, path=str(path), reward=RewardKind.math, **data)
    return cfg


def test_preflight_reports_every_reward_problem_at_once(rewards_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _run_cfg(
        tmp_path,
        [{"prompt": "a", "answer": "1", "level": 3}],
        reward_fn=[
            "my_rewards.py:contains_answer",  # relative path; needs field 'difficulty'
            "missing.py:f",
            f"{rewards_file}:nope",
            "not_a_reward",
            "task",
        ],
        reward_weights=[1.0, 2.0],
    )
    errors, _ = check_before_launch(cfg)
    text = "\n".join(str(e) for e in errors)
    assert "data.reward_fn[0]" in text and "['difficulty'] name no field" in text
    assert f"data.reward_fn[1]={tmp_path}/missing.py:f: no such file" in text
    assert "has no function 'nope'" in text
    assert "data.reward_fn[3]=not_a_reward: is neither" in text
    assert "needs data.source=builtin" in text
    assert "data.reward_weights=[1.0, 2.0]: has 2 weight(s) for 5" in text
    assert cfg.data.reward_fn[0] == f"{rewards_file}:contains_answer"  # made absolute


def test_preflight_lists_bad_rows_and_long_prompts(tmp_path):
    cfg = _run_cfg(
        tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "x" * 40, "answer": "2"}, {"p": 1}]
    )
    errors, _ = check_before_launch(cfg)
    (err,) = errors
    assert err.key == "data.path" and str(err.message).startswith("2 bad row(s)")
    assert (
        "line 2: prompt is 40 tokens" in err.message and "line 3: no field 'prompt'" in err.message
    )


USER_CODE = """
import os, signal, sys

def exits(completion):
    sys.exit(0)

def batch_exits(completions):
    sys.exit(3)

def interrupted(completion):
    signal.raise_signal(signal.SIGINT)

def as_text(completion):
    return "1.5"

def nan(completion):
    return float("nan")

def huge(completion):
    return 1e9 if completion == "abcd" else 0.0
"""


@pytest.mark.parametrize(
    "name,message",
    [
        ("exits", r"user.py:exits called sys.exit\(0\) on sample 0 \(prompt index 10\)"),
        ("batch_exits", r"user.py:batch_exits called sys.exit\(3\) on a batch of 2 samples"),
        ("interrupted", r"user.py:interrupted was interrupted \(KeyboardInterrupt"),
        ("as_text", r"user.py:as_text returned '1.5' for sample 0 \(prompt index 10\) \(a str;"),
        ("nan", r"user.py:nan returned nan for sample 0 .*must be finite real numbers"),
        ("huge", r"user.py:huge returned 1000000000.0 for sample 1 .*at most 1e\+06 in size"),
    ],
)
def test_user_code_exits_signals_and_bad_values_are_errors_naming_the_function(
    tmp_path, name, message
):
    path = tmp_path / "user.py"
    path.write_text(USER_CODE)
    with pytest.raises(RewardCallError, match=message):
        score(path, name)
