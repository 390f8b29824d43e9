"""LoRA through the real rlbatch-train: model.lora.rank=8 on a Hugging Face base at pp 2 with
grpo.beta > 0. The adapters train (the guard passes, the policy moves away from the reference
= the base with adapters off, whose KL is reported), the rollout engine samples the adapted
policy (behaviour log-probs equal the trainer's), the count of trainable parameters is the
adapters' (checked against the shapes), checkpoints hold the adapters only, rlbatch-export
merges them into the base, and a SIGKILLed run resumes exactly like the uninterrupted one.
Bad model.lora values are refused before launch, all at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe_runs import metrics, run_train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_reference import save_tiny_qwen2  # noqa: E402
from recipe_runs import stable  # noqa: E402

pytestmark = pytest.mark.e2e

RANK = 8
STEPS = 4


def _expected_trainable(
    layers: int, hidden: int, ffn: int, q: int, kv: int, rank: int = RANK
) -> int:
    """Adapters A [r, in] + B [out, r] of the seven projections of every layer."""
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]  # q, k, v, o
    shapes += [(hidden, ffn), (hidden, ffn), (ffn, hidden)]  # gate, up, down
    return layers * sum(rank * (i + o) for i, o in shapes)


def _train(bin_dir, env, run_dir, *overrides, check=True, recipe="grpo_qwen"):
    quiet = ("logging.plot=false", "logging.tensorboard=false", "logging.progress=false")
    return run_train(bin_dir, env, run_dir, f"+recipe={recipe}", *quiet, *overrides, check=check)


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, bin_dir, subprocess_env):
    root = tmp_path_factory.mktemp("lora")
    save_tiny_qwen2(root / "base", num_layers=2)
    common = [
        f"model.hf_path={root / 'base'}", "model.tokenizer=bytes", f"model.lora.rank={RANK}",
        "trainer.optim.lr=3e-2", "grpo.beta=0.02", "parallel.pp=2", f"trainer.max_steps={STEPS}",
        "trainer.checkpoint.every_steps=2", "trainer.checkpoint.keep_last=3",
    ]  # fmt: skip
    proc = _train(bin_dir, subprocess_env, root / "run", *common)
    return root, common, proc


def test_adapters_train_against_the_base_reference(lora_run):
    root, _, proc = lora_run
    records = metrics(root / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # hidden 32, SwiGLU 64, 4 query heads and 2 key/value heads of width 8
    want = _expected_trainable(layers=2, hidden=32, ffn=64, q=32, kv=16)
    assert all(r["trainable_params"] == want for r in records)
    assert f"trainable parameters: {want:,} of" in proc.stdout + proc.stderr
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the policy is the base
    assert records[-1]["kl"] > 1e-4  # the adapters moved it away from the reference
    for r in records:  # the engine samples the policy the trainer trains
        assert abs(r["mismatch_kl_k1"]) < 1e-5
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_checkpoints_hold_the_adapters_and_export_merges_them(lora_run, bin_dir, subprocess_env):
    from torch.distributed.checkpoint import FileSystemReader

    root, _, _ = lora_run
    ckpt = root / "run" / "checkpoints" / f"step_{STEPS:08d}" / "model_optim"
    keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert keys and all(".lora.lora_" in k for k in keys), [k for k in keys if ".lora." not in k]
    out = root / "export"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-export"), str(root / "run"), "--out", str(out), "--step", str(STEPS)],
        capture_output=True, text=True, env=subprocess_env, cwd=root, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exported, live, base = _tensors(out), _tensors(root / "run" / "hf"), _tensors(root / "base")
    assert set(exported) == set(live)
    assert all(torch.equal(exported[k], live[k]) for k in live)  # base from hf_path + adapters
    merged = [k for k in base if "proj" in k and not torch.equal(exported[k], base[k])]
    assert len(merged) == 2 * 7  # every adapted projection of both layers, nothing else
    assert all(torch.equal(exported[k], base[k]) for k in base if "proj" not in k)


def test_sigkill_then_resume_matches_uninterrupted(lora_run, bin_dir, subprocess_env):
    root, common, _ = lora_run
    run = root / "killed"
    killed = _train(
        bin_dir, subprocess_env, run, *common, "trainer.checkpoint.export_hf=false",
        "debug.fail_at_step=3", "debug.fail_kind=kill", check=False,
    )  # fmt: skip
    assert killed.returncode != 0 and len(metrics(run)) < STEPS
    _train(bin_dir, subprocess_env, run, *common, "trainer.resume=auto")
    assert [stable(r) for r in metrics(run)] == [stable(r) for r in metrics(root / "run")]


def test_lora_recipe_learns(bin_dir, subprocess_env, tmp_path):
    """+recipe=grpo_qwen_lora (rank 16, lr 3e-2) for 20 of its 60 steps (CI's time; it learns
    within its first 12: 0.11 -> 0.33 over the first and last two of 20 steps): the mean reward
    of the last 10% of the steps is well above the first 10%'s, and no reference copy is built
    (the count is the adapters')."""
    run = tmp_path / "run"
    _train(
        bin_dir, subprocess_env, run, "trainer.checkpoint.export_hf=false",
        "trainer.max_steps=20", recipe="grpo_qwen_lora",
    )  # fmt: skip
    records = metrics(run)
    rewards = [r["reward_mean"] for r in records]
    k = len(rewards) // 10
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last > first + 0.1, f"reward did not rise: {first:.3f} -> {last:.3f}"
    # the tiny model: hidden 64, SwiGLU 176, 4 query heads and 2 key/value heads of width 16
    want = _expected_trainable(layers=2, hidden=64, ffn=176, q=64, kv=32, rank=16)
    assert all(r["trainable_params"] == want for r in records)


def test_bad_lora_values_are_refused_before_launch(bin_dir, subprocess_env, tmp_path):
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "run", "model.lora.rank=-1",
        "model.lora.dropout=1.5", "model.lora.target_modules=[qkv_proj]", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "3 configuration error(s)" in out
    for key in ("model.lora.rank=-1", "model.lora.dropout=1.5", "model.lora.target_modules"):
        assert key in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_rank_past_a_shared_expert_and_a_width_tp_cannot_split_are_refused(
    bin_dir, subprocess_env, tmp_path
):
    """A Qwen2-MoE whose shared expert is 8 wide: model.lora.rank=32 on all-linear (which adapts
    that expert) is refused with the rank that fits, and at parallel.tp=2 an odd shared-expert
    width is refused too: both at once, before any worker starts."""
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "run", "model=tiny_moe",
        "model.architecture=qwen2_moe", "model.qk_layernorm=false", "model.add_qkv_bias=true",
        "model.moe_shared_expert_intermediate_size=9", "model.lora.rank=32", "parallel.tp=2",
        "parallel.sequence_parallel=true", check=False,
    )  # fmt: skip
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, out[-3000:]
    assert "model.lora.rank=32: is larger than the layers it adapts" in out, out[-3000:]
    assert "up_proj (64 -> 9)" in out and "model.lora.rank<=9" in out, out[-3000:]
    assert "model.moe_shared_expert_intermediate_size=9: must be divisible by parallel.tp" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_lora_dropout_is_refused_before_launch(bin_dir, subprocess_env, tmp_path):
    """Adapter dropout would be on in the training forward and off in the log-prob passes (the
    first on-policy ratio != 1): refused before any compute, with the key, the value and the
    fix."""
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "run", "model.lora.rank=8", "model.lora.dropout=0.05",
        check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "1 configuration error(s)" in out
    assert "model.lora.dropout=0.05: " in out and "set model.lora.dropout=0" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
