"""A served distillation teacher (grpo.distill.teacher_url) through the real rlbatch-train, on
an rlbatch-serve server started the documented way (model.hf_path=TEACHER: the server loads the
teacher's checkpoint). Pure distillation of a fresh student at temperature 1 scored by that
server gives every sampled token the advantage transformers' float64 teacher log-prob minus the
behaviour log-prob; SIGKILLed during its last step and resumed it reproduces every step; on a
multi-turn environment only the sampled turns get an advantage; a bad served teacher (settings,
a server with dummy weights, a rollout server under another spelling of its URL) is refused
before launch, naming the key, the URL and the fix, all at once."""

from __future__ import annotations

import json
import subprocess

import pytest

from recipe_runs import run_train
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
    return run_train(bin_dir, env, run_dir, *MODEL, *SMALL, *overrides, check=check)


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
def served(vllm_server_pool):
    """A peaked teacher of the pool's model shape (tests/vllm_pool.save_teacher: random weights
    with the embeddings scaled by 10) served by an rlbatch-serve of its own, started with the
    pool (tests/conftest.py) and stopped after this module: (its URL, its folder)."""
    import signal

    from vllm_pool import TEACHER, started_url

    if "error" in TEACHER:
        raise TEACHER["error"]
    proc, root = TEACHER["proc"], TEACHER["root"]
    try:
        yield started_url(proc, root, TEACHER["port"]), root
    finally:  # not left holding memory through the other server files
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


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
    _train(bin_dir, subprocess_env, run, *_distill(url), "trainer.max_steps=2")
    return run


def _worst_against_float64(teacher_dir, samples):
    """The largest |advantage - (float64 teacher log-prob - behaviour log-prob)| over the
    sampled tokens, the number of sampled tokens, of the others (each asserted 0)."""
    import torch
    import transformers

    teacher = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir).double().eval()
    worst, sampled, observed = 0.0, 0, 0
    for s in samples:
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
    return worst, sampled, observed


def test_served_teacher_scores_as_transformers_in_float64(served, uninterrupted):
    """Every sampled token's advantage is the teacher's float64 log-prob (transformers, from
    the directory the server loaded) minus the behaviour log-prob; no reward is logged."""
    url, root = served
    records = _metrics(uninterrupted)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert not [k for k in r if k.startswith("reward")]  # pure distillation: no reward
        assert r["distill/teacher_kl"] > 0.5  # a peaked teacher, a near-uniform student
    samples = _samples(uninterrupted, 1)
    assert all(s["reward"] is None and s["advantage"] is None for s in samples)
    worst, sampled, _ = _worst_against_float64(root / "teacher", samples)
    assert sampled > 100 and worst < TOLERANCE, worst


def test_served_teacher_run_killed_and_resumed_matches_the_uninterrupted(
    served, uninterrupted, bin_dir, subprocess_env
):
    url, root = served
    run = root / "killed"
    overrides = [*_distill(url), "trainer.max_steps=2"]
    killed = _train(
        bin_dir, subprocess_env, run, *overrides, "debug.fail_at_step=2", "debug.fail_kind=kill",
        check=False,
    )  # fmt: skip
    assert killed.returncode != 0 and len(_metrics(run)) == 1
    # the same teacher under another spelling of its URL: its identity, not the URL, is fixed
    port = url.rsplit(":", 1)[1]
    resumed = _train(
        bin_dir, subprocess_env, run, *_distill(f"http://localhost:{port}"),
        "trainer.max_steps=2", "trainer.resume=auto",
    )  # fmt: skip
    assert "grpo.distill.teacher_url: -> 'http://localhost:" in resumed.stderr
    assert _metrics(run) == _metrics(uninterrupted)


def test_served_teacher_scores_only_the_sampled_turns_of_an_episode(
    served, bin_dir, subprocess_env
):
    """Pure distillation on the guess-the-number environment (a student whose turns end with
    EOS, so episodes reach the environment): the served teacher sees the whole episode as
    context, only the tokens the student sampled get an advantage, each its transformers
    float64 teacher log-prob minus the behaviour log-prob, observations 0; no reward part or
    reward failure is logged (none is computed)."""
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
    worst, sampled, observed = _worst_against_float64(root / "teacher", _samples(run, 1))
    assert sampled > 0 and observed > 0
    assert worst < TOLERANCE, worst


def test_bad_served_teacher_settings_are_refused_before_launch(
    served, vllm_server_pool, bin_dir, subprocess_env, tmp_path
):
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
    # a pool server: dummy weights (rlbatch-serve without model.hf_path), labelled as a weight
    # sync labels it (a rollout server of any run), and the run's own rollout server under
    # another spelling of its URL
    dummy = vllm_server_pool[1]
    alias = dummy.replace("127.0.0.1", "localhost")
    label = json.dumps({"new_version": "7"})
    subprocess.run(
        ["curl", "-sf", "-X", "POST", "-H", "Content-Type: application/json", "-d", label,
         f"{dummy}/update_weight_version"], check=True,
    )  # fmt: skip
    proc = _train(
        bin_dir, subprocess_env, tmp_path / "dummy", *_distill(alias),
        "rollout.backend=vllm_server", f"rollout.servers.urls=[{dummy}]", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"grpo.distill.teacher_url={alias}: is the server {dummy} of rollout.servers" in out
    assert "holds no weights (*.safetensors): the server runs dummy (random) weights" in out
    assert "holds weights a trainer's weight sync put there (weight label '7')" in out
    assert not (tmp_path / "dummy" / "metrics.jsonl").exists()
