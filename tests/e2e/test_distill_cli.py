"""On-policy distillation through the real rlbatch-train (docs/grpo_loss.md, "On-policy
distillation"). The teacher is a random Hugging Face Qwen2 of another shape than the student,
made peaked. Pure distillation (reward_coef=0) of a fresh student at pp=2 and temperature 0.7,
on prompts without answers: no reward is computed, the teacher's per-token advantage is the whole loss (on-policy its value
is the reported reverse KL), and the logged per-token advantages equal the teacher's log-probs
computed by transformers in float64 minus the behaviour log-probs. A LoRA student over a run's <run_dir>/hf, sampling
at temperature 0.7 one step ahead in the generation worker: the teacher pass (in that worker)
matches transformers in float64 and the rewards still count; the student's own checkpoint as
its teacher is refused. Bad distillation settings are refused before launch, all at once. The
recipe distill_qwen's shape twin (tests/e2e/test_shape_twins.py) resumes a SIGKILLed pure
distillation run exactly like the uninterrupted one."""

from __future__ import annotations

import json
import shutil

import pytest

from recipe_runs import metrics, run_train

pytestmark = pytest.mark.e2e

SMALL = [
    "grpo.num_generations=4", "grpo.global_batch_size=16", "logging.plot=false",
    "logging.tensorboard=false", "logging.progress=false",
]  # fmt: skip


def _train(bin_dir, env, run_dir, *overrides, check=True):
    return run_train(bin_dir, env, run_dir, "+recipe=grpo_qwen", *SMALL, *overrides, check=check)


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
    prompts = root / "prompts.jsonl"  # prompts only: pure distillation needs no answers
    prompts.write_text("".join(json.dumps({"prompt": f"copy {n}:"}) + "\n" for n in range(40)))
    common = [
        "data=jsonl", f"data.path={prompts}",
        f"grpo.distill.teacher={hf}", "grpo.distill.reward_coef=0", "grpo.distill.clip=4.0",
        "grpo.distill.coef=0.5", "trainer.max_steps=3", "parallel.pp=2",
        "rollout.temperature=0.7", "logging.samples=true",
    ]  # fmt: skip
    proc = _train(bin_dir, subprocess_env, root / "pure", *common)  # exports <run_dir>/hf
    (root / "pure_console.txt").write_text(proc.stdout + proc.stderr)
    return root, common


def test_pure_distillation_trains_on_the_teacher_alone(pure):
    root, _ = pure
    records = metrics(root / "pure")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        # no reward is computed, so none is reported (not a reward of 0)
        assert not [k for k in r if k.startswith("reward")], sorted(r)
        assert r["advantage_zero_frac"] == 0.0  # yet every sample has an advantage
        assert r["distill/teacher_kl"] > 0.5  # a sharp teacher, a near-uniform student
        assert 0.0 < r["distill/clip_frac"] < 1.0  # the clamp at 4 nats acted on some tokens
        assert r["distill/teacher_seconds"] > 0.0
        # on-policy (ratio 1, weight 1 up to the engine's noise) with token-mean and no other
        # term the loss is -mean(D_t) = coef * the reverse KL, less what the clamp cut off
        assert r["loss"] <= 0.5 * r["distill/teacher_kl"] + 1e-6
        assert r["loss"] == pytest.approx(0.5 * r["distill/teacher_kl"], rel=0.2)
    console = (root / "pure_console.txt").read_text()  # the end-of-run summary table
    assert "distill/teacher_kl" in console and "reward_mean" not in console
    resolved = (root / "pure" / "resolved.yaml").read_text()
    assert f"teacher: {root / 'teacher'}" in resolved


