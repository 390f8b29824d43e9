"""rlbatch-train with the output projection in chunks (model.logits_chunk_tokens=3) equals the
same run with full logits (0), step by step: the reference pass (beta > 0), the old-logprob
pass (num_iterations=2), the train pass with its loss, KL, entropy and clip metrics, the
gradient norm and the generated samples (rewards), at a sampling temperature != 1."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.e2e

COMPARED = ("loss", "grad_norm", "kl", "entropy", "clip_fraction", "ratio_mean", "is_weight_max")


def _run(bin_dir, env, cwd, chunk: int) -> list[dict]:
    run_dir = cwd / f"chunk{chunk}"
    proc = subprocess.run(
        [
            str(bin_dir / "rlbatch-train"),
            "+recipe=grpo_qwen",
            "trainer.max_steps=3",
            "grpo.num_iterations=2",
            "grpo.num_generations=4",
            "grpo.global_batch_size=16",
            "grpo.loss_agg_mode=seq-mean-token-mean",
            "rollout.temperature=0.8",
            "batching@batching.train=packed",
            f"model.logits_chunk_tokens={chunk}",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resolved = (run_dir / "resolved.yaml").read_text()
    assert f"logits_chunk_tokens: {chunk}" in resolved
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_chunked_run_equals_unchunked_run(bin_dir, subprocess_env, tmp_path):
    full = _run(bin_dir, subprocess_env, tmp_path, 0)
    chunked = _run(bin_dir, subprocess_env, tmp_path, 3)
    assert [r["step"] for r in chunked] == [r["step"] for r in full] == [1, 2, 3]
    assert "old_logps_seconds" in full[0] and "old_logps_seconds" in chunked[0]
    assert any(r["kl"] > 0 for r in full) and any(r["clip_fraction"] > 0 for r in full)
    for got, want in zip(chunked, full, strict=True):
        assert got["reward_mean"] == want["reward_mean"]  # the same samples were generated
        assert got["tokens"] == want["tokens"]
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["step"], key)


def _logprobs_cli(bin_dir, env, cwd, hf_dir, rows) -> subprocess.CompletedProcess:
    (cwd / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        str(bin_dir / "rlbatch-logprobs"),
        f"model.hf_path={hf_dir}",
        f"logprobs.input={cwd / 'in.jsonl'}",
        f"logprobs.output={cwd / 'out.jsonl'}",
        "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_layers=2",
        "batching.infer.max_tokens=1024",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_logprobs_cli_long_sequence_and_input_checks(bin_dir, subprocess_env, tmp_path):
    """With model.hf_path the context is the checkpoint's own (800 tokens > the tiny preset's
    512 score, and match transformers); a bad input file fails in the driver, before any
    worker starts, naming every bad row."""
    import torch

    from hf_reference import reference_logps, save_tiny_qwen2

    ref = save_tiny_qwen2(tmp_path / "hf", num_layers=2)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 259, (800,), generator=torch.Generator().manual_seed(2)).tolist()
    proc = _logprobs_cli(bin_dir, subprocess_env, tmp_path, tmp_path / "hf", [{"input_ids": ids}])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "model.max_position_embeddings: 512 -> 1024" in " ".join(proc.stderr.split())
    got = json.loads((tmp_path / "out.jsonl").read_text())["token_logprobs"]
    assert got == pytest.approx(reference_logps(ref, ids), abs=1e-4)

    (tmp_path / "out.jsonl").unlink()
    bad = [{"input_ids": ids + ids}, {"input_ids": [1, 2, 300]}, {"input_ids": [5, 6]}]
    proc = _logprobs_cli(bin_dir, subprocess_env, tmp_path, tmp_path / "hf", bad)
    assert proc.returncode != 0
    err = " ".join(proc.stderr.split())
    assert "logprobs.input" in err
    assert "row 0: 1600 tokens > model.max_position_embeddings=1024" in err
    assert "row 1: token id 300 outside [0, model.vocab_size=264)" in err
    assert "row 2" not in err and "workers" not in err and not (tmp_path / "out.jsonl").exists()
