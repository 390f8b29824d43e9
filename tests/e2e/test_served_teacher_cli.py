"""A served distillation teacher (grpo.distill.teacher_url) through the real rlbatch-train, on
one of the session's rlbatch-serve servers (tests/conftest.py's vllm_server_pool: no server
start of its own). A rollout-server run loads a peaked teacher (model.hf_path) and pushes it to
the server, which then serves the teacher's weights. Pure distillation of a fresh student at
temperature 1 scored by that server gives, token by token, the same advantages as the
in-process teacher built from the same directory (both fp32); SIGKILLed during its last step
and resumed it reproduces every step; on a multi-turn environment only the sampled turns get an
advantage; a bad served teacher is refused before launch, naming the key, the URL and the fix,
all at once."""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_pool import MODEL, SERVED_LEN

pytestmark = pytest.mark.e2e

SMALL = [
    "grpo.num_generations=4", "grpo.global_batch_size=16", "logging.plot=false",
    "logging.tensorboard=false", "logging.progress=false", "trainer.checkpoint.export_hf=false",
]  # fmt: skip
TOLERANCE = 1e-4
"""vLLM's CPU kernels against megatron's, both fp32, on advantages of a peaked teacher (up to
12 nats): 3.8e-6 at worst over the 256 tokens of step 1 when measured."""


def _train(bin_dir, env, run_dir, *overrides, check=True):
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *MODEL, f"hydra.run.dir={run_dir}", *SMALL, *overrides],
        capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.endswith(("_s", "seconds", "_gb"))}
        for line in lines
    ]


def _samples(run_dir, step):
    lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def served(vllm_server_pool, bin_dir, subprocess_env, tmp_path_factory):
    """The first pool server, serving a peaked teacher of the pool's model shape (the
    server's own config.json, random weights with the embeddings scaled by 10)."""
    import torch
    import transformers

    url = vllm_server_pool[0]
    root = tmp_path_factory.mktemp("served_teacher")
    models = json.loads(subprocess.check_output(["curl", "-s", f"{url}/v1/models"]))
    config = transformers.AutoConfig.from_pretrained(models["data"][0]["root"])
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(10.0)  # tied: the output layer too
    model.save_pretrained(root / "teacher")
    # the pool's model reads bytes: say so, as rlbatch's export of a byte-tokenizer run does
    (root / "teacher" / "rlbatch_tokenizer.json").write_text('{"tokenizer": "bytes"}')
    # a 1-step run from the teacher's weights syncs them to the server before its step
    _train(
        bin_dir, subprocess_env, root / "push", f"model.hf_path={root / 'teacher'}",
        "rollout.backend=vllm_server", f"rollout.servers.urls=[{url}]", "trainer.max_steps=1",
        "grpo.beta=0",
    )  # fmt: skip
    return url, root


