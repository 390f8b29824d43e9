"""Users' own tasks through the real rlbatch-train: the grpo_qwen2_5_math recipe's CPU twin on a
GSM8K-format file with a custom (async, row-field) reward next to the math reward and a wandb
offline sink; and a bad dataset plus bad reward specs stopped before launch, all at once."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

DATA = Path(__file__).resolve().parents[1] / "data" / "gsm8k_tiny.jsonl"
# The recipe's documented CPU twin (its header comment), shortened to what CI affords.
TWIN = [
    "+recipe=grpo_qwen2_5_math",
    "model=tiny",
    "parallel.dp=1",
    "grpo.num_generations=4",
    "grpo.global_batch_size=16",
    "data.max_prompt_len=400",
    "rollout.max_new_tokens=8",
    "batching.train.max_tokens=512",
    "batching.infer.max_tokens=1024",
    "logging.tensorboard=false",
]
REWARD = """
import asyncio

async def brevity(completion, level):
    await asyncio.sleep(0)
    return 1.0 - len(completion) / 64 if level == "easy" else 0.25
"""


def _train(bin_dir, env, cwd, *overrides, timeout=500):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def test_math_recipe_twin_with_custom_reward_and_wandb_offline(bin_dir, subprocess_env, tmp_path):
    pytest.importorskip("wandb", reason="optional extra 'wandb' not installed")
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD))
    env = {**subprocess_env, "WANDB_SILENT": "true"}
    proc = _train(
        bin_dir,
        env,
        tmp_path,
        *TWIN,
        f"data.path={DATA}",
        "data.reward_fn=[math,my_reward.py:brevity]",
        "data.reward_weights=[1.0,0.5]",
        "logging.wandb.enabled=true",
        "logging.wandb.mode=offline",
        "trainer.max_steps=2",
        "hydra.run.dir=run",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the total is the weighted sum of the components, each logged on its own
        total = 1.0 * r["reward/math_mean"] + 0.5 * r["reward/brevity_mean"]
        assert r["reward_mean"] == pytest.approx(total, abs=1e-9)
        assert 0.25 <= r["reward/brevity_mean"] <= 1.0  # every row sets a level
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    resolved = (run_dir / "resolved.yaml").read_text()
    assert f"{tmp_path / 'my_reward.py'}:brevity" in resolved  # absolute for the workers


def test_bad_rows_and_reward_specs_stop_before_launch(bin_dir, subprocess_env, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(
        b'{"question": "ok?", "answer": "#### 1"}\n'
        b'{"question": "no answer"}\n'
        b"{not json\n"
        b'{"question": "caf\xe9", "answer": "#### 2"}\n'
        b'{"question": "' + b"x" * 500 + b'", "answer": "#### 3"}\n'
        b'{"question": "no marker", "answer": "3"}\n'
    )
    (tmp_path / "r.py").write_text("def score(prompt, completions):\n    return 0.0\n")
    proc = _train(
        bin_dir,
        subprocess_env,
        tmp_path,
        *TWIN,
        f"data.path={data}",
        "data.reward_fn=[r.py:score,r.py:missing,nowhere.py:f]",
        "hydra.run.dir=run",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "resolved.yaml").exists()
    assert f"5 bad row(s) in {data}" in err
    for where, what in [
        ("line 2", "no field 'answer'"),
        ("line 3", "not valid JSON"),
        ("line 4", "not UTF-8 (byte 0xe9"),
        ("line 5", "prompt is 6"),  # 500 bytes + the Qwen template, over max_prompt_len=400
        ("line 6", "'answer' has no '#### <answer>'"),
    ]:
        assert f"{where}: {what}" in err, (where, err)
    assert "mixes per-sample ['prompt'] and per-batch ['completions']" in err
    assert "has no function 'missing'" in err and "nowhere.py: fix the path" in err
