"""rollout.backend=vllm through the real rlbatch-train: settings vLLM cannot honour are refused
before launch, all at once; a run on vLLM (the ``vllm`` extra, installed by CI) at tp 2 x pp 2
takes the policy's weights at every step and its behaviour logprobs are the trainer's own:
on-policy, the importance weights pi_old / pi_rollout stay 1 and nothing clips, step after
step; its evaluation (eval.*) runs on the same engines, and rlbatch-eval on the run directory
reproduces it. (tp 1: tests/unit/rollout/test_vllm_backend.py.)"""

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


STEPS = 2
EVAL = (
    "eval.every_steps=2", "eval.at_start=false", "eval.max_prompts=4", "eval.num_samples=2",
    "eval.temperature=1.0", "eval.max_new_tokens=6",
)  # fmt: skip
"""Evaluation at the last step with its own sampling (training samples at 0.7, up to 24+)."""


@pytest.fixture(scope="module")
def tp2_pp2_run(bin_dir, subprocess_env, tmp_path_factory):
    """Two steps at temperature 0.7 on four ranks (tp 2 x pp 2), each with its own full vLLM
    engine, evaluating after the last step on the same engines."""
    pytest.importorskip("vllm")
    run_dir = tmp_path_factory.mktemp("vllm") / "run"
    proc = _train(
        bin_dir, subprocess_env, run_dir, *HEADS_OF_32, f"trainer.max_steps={STEPS}",
        "parallel.tp=2", "parallel.pp=2", "rollout.vllm.kv_cache_space_gb=0.25",
        "rollout.temperature=0.7", "grpo.epsilon_low=0.01", "grpo.epsilon_high=0.01", *EVAL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.optional_extra
def test_a_vllm_run_samples_with_the_trainers_logprobs_at_tp2_pp2(tp2_pp2_run):
    """Before every step's generation the weights are streamed from megatron's shards
    (gathered over tp, broadcast stage by stage over pp; rollout/weight_sync_s), and vLLM's
    behaviour logprobs equal the training forward's to float32 rounding after every optimizer
    step: on-policy, the importance weights pi_old / pi_rollout stay 1 and nothing clips (a
    missed sync, a stale tied output layer or a stale prefix cache would show as weights far
    from 1)."""
    lines = (tp2_pp2_run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["rollout/weight_sync_s"] > 0
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["clip_fraction"] == 0.0
    assert records[-1]["kl"] > 0  # the policy moved away from the reference: versions changed


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(records):
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "seconds", "memory_gb")) and "per_s" not in k}
            for r in records]  # fmt: skip


