"""rollout.backend=vllm through the real rlbatch-train: settings vLLM cannot honour are refused
before launch, all at once; a run on vLLM (the ``vllm`` extra, installed by CI) at tp 2 x pp 2
takes the policy's weights at every step and its behaviour logprobs are the trainer's own:
on-policy, the importance weights pi_old / pi_rollout stay 1 and nothing clips, step after
step. (tp 1: tests/unit/rollout/test_vllm_backend.py.)"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.e2e

HEADS_OF_32 = ("model.num_attention_heads=2", "model.num_query_groups=2")
"""The tiny model with heads of width 32 (the smallest vLLM's CPU attention supports)."""


def _train(bin_dir, env, run_dir, *overrides):
    return subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", "rollout.backend=vllm",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", *overrides],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600,
    )  # fmt: skip


def test_settings_vllm_cannot_honour_are_refused_before_launch(bin_dir, subprocess_env, tmp_path):
    """top_p / top_k would make vLLM report logprobs of a truncated distribution, and the
    engine's tensor parallelism is fixed at 1: each is an error with its key and fix, all in
    one message, before any worker starts (no run directory is written)."""
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "run", *HEADS_OF_32, "rollout.top_p=0.9",
        "rollout.top_k=5", "rollout.vllm.tensor_parallel_size=2",
    )  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for key, fix in (
        ("rollout.top_p=0.9", "rollout.top_p=1.0"),
        ("rollout.top_k=5", "rollout.top_k=0"),
        ("rollout.vllm.tensor_parallel_size=2", "rollout.vllm.tensor_parallel_size=1"),
    ):
        assert key in out and fix in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.optional_extra
def test_a_vllm_run_samples_with_the_trainers_logprobs_at_tp2_pp2(
    bin_dir, subprocess_env, tmp_path
):
    """Three steps at temperature 0.7 on four ranks (tp 2 x pp 2), each with its own full vLLM
    engine: before every step's generation the weights are streamed from megatron's shards
    (gathered over tp, broadcast stage by stage over pp; rollout/weight_sync_s), and vLLM's
    behaviour logprobs equal the training forward's to float32 rounding after every optimizer
    step: on-policy, the importance weights pi_old / pi_rollout stay 1 and nothing clips (a
    missed sync, a stale tied output layer or a stale prefix cache would show as weights far
    from 1)."""
    pytest.importorskip("vllm")
    steps = 3
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "run", *HEADS_OF_32, f"trainer.max_steps={steps}",
        "parallel.tp=2", "parallel.pp=2", "rollout.vllm.kv_cache_space_gb=0.25",
        "rollout.temperature=0.7", "grpo.epsilon_low=0.01", "grpo.epsilon_high=0.01",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["rollout/weight_sync_s"] > 0
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["clip_fraction"] == 0.0
    assert records[-1]["kl"] > 0  # the policy moved away from the reference: versions changed
