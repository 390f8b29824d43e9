"""On-policy distillation through the real rlbatch-train (docs/grpo_loss.md, "On-policy
distillation"). The teacher is a random Hugging Face Qwen2 of another shape than the student,
made peaked. Pure distillation (reward_coef=0) of a fresh student: no reward is computed and
the teacher's per-token advantage is the whole loss (on-policy its value is the reported
reverse KL). A LoRA student whose base is the teacher itself (a run's <run_dir>/hf), sampling
at temperature 0.7 one step ahead in the generation worker: the teacher pass (in that worker)
sees the behaviour policy's own distribution, so the reverse KL is 0 up to float noise, and the
rewards still count. Bad distillation settings are refused before launch, all at once. The
recipe distill_qwen's shape twin (tests/e2e/test_shape_twins.py) resumes a SIGKILLed pure
distillation run exactly like the uninterrupted one."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.e2e

SMALL = [
    "grpo.num_generations=4", "grpo.global_batch_size=16", "logging.plot=false",
    "logging.tensorboard=false", "logging.progress=false",
]  # fmt: skip


def _train(bin_dir, env, run_dir, *overrides, check=True):
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={run_dir}",
         *SMALL, *overrides],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A Hugging Face Qwen2 of another shape than the student (hidden 32, not 64) over the byte
    vocabulary, without tokenizer files (its vocab_size is the student's: accepted), peaked
    (hf_reference.save_tiny_teacher)."""
    from hf_reference import save_tiny_teacher

    root = tmp_path_factory.mktemp("distill")
    save_tiny_teacher(root / "teacher")
    return root, root / "teacher"


@pytest.fixture(scope="module")
def pure(teacher, bin_dir, subprocess_env):
    root, hf = teacher
    common = [
        f"grpo.distill.teacher={hf}", "grpo.distill.reward_coef=0", "grpo.distill.clip=4.0",
        "trainer.max_steps=3",
    ]  # fmt: skip
    _train(bin_dir, subprocess_env, root / "pure", *common)  # exports <run_dir>/hf at the end
    return root, common


def test_pure_distillation_trains_on_the_teacher_alone(pure):
    root, _ = pure
    records = _metrics(root / "pure")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["reward_mean"] == 0.0 and r["reward_std"] == 0.0  # no reward computed
        assert r["advantage_zero_frac"] == 0.0  # yet every sample has an advantage
        assert r["distill/teacher_kl"] > 0.5  # a sharp teacher, a near-uniform student
        assert 0.0 < r["distill/clip_frac"] < 1.0  # the clamp at 4 nats acted on some tokens
        assert r["distill/teacher_seconds"] > 0.0
        # on-policy (ratio 1, weight 1 up to the engine's noise) with token-mean and no other
        # term the loss is -mean(D_t): the reverse KL, less what the clamp cut off
        assert r["loss"] <= r["distill/teacher_kl"] + 1e-6
        assert r["loss"] == pytest.approx(r["distill/teacher_kl"], rel=0.2)
    resolved = (root / "pure" / "resolved.yaml").read_text()
    assert f"teacher: {root / 'teacher'}" in resolved


def test_teacher_equal_to_the_behaviour_policy_scores_zero_kl(pure, bin_dir, subprocess_env):
    """A run's <run_dir>/hf as the teacher and as the LoRA student's base."""
    root, _ = pure
    hf = root / "pure" / "hf"
    run = root / "same"
    _train(
        bin_dir, subprocess_env, run, f"model.hf_path={hf}", f"grpo.distill.teacher={hf}",
        "model.lora.rank=4", "trainer.optim.lr=1e-2", "rollout.temperature=0.7",
        "grpo.num_steps_async=1", "trainer.max_steps=2", "trainer.checkpoint.export_hf=false",
    )  # fmt: skip
    records = _metrics(run)
    # the LoRA student starts as its base, the teacher; each step trains samples of version 0
    assert [r["staleness_mean"] for r in records] == [0.0, 1.0]
    for r in records:
        assert abs(r["distill/teacher_kl"]) < 1e-4  # same distribution at the same temperature
        assert r["distill/clip_frac"] == 0.0
        assert r["reward_mean"] > 0.0  # reward_coef=1: the rewards still count


def test_bad_distillation_settings_are_refused_before_launch(teacher, bin_dir, subprocess_env):
    root, hf = teacher
    other = root / "other_vocab"
    shutil.copytree(hf, other)  # no tokenizer files
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = config["vocab_size"] + 8
    (other / "config.json").write_text(json.dumps(config))
    proc = _train(
        bin_dir, subprocess_env, root / "refused", f"grpo.distill.teacher={other}",
        "grpo.policy_loss=gspo", "grpo.distill.clip=-1", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "grpo.distill.teacher" in out and "vocab_size=272" in out
    assert "grpo.policy_loss" in out and "gspo_token" in out
    assert "grpo.distill.clip" in out
    assert not (root / "refused" / "metrics.jsonl").exists()
