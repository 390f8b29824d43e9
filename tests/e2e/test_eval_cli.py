"""Evaluation end to end through the real commands, sharing a few short runs of the default
recipe (eval every 2 of 4 steps, a step-0 baseline, keep_best by the lowest eval reward so the
best checkpoint is an old one that pruning must spare):

- the run with evaluation trains bit-identically to the same run without it, and a SIGKILLed
  run with evaluation resumes to the same metrics and samples files;
- pass@k, mean@N and maj@N in metrics.jsonl equal a direct computation from the samples file;
- keep_best keeps the best checkpoint beyond keep_last; rlbatch-export --best exports it;
- rlbatch-eval on the run directory (--json; --best at two DP ranks) and on the run's Hugging
  Face export (the table) reproduces the in-training evaluation of the same weights exactly.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter

import pytest

pytestmark = pytest.mark.e2e

STEPS = 4
EVAL = [
    "eval.every_steps=2",
    "eval.max_prompts=8",
    "eval.num_samples=4",
    "eval.pass_k=[1,2,4]",
    "eval.correct_threshold=0.12",  # some right, some wrong already at step 0
]
BEST = [
    "trainer.checkpoint.keep_best=eval/reward_mean",
    "trainer.checkpoint.keep_best_mode=min",
    "trainer.checkpoint.every_steps=0",
    "trainer.checkpoint.keep_last=1",
]
COMMON = [f"trainer.max_steps={STEPS}", "grpo.global_batch_size=32"]


def _run(cmd, cwd, env, check=True):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train(bin_dir, env, cwd, run_dir, *overrides, check=True):
    cmd = [str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={run_dir}"]
    return _run(cmd + COMMON + list(overrides), cwd, env, check)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _timing(key):
    return key.endswith(("_s", "seconds", "memory_gb")) or "per_s" in key


def _training(records):
    """The training keys of the optimizer steps (no eval/*, no timings)."""
    return [
        {k: v for k, v in r.items() if not k.startswith("eval/") and not _timing(k)}
        for r in records
        if r["step"] >= 1
    ]


def _stable(records):
    return [{k: v for k, v in r.items() if not _timing(k)} for r in records]


@pytest.fixture(scope="module")
def work(tmp_path_factory, bin_dir, subprocess_env):
    env = subprocess_env
    root = tmp_path_factory.mktemp("eval")
    on, off, resumed = root / "on", root / "off", root / "resumed"
    _train(bin_dir, env, root, on, *EVAL, *BEST)
    _train(bin_dir, env, root, off)
    killed = _train(
        bin_dir, env, root, resumed, *EVAL, *BEST, "debug.fail_at_step=3",
        "debug.fail_kind=kill", check=False,
    )  # fmt: skip
    assert killed.returncode != 0 and len(_metrics(resumed)) < STEPS + 1
    _train(bin_dir, env, root, resumed, *EVAL, *BEST, "trainer.resume=auto")
    return {"root": root, "env": env, "on": on, "off": off, "resumed": resumed}


def test_eval_does_not_change_training_and_resumes_exactly(work):
    on = _metrics(work["on"])
    assert [r["step"] for r in on] == list(range(STEPS + 1))  # step 0: the baseline
    assert [r["step"] for r in on if "eval/pass@1" in r] == [0, 2, 4]
    assert _training(on) == _training(_metrics(work["off"]))
    assert _stable(_metrics(work["resumed"])) == _stable(on)
    for step in (0, 2, 4):
        name = f"eval/step_{step:05d}.jsonl"
        assert (work["resumed"] / name).read_text() == (work["on"] / name).read_text()


def _pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_metrics_match_the_samples_file(work):
    records = {r["step"]: r for r in _metrics(work["on"])}
    for step in (0, STEPS):
        rows = [
            json.loads(line)
            for line in (work["on"] / f"eval/step_{step:05d}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 8 and all(len(r["samples"]) == 4 for r in rows)
        rec = records[step]
        for row in rows:
            for s in row["samples"]:
                assert s["correct"] == (s["reward"] > 0.12)
        counts = [sum(s["correct"] for s in r["samples"]) for r in rows]
        if step == 0:  # a mix of counts: pass@k, mean@N and maj@N all differ
            assert 0 < sum(counts) < 32 and len(set(counts)) > 1
        for k in (1, 2, 4):
            expected = sum(_pass_at_k(4, c, k) for c in counts) / len(rows)
            assert rec[f"eval/pass@{k}"] == pytest.approx(expected, abs=1e-12)
        assert rec["eval/mean@4"] == pytest.approx(sum(counts) / 32, abs=1e-12)
        rewards = [s["reward"] for r in rows for s in r["samples"]]
        assert rec["eval/reward_mean"] == pytest.approx(sum(rewards) / 32, abs=1e-12)
        maj = 0
        for row in rows:  # digit_copy: the stripped response is the graded answer
            answers = [s["text"].strip() for s in row["samples"]]
            top = max(Counter(answers).values())
            winner = next(a for a in answers if answers.count(a) == top)
            maj += next(s["correct"] for s in row["samples"] if s["text"].strip() == winner)
        assert rec["eval/maj@4"] == pytest.approx(maj / 8, abs=1e-12)


def test_keep_best_survives_pruning_and_exports(work, bin_dir):
    records = [r for r in _metrics(work["on"]) if r["step"] >= 1 and "eval/reward_mean" in r]
    lowest = min(r["eval/reward_mean"] for r in records)
    best = next(r["step"] for r in records if r["eval/reward_mean"] == lowest)
    kept = sorted(p.name for p in (work["on"] / "checkpoints").iterdir())
    assert kept == sorted({f"step_{best:08d}", f"step_{STEPS:08d}"})
    out = work["root"] / "best_hf"
    proc = _run(
        [str(bin_dir / "rlbatch-export"), str(work["on"]), "--best", "--out", str(out)],
        work["root"], work["env"],
    )  # fmt: skip
    assert f"step_{best:08d}" in proc.stderr and (out / "config.json").is_file()


def _eval_keys(record):
    return {k: v for k, v in record.items() if k.startswith("eval/") and not _timing(k)}


def test_rlbatch_eval_reproduces_the_training_evaluation(work, bin_dir):
    last = _eval_keys(_metrics(work["on"])[-1])
    cmd = [str(bin_dir / "rlbatch-eval"), str(work["on"]), "--step", str(STEPS), "--json"]
    proc = _run(cmd, work["root"], work["env"])
    result = json.loads(proc.stdout)  # stdout holds the JSON document alone
    assert result["step"] == STEPS and _eval_keys(result["metrics"]) == last
    samples = (work["on"] / f"eval/step_{STEPS:05d}.jsonl").read_text()
    with open(result["samples"]) as fh:
        assert fh.read() == samples

    # the run's Hugging Face export of the same weights, with the recipe's eval keys: a table
    cmd = [
        str(bin_dir / "rlbatch-eval"), f"model.hf_path={work['on'] / 'hf'}", "+recipe=grpo_qwen",
        *EVAL,  # no model.tokenizer: the export says it was trained with the byte tokenizer
    ]  # fmt: skip
    table = _run(cmd, work["root"], work["env"]).stdout
    assert "pass@4" in table and "maj@4" in table and "samples:" in table
    assert f"{last['eval/pass@2']:.4g}" in table and f"{last['eval/maj@4']:.4g}" in table

    # --best at two DP ranks (prompts sharded, results gathered): the best step's evaluation
    records = [r for r in _metrics(work["on"]) if r["step"] >= 1 and "eval/reward_mean" in r]
    best = min(records, key=lambda r: (r["eval/reward_mean"], r["step"]))
    cmd = [str(bin_dir / "rlbatch-eval"), str(work["on"]), "--best", "parallel.dp=2", "--json"]
    result = json.loads(_run(cmd, work["root"], work["env"]).stdout)
    assert result["step"] == best["step"] and _eval_keys(result["metrics"]) == _eval_keys(best)
    with open(result["samples"]) as fh:
        assert fh.read() == (work["on"] / f"eval/step_{best['step']:05d}.jsonl").read_text()