@pytest.mark.slow
@pytest.mark.optional_extra
def test_a_resumed_dp2_ep2_moe_vllm_run_has_identical_metrics(bin_dir, subprocess_env, tmp_path):
    """An MoE policy (tiny Qwen3-MoE) on two data-parallel replicas that split its experts
    (dp 2 x ep 2), each with its own engine on its own prompts, two steps with a checkpoint
    after each: every engine gets every expert (the stream gathers each expert tensor over the
    expert-parallel group), and on-policy the trainer's logprobs are vLLM's at every step (an
    expert left out of the stream, or left in the checkpoint's layout by the CPU build's
    update, puts them ~1e-2 apart); step 2 again, resumed in a new run directory from step 1's
    checkpoint (a fresh engine, started from the config and synced from the checkpoint's
    weights), gives the uninterrupted run's metrics exactly. Each step evaluates 4
    held-out prompts, one block of the micro-batch for the two ranks: the blocks are dealt so
    both ranks make a generate call (its weight sync gathers the experts over the expert group;
    a rank without one left its peer waiting, and the run hung)."""
    pytest.importorskip("vllm")
    common = (
        "model=tiny_moe", *HEADS_OF_32, "model.head_dim=32", "parallel.dp=2", "parallel.ep=2",
        "trainer.max_steps=2", "trainer.checkpoint.every_steps=1",
        "rollout.vllm.kv_cache_space_gb=0.25", "eval.every_steps=1", "eval.at_start=false",
        "eval.max_prompts=4", "eval.num_samples=2",
    )  # fmt: skip
    ref = _train(bin_dir, subprocess_env, tmp_path / "ref", *common)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _records(tmp_path / "ref")
    assert [r["step"] for r in expected] == [1, 2]
    for r in expected:
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    # the engines take step 1's weights for its evaluation, before step 2's rollout
    assert expected[0]["rollout/weight_sync_s"] > 0
    assert expected[-1]["kl"] > 0  # step 2 sampled the updated experts
    assert all("eval/reward_mean" in r for r in expected)
    run_dir = tmp_path / "resumed"
    step_1 = tmp_path / "ref" / "checkpoints" / "step_00000001"
    resumed = _train(bin_dir, subprocess_env, run_dir, *common, f"trainer.resume={step_1}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _untimed(_records(run_dir)) == _untimed(expected)


QWEN2_MOE = (
    "model.architecture=qwen2_moe", "model.qk_layernorm=false", "model.add_qkv_bias=true",
    "model.moe_shared_expert_intermediate_size=40", "model.head_dim=null", *HEADS_OF_32,
)  # fmt: skip
"""tiny_moe as a Qwen2-MoE with a shared expert; heads of width 32 (hidden 64 / 2 heads: vLLM's
Qwen2-MoE takes hidden_size / heads)."""

TWO_TURNS_ENV = '''
class TwoTurns:
    """An observation after turn 1, done after turn 2."""

    def reset(self, row):
        return {"turn": 0}

    def step(self, state, text):
        state["turn"] += 1
        if state["turn"] >= 2:
            return {"observation": None, "done": True, "reward": 1.0}
        return {"observation": "again", "done": False, "reward": 0.0}
'''


@pytest.mark.slow
@pytest.mark.optional_extra
def test_an_moe_policy_with_expert_and_pipeline_parallelism_samples_on_policy_on_vllm(
    bin_dir, subprocess_env, tmp_path
):
    """A tiny Qwen2-MoE (tiny_moe's shape with Qwen2-MoE's attention, q/k/v biases and no
    QK-norm, and a shared expert of width 40 behind its sigmoid gate in every MoE layer) at
    dp 2 x ep 2 x pp 2 (4 ranks; each pipeline stage holds one MoE layer, whose routed experts
    its two data-parallel ranks split and whose shared expert both hold) in a two-turn
    environment (each turn a new request of the row's exact ids; an episode whose first turn
    ends with EOS gets an observation and a second turn): the weight stream goes stage by
    stage, each stage gathering its experts over its own expert-parallel group, and every
    rank's engine (vLLM's Qwen2MoeForCausalLM) gets the whole model under Hugging Face's
    names, the shared expert and its gate included. On-policy at both steps (after an update
    too): vLLM's logprobs of the assistant tokens are the trainer's (an expert of either stage
    left out, or stale, puts them ~1e-2 apart)."""
    pytest.importorskip("vllm")
    (tmp_path / "two_turns.py").write_text(TWO_TURNS_ENV)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", "rollout.backend=vllm",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", "model=tiny_moe", *QWEN2_MOE,
         "parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "trainer.max_steps=2",
         "grpo.global_batch_size=32", "grpo.num_generations=4", "grpo.beta=0.02",
         "env=default", "env.path=two_turns.py:TwoTurns", "env.max_turns=2",
         "rollout.max_new_tokens=48", "rollout.vllm.kv_cache_space_gb=0.25",
         "rollout.vllm.block_size=32"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/weight_sync_s"] > 0
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["turns_max"] == 2 and r["env_errors"] == 0  # episodes went on after turn 1
    assert records[-1]["kl"] > 0  # step 2 sampled the updated experts


@pytest.mark.slow
@pytest.mark.optional_extra
def test_the_default_recipe_learns_on_vllm(bin_dir, subprocess_env, tmp_path):
    """The default recipe's task, every rollout sampled by vLLM with the weights of the step
    before: the mean reward of the last 6 of 40 steps is well above the first 6's (the built-in
    engine's bar and steps in test_train_cli.py), and the run stays on-policy throughout."""
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    proc = _train(bin_dir, subprocess_env, run_dir, *HEADS_OF_32, "logging.progress=false",
                  "rollout.vllm.kv_cache_space_gb=0.25", "trainer.max_steps=40")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, 41))
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.1, f"reward did not rise on vLLM: {first:.3f} -> {last:.3f}"
    assert max(abs(r["mismatch_kl_k1"]) for r in records) < 1e-6


