"""rollout.backend=vllm at tp 2 through the real rlbatch-train: a model-parallel group decodes
once, on its first rank, and every rank trains the rows that rank decoded.

The check makes the ranks' engines disagree on purpose: a ``sitecustomize`` module on the
workers' PYTHONPATH shifts every row seed on global rank 1 (what a GPU kernel, a batch
composition or a KV-cache size that differs between ranks does to the sampled tokens), and
records, on every rank, each generate call's rows (response ids, behaviour log-probs,
truncation). Were rank 1 to sample its own rows, they would differ from rank 0's and the two
tp ranks would feed different token ids into one tensor-parallel forward (silent garbage;
multi-turn episodes of different lengths could even hang the group). With one decode per
group, rank 1's seeds never reach an engine: both ranks record the same rows, call by call,
training, evaluation and environment turns alike, and rank 1's engine never decodes.
"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.optional_extra]

HEADS_OF_32 = ("model.num_attention_heads=2", "model.num_query_groups=2")

SITECUSTOMIZE = """
import json
import os
import sys

RANK = os.environ.get("RANK")
OUT = os.environ.get("RLBATCH_TEST_ROWS_DIR")

if RANK is not None and OUT:
    from rlbatch.rollout import protocol

    if RANK == "1":  # this rank's engine would sample other tokens than its group's first
        _row_seeds = protocol.row_seeds
        protocol.row_seeds = lambda seed, n: [(s + 7919) & 0x7FFFFFFF for s in _row_seeds(seed, n)]

    _generate = protocol.SyncedRolloutEngine.generate

    def _count_engine_calls():
        # count this rank's vLLM generate calls (vLLM is imported by the engine's start)
        llm = sys.modules["vllm"].LLM
        if getattr(llm.generate, "counted", False):
            return
        engine_generate = llm.generate

        def counted(self, *args, **kwargs):
            with open(os.path.join(OUT, f"engine_calls.{RANK}"), "a") as fh:
                fh.write("g")
            return engine_generate(self, *args, **kwargs)

        counted.counted = True
        llm.generate = counted

    def generate(self, *args, **kwargs):
        _count_engine_calls()
        samples = _generate(self, *args, **kwargs)
        rows = [[s.response_ids, s.behaviour_logps, s.truncated] for s in samples]
        with open(os.path.join(OUT, f"rows.{RANK}.jsonl"), "a") as fh:
            fh.write(json.dumps(rows) + "\\n")
        return samples

    protocol.SyncedRolloutEngine.generate = generate
"""


def _run(bin_dir, subprocess_env, tmp_path, recipe, *overrides):
    """rlbatch-train at tp 2 on vLLM with rank 1's row seeds shifted; (process, rows per rank,
    vLLM generate calls per rank)."""
    pytest.importorskip("vllm")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    env = dict(subprocess_env)
    env["PYTHONPATH"] = f"{hooks}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(hooks)
    env["RLBATCH_TEST_ROWS_DIR"] = str(rows_dir)
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), f"+recipe={recipe}", "rollout.backend=vllm",
         f"hydra.run.dir={tmp_path / 'run'}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", *HEADS_OF_32, "parallel.tp=2",
         "trainer.max_steps=2", "rollout.vllm.kv_cache_space_gb=0.25", *overrides],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    rows = {r: _lines(rows_dir / f"rows.{r}.jsonl") for r in (0, 1)}
    calls = {r: len(_text(rows_dir / f"engine_calls.{r}")) for r in (0, 1)}
    return proc, rows, calls


def _text(path):
    return path.read_text() if path.exists() else ""


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_tp_ranks_train_their_group_leaders_rows_in_training_and_evaluation(
    bin_dir, subprocess_env, tmp_path
):
    """Single-turn rollouts for two steps and an evaluation after the last (its own sampling):
    rank 1, whose seeds differ, records exactly rank 0's rows for every generate call, and
    only rank 0's engine decodes."""
    proc, rows, calls = _run(
        bin_dir, subprocess_env, tmp_path, "grpo_qwen", "rollout.temperature=1.0",
        "eval.every_steps=2", "eval.at_start=false", "eval.max_prompts=4",
        "eval.num_samples=2", "eval.max_new_tokens=6",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(rows[0]) >= 3  # two steps' rollouts and the evaluation
    assert rows[1] == rows[0]
    assert any(len(r[0]) > 1 for call in rows[0] for r in call)  # rows of several tokens
    assert calls[0] >= len(rows[0]) and calls[1] == 0


def test_tp_ranks_train_their_group_leaders_multi_turn_episodes(bin_dir, subprocess_env, tmp_path):
    """Multi-turn episodes (an assistant turn per request, the environment stepped on rank 0):
    every turn's rows are decoded once, so rank 1, whose seeds differ, records rank 0's
    episodes token for token."""
    proc, rows, calls = _run(
        bin_dir, subprocess_env, tmp_path, "grpo_guess_number", "grpo.global_batch_size=32",
        "rollout.max_new_tokens=64", "rollout.vllm.block_size=32",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(rows[0]) >= 2
    assert rows[1] == rows[0]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert max(r["turns_max"] for r in records) > 1  # episodes of several turns
    assert calls[0] > len(rows[0]) and calls[1] == 0  # several turns per generate call
