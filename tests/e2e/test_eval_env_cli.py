"""Evaluation of a multi-turn environment steps the environment on every backend, during
training (eval.every_steps) and in rlbatch-eval: with an environment that pays 1 at the first
step, an evaluated episode that ended its turn with EOS scores 1 and one cut by a limit 0. On
vLLM the evaluation's engine (the run's engine with the evaluation's sampling) used to lose the
environment and sample single-turn episodes that all scored 0."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PAYS_ONE = '''
class PaysOne:
    """Done at the first step, reward 1."""

    def reset(self, row):
        return {}

    def step(self, state, text):
        return {"observation": None, "done": True, "reward": 1.0}
'''

BACKENDS = [
    "megatron",
    pytest.param("vllm", marks=[pytest.mark.optional_extra, pytest.mark.slow]),
]


def _eval_rewards(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(s["reward"], s["truncated"]) for r in rows for s in r["samples"]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluation_steps_the_environment_in_training_and_in_rlbatch_eval(
    bin_dir, subprocess_env, tmp_path, backend
):
    if backend == "vllm":
        pytest.importorskip("vllm")
    (tmp_path / "pays_one.py").write_text(PAYS_ONE)
    rows = [{"prompt": f"guess {i}:", "answer": str(i % 10)} for i in range(16)]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "+recipe=grpo_guess_number", f"rollout.backend={backend}",
         "env=default", "env.path=pays_one.py:PaysOne", "model.num_attention_heads=2",
         "model.num_query_groups=2", "trainer.max_steps=1", "grpo.global_batch_size=32",
         "eval.every_steps=1", "eval.at_start=false", "eval.data.path=held_out.jsonl", "eval.max_prompts=16",
         "eval.num_samples=4", "eval.temperature=1.0", "eval.max_new_tokens=48",
         f"hydra.run.dir={run_dir}", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    scored = _eval_rewards(run_dir / "eval" / "step_00001.jsonl")
    assert scored and all(r == (0.0 if cut else 1.0) for r, cut in scored), scored
    assert sum(r for r, _ in scored) >= 3  # episodes ended with EOS: the environment paid
    assert last["eval/reward_mean"] == pytest.approx(sum(r for r, _ in scored) / len(scored))
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-eval"), str(run_dir), "--step", "1", "--json"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["metrics"]["eval/reward_mean"] == last["eval/reward_mean"]
    assert _eval_rewards(Path(result["samples"])) == scored