def test_teacher_advantages_match_transformers_in_float64(pure):
    """The teacher pass at pp=2 and temperature 0.7 against the teacher run by transformers in
    float64: each logged sample's token_advantages = 0.5 * clamp(log p_T(y_t) -
    behaviour_t, -4, 4) with log p_T from logits / 0.7."""
    import torch
    import transformers

    root, _ = pure
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "teacher").double().eval()
    lines = (root / "pure" / "samples" / "step_00001.jsonl").read_text().splitlines()
    worst, clamped = 0.0, 0
    for line in lines[:8]:
        s = json.loads(line)
        ids = s["prompt_ids"] + s["response_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0] / 0.7
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        teacher = logp[len(s["prompt_ids"]) - 1 :].tolist()
        for t, b, got in zip(teacher, s["behaviour_logps"], s["token_advantages"], strict=True):
            want = 0.5 * max(-4.0, min(4.0, t - b))
            clamped += abs(t - b) > 4.0
            worst = max(worst, abs(got - want))
    assert worst < 2e-4, worst  # float32 megatron against float64 transformers
    assert clamped > 0  # the clamp's branch is part of the comparison


def test_a_lora_student_distills_ahead_in_the_generation_worker(pure, bin_dir, subprocess_env):
    """A run's <run_dir>/hf as the LoRA student's base, sampling at temperature 0.7 one step
    ahead (the teacher pass runs in the generation worker): the logged advantages are the
    teacher's float64 log-probs minus the behaviour log-probs, and the rewards still count. The
    student's own checkpoint as its teacher is refused before launch (it would teach nothing)."""
    import torch
    import transformers

    root, _ = pure
    hf = root / "pure" / "hf"
    (root / "hf_link").symlink_to(hf)
    same = _train(
        bin_dir, subprocess_env, root / "same", f"model.hf_path={hf}",
        f"grpo.distill.teacher={root / 'hf_link'}", check=False,
    )  # fmt: skip
    out = same.stdout + same.stderr
    assert same.returncode == 2, out[-3000:]
    assert "grpo.distill.teacher" in out and "is the student's own checkpoint" in out
    run = root / "lora"
    _train(
        bin_dir, subprocess_env, run, f"model.hf_path={hf}", f"grpo.distill.teacher={root / 'teacher'}",
        "model.lora.rank=4", "trainer.optim.lr=1e-2", "rollout.temperature=0.7",
        "grpo.num_steps_async=1", "trainer.max_steps=2", "trainer.checkpoint.export_hf=false",
        "logging.samples=true",
    )  # fmt: skip
    records = metrics(run)
    # each step trains samples of version 0 (the base)
    assert [r["staleness_mean"] for r in records] == [0.0, 1.0]
    for r in records:
        assert r["distill/teacher_kl"] > 0.0  # another model than the student
        assert r["reward_mean"] >= 0.0  # reward_coef=1: the rewards still count
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "teacher").double().eval()
    worst = 0.0
    for line in (run / "samples" / "step_00002.jsonl").read_text().splitlines()[:6]:
        s = json.loads(line)
        assert s["reward"] is not None
        ids = s["prompt_ids"] + s["response_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0] / 0.7
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        teacher = logp[len(s["prompt_ids"]) - 1 :].tolist()
        for t, b, got in zip(teacher, s["behaviour_logps"], s["token_advantages"], strict=True):
            worst = max(worst, abs(got - (t - b)))
    assert worst < 2e-4, worst


def test_bad_distillation_settings_are_refused_before_launch(teacher, bin_dir, subprocess_env):
    root, hf = teacher
    other = root / "other_vocab"
    shutil.copytree(hf, other)  # no tokenizer files
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = config["vocab_size"] + 8
    config["max_position_embeddings"] = 32  # shorter than the run's prompt + response
    (other / "config.json").write_text(json.dumps(config))
    proc = _train(
        bin_dir, subprocess_env, root / "refused", f"grpo.distill.teacher={other}",
        "grpo.policy_loss=gspo", "grpo.distill.clip=-1", "grpo.distill.reward_coef=0",
        "grpo.overlong_buffer_len=4", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "grpo.distill.teacher" in out and "vocab_size=272" in out
    assert "(max_position_embeddings = 32) is shorter than the run's longest sequence" in out
    assert "grpo.policy_loss" in out and "gspo_token" in out
    assert "grpo.distill.clip" in out
    # pure distillation computes no reward, so no reward part such as the overlong penalty
    assert "grpo.overlong_buffer_len" in out and "computes no reward" in out
    assert not (root / "refused" / "metrics.jsonl").exists()


def test_a_resume_keeps_its_teacher_by_content_not_by_path(pure, bin_dir, subprocess_env):
    """The teacher's directory re-trained in place (same path, same shapes, other weights) is
    refused on resume, naming grpo.distill.teacher; nothing runs."""
    from safetensors.torch import load_file, save_file

    root, common = pure
    retrained = root / "retrained"
    shutil.copytree(root / "teacher", retrained)
    (weights,) = retrained.glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    overrides = [o for o in common if not o.startswith("grpo.distill.teacher=")]
    before = (root / "pure" / "metrics.jsonl").read_text()
    proc = _train(
        bin_dir, subprocess_env, root / "pure", *overrides, f"grpo.distill.teacher={retrained}",
        "trainer.max_steps=4", "trainer.resume=auto", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"grpo.distill.teacher={retrained}: is not the teacher" in out
    assert "the digest of its *.safetensors differs" in out
    assert (root / "pure" / "metrics.jsonl").read_text() == before