# ------------------------------------------------------------------ multi-turn environments
COUNTED_ENV = '''
import os

from rlbatch.env.guess_number import GuessNumber


class Counted(GuessNumber):
    """The built-in game, recording which process steps it (one file per process)."""

    def step(self, state, text):
        with open(f"steps.{os.getpid()}", "a") as f:
            f.write("s")
        return super().step(state, text)
'''


@pytest.mark.slow
@pytest.mark.optional_extra
def test_multi_turn_episodes_run_on_vllm_at_tp2_pp2(bin_dir, subprocess_env, tmp_path):
    """The guess-the-number recipe on vLLM over a model-parallel group of four ranks (tp 2 x
    pp 2: tensor and pipeline groups in one run), each with its own full engine: each turn
    continues the row's exact ids (prompt, sampled tokens with their EOS, the observation's
    ids) as a new request; the environment is stepped on the group's first rank only and its
    answers broadcast, so the ranks train one transcript. The samples file's observation ids
    are the tokenized wrapped observations, they carry no loss, and vLLM's behaviour logprobs
    of the assistant tokens are the trainer's from the first step (importance weights 1,
    mismatch KL ~0)."""
    pytest.importorskip("vllm")
    from rlbatch.engine.tokenizer import ByteTokenizer

    (tmp_path / "counted.py").write_text(COUNTED_ENV)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", "rollout.backend=vllm",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", *HEADS_OF_32, "parallel.tp=2", "parallel.pp=2",
         "env.path=counted.py:Counted", "trainer.max_steps=2", "grpo.global_batch_size=32",
         "rollout.max_new_tokens=64",
         "rollout.vllm.kv_cache_space_gb=0.25", "rollout.vllm.block_size=32",
         "logging.samples=true"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1.0 <= r["turns_mean"] <= r["turns_max"] <= 4
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["env_errors"] == 0
    assert len(list(tmp_path.glob("steps.*"))) == 1  # one process stepped the environment
    tok, observed = ByteTokenizer(), 0
    for step in (1, 2):
        lines = (run_dir / "samples" / f"step_{step:05d}.jsonl").read_text().splitlines()
        for s in map(json.loads, lines):
            pos = 0
            for turn in s["turns"]:
                ids = s["response_ids"][pos : pos + turn["tokens"]]
                mask = s["loss_mask"][pos : pos + turn["tokens"]]
                if turn["role"] == "observation":
                    assert ids == tok.encode(turn["text"]) and mask == [0] * len(ids)
                    observed += 1
                else:
                    assert mask == [1] * len(ids)
                pos += turn["tokens"]
            assert pos == len(s["response_ids"])
    assert observed > 0


@pytest.mark.slow
@pytest.mark.optional_extra
def test_evaluation_runs_on_vllm_and_rlbatch_eval_reproduces_it(
    tp2_pp2_run, bin_dir, subprocess_env
):
    """eval.* during a vLLM run samples on the run's engines with the evaluation's own settings
    (eval.max_new_tokens=6 caps every sample, where training's rows run longer), and
    rlbatch-eval on the run directory, on one rank (tp 1, pp 1: one engine fed the whole
    model), samples the step's weights again with the same seeds: the same samples and
    metrics. vLLM's noise is not the built-in engine's, so equal samples say both ran on vLLM."""
    last = json.loads((tp2_pp2_run / "metrics.jsonl").read_text().splitlines()[-1])
    evaluated = {k: v for k, v in last.items() if k.startswith("eval/") and "seconds" not in k}
    assert "eval/reward_mean" in evaluated and "eval/pass@1" in evaluated
    samples_file = tp2_pp2_run / f"eval/step_{STEPS:05d}.jsonl"
    rows = [json.loads(line) for line in samples_file.read_text().splitlines()]
    tokens = [s["num_tokens"] for r in rows for s in r["samples"]]
    assert len(rows) == 4 and len(tokens) == 8 and max(tokens) <= 6 and 6 in tokens
    cmd = [
        str(bin_dir / "rlbatch-eval"), str(tp2_pp2_run), "--step", str(STEPS), "--json",
        "parallel.tp=1", "parallel.pp=1",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=subprocess_env, cwd=tp2_pp2_run.parent,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    again = {k: v for k, v in result["metrics"].items() if k in evaluated}
    assert again == evaluated
    with open(result["samples"]) as fh:
        assert fh.read() == samples_file.read_text()