def _distill(url_or_dir):
    key = "teacher_url" if str(url_or_dir).startswith("http") else "teacher"
    return [
        f"grpo.distill.{key}={url_or_dir}", "grpo.distill.reward_coef=0", "grpo.beta=0",
        "logging.samples=true", "trainer.checkpoint.every_steps=1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(served, bin_dir, subprocess_env):
    url, root = served
    run = root / "served"
    _train(bin_dir, subprocess_env, run, *_distill(url), "trainer.max_steps=3")
    return run


def test_served_teacher_scores_as_the_in_process_teacher(served, uninterrupted, bin_dir,
                                                         subprocess_env):  # fmt: skip
    """Step 1 samples the same rows in both runs (same seed, same fresh student); the served
    teacher's advantages equal the in-process teacher's on every sampled token."""
    url, root = served
    inproc = root / "in_process"
    _train(bin_dir, subprocess_env, inproc, *_distill(root / "teacher"), "trainer.max_steps=1")
    records = _metrics(uninterrupted)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert not [k for k in r if k.startswith("reward")]  # pure distillation: no reward
        assert r["distill/teacher_kl"] > 0.5  # a peaked teacher, a near-uniform student
    want, got = _samples(inproc, 1), _samples(uninterrupted, 1)
    assert [s["response_ids"] for s in got] == [s["response_ids"] for s in want]
    worst = max(
        abs(a - b)
        for g, w in zip(got, want, strict=True)
        for a, b in zip(g["token_advantages"], w["token_advantages"], strict=True)
    )
    assert worst < TOLERANCE, worst
    step1 = _metrics(inproc)[0]
    assert step1["distill/teacher_kl"] == pytest.approx(records[0]["distill/teacher_kl"], abs=1e-4)


def test_served_teacher_run_killed_and_resumed_matches_the_uninterrupted(
    served, uninterrupted, bin_dir, subprocess_env
):
    url, root = served
    run = root / "killed"
    overrides = [*_distill(url), "trainer.max_steps=3"]
    killed = _train(
        bin_dir, subprocess_env, run, *overrides, "debug.fail_at_step=3", "debug.fail_kind=kill",
        check=False,
    )  # fmt: skip
    assert killed.returncode != 0 and len(_metrics(run)) == 2
    _train(bin_dir, subprocess_env, run, *overrides, "trainer.resume=auto")
    assert _metrics(run) == _metrics(uninterrupted)


def test_served_teacher_scores_only_the_sampled_turns_of_an_episode(
    served, bin_dir, subprocess_env
):
    """Pure distillation on the guess-the-number environment (a student whose turns end with
    EOS, so episodes reach the environment): the served teacher sees the whole episode as
    context, only the tokens the student sampled get an advantage, each its transformers
    float64 teacher log-prob minus the behaviour log-prob, observations 0; no reward part or
    reward failure is logged (none is computed)."""
    import torch
    import transformers

    from hf_reference import save_turn_ending_qwen2
    from rlbatch.engine.tokenizer import ByteTokenizer

    url, root = served
    student = root / "student"
    save_turn_ending_qwen2(student, eos_id=ByteTokenizer().eos_ids[0])
    (student / "rlbatch_tokenizer.json").write_text('{"tokenizer": "bytes"}')
    run = root / "episodes"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", f"model.hf_path={student}",
         f"hydra.run.dir={run}", *SMALL, *_distill(url), "trainer.max_steps=1"],
        capture_output=True, text=True, env=subprocess_env, cwd=root, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = _metrics(run)
    assert record["turns_mean"] > 1.0 and not [k for k in record if k.startswith("reward")]
    teacher = transformers.AutoModelForCausalLM.from_pretrained(root / "teacher").double().eval()
    worst, sampled, observed = 0.0, 0, 0
    for s in _samples(run, 1):
        ids = s["prompt_ids"] + s["response_ids"]
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([ids])).logits[0]
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        scored = logp[len(s["prompt_ids"]) - 1 :].tolist()
        for t, b, adv, mask in zip(
            scored, s["behaviour_logps"], s["token_advantages"], s["loss_mask"], strict=True
        ):
            if mask:
                sampled += 1
                worst = max(worst, abs(adv - (t - b)))
            else:
                observed += 1
                assert adv == 0.0
    assert sampled > 0 and observed > 0
    assert worst < TOLERANCE, worst


def test_bad_served_teacher_settings_are_refused_before_launch(served, bin_dir, subprocess_env,
                                                               tmp_path):  # fmt: skip
    url, root = served
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "refused", *_distill(url),
        f"grpo.distill.teacher={root / 'teacher'}", "rollout.temperature=0.7",
        "data.max_prompt_len=400", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "grpo.distill.teacher_url" in out and "is exclusive with grpo.distill.teacher" in out
    assert "rollout.temperature" in out and "raw logits" in out
    assert f"grpo.distill.teacher_url={url}: serves sequences of at most {SERVED_LEN}" in out
    assert "rlbatch-serve rollout.vllm.max_model_len>=417" in out  # 400 + 16 + the sampled one
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    down = _train(
        bin_dir, subprocess_env, tmp_path / "down", *_distill("http://127.0.0.1:9"),
        check=False,
    )  # fmt: skip
    out = down.stdout + down.stderr
    assert down.returncode == 2, out[-3000:]
    assert "grpo.distill.teacher_url" in out and "is unreachable" in out and "rlbatch-serve" in out
