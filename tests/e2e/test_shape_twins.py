"""Every shipped recipe runs for real as its shape twin (rlbatch.config.twin: the recipe's
parallel layout and options, a tiny model of the same architecture): NUM_STEPS (2) optimizer
steps through rlbatch-train; the same run with a checkpoint after each step and one rank
SIGKILLed during its last step, then resumed (trainer.resume=auto), reproduces every step
exactly (loss, grad norm, reward, every non-timing metric). For
grpo_qwen2_5_7b that is tp2 (sequence parallel) x pp2 x vpp2 x dp2 = 8 gloo processes with the
distributed optimizer. A recipe added to recipes/ is picked up automatically."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from rlbatch.config.store import list_recipes
from rlbatch.config.twin import NUM_STEPS, compose_recipe, twin_overrides

pytestmark = pytest.mark.e2e

RECIPES = [r.name for r in list_recipes()]
MATH = [("1+1=", "2"), ("2+3=", "5"), ("4+4=", "8"), ("7-2=", "5"), ("3*3=", "9"), ("6/2=", "3")]


def _is_timing(key):
    return key.endswith(("_s", "_seconds", "seconds", "memory_gb")) or "per_s" in key


def _metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not _is_timing(k)} for line in lines]


def _steps(records):
    """The optimizer steps of the records (a recipe that evaluates adds a step-0 record)."""
    return [r["step"] for r in records if "loss" in r]


def _train(bin_dir, env, cwd, overrides, *, check=True):
    started = time.monotonic()
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *overrides],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=900,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        assert proc.returncode != 0, "the run was expected to be killed"
    return time.monotonic() - started


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_shape_twin_runs_and_resumes_exactly(name, bin_dir, subprocess_env, tmp_path):
    cfg = compose_recipe(name)
    overrides = [f"+recipe={name}", *twin_overrides(cfg)]
    if cfg.data.source.value == "jsonl" and cfg.data.path is None:  # a site's own dataset
        data = tmp_path / "math.jsonl"
        data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in MATH))
        overrides.append(f"data.path={data}")
    if cfg.grpo.distill.reward_coef == 0 and not cfg.grpo.distill.teacher:  # the user's teacher
        from hf_reference import save_tiny_teacher

        twin = compose_recipe(name, twin_overrides(cfg))
        save_tiny_teacher(tmp_path / "teacher", num_layers=twin.model.num_layers)  # shrunk too
        overrides.append(f"grpo.distill.teacher={tmp_path / 'teacher'}")
    ref_dir, killed_dir = tmp_path / "ref", tmp_path / "killed"
    seconds = _train(bin_dir, subprocess_env, tmp_path, [*overrides, f"hydra.run.dir={ref_dir}"])
    print(f"{name} shape twin: {NUM_STEPS} steps in {seconds:.0f} s")
    # the same run, saving after every step, one rank SIGKILLed during the last step (after
    # the one before's checkpoint), resumed
    killed = [*overrides, "trainer.checkpoint.every_steps=1", f"hydra.run.dir={killed_dir}"]
    _train(
        bin_dir,
        subprocess_env,
        tmp_path,
        [*killed, f"debug.fail_at_step={NUM_STEPS}", "debug.fail_kind=kill"],
        check=False,
    )
    trained = len(_steps(_metrics(killed_dir)))
    assert trained < NUM_STEPS, "the run was not killed before its last step"
    assert (killed_dir / "checkpoints" / f"step_{NUM_STEPS - 1:08d}" / "model_optim").is_dir()
    _train(bin_dir, subprocess_env, tmp_path, [*killed, "trainer.resume=auto"])
    expected = _metrics(ref_dir)  # with eval.every_steps > 0 also the step-0 evaluation's record
    assert _steps(expected) == list(range(1, NUM_STEPS + 1))
    assert _metrics(killed_dir) == expected


def test_resume_at_another_layout(bin_dir, subprocess_env, tmp_path):
    """docs/parallelism.md's resharding resume through the CLI: 2 steps at tp2 (sequence
    parallel) x pp2, then step 3 at dp2 from that checkpoint; the history carries over."""
    base = ["+recipe=grpo_qwen", "model.num_layers=4", "trainer.checkpoint.every_steps=1"]
    saved, resumed = tmp_path / "tp2pp2", tmp_path / "dp2"
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    _train(bin_dir, subprocess_env, tmp_path,
           [*base, *layout, "trainer.max_steps=2", f"hydra.run.dir={saved}"])  # fmt: skip
    _train(
        bin_dir,
        subprocess_env,
        tmp_path,
        [*base, "parallel.dp=2", "trainer.max_steps=3", f"hydra.run.dir={resumed}",
         f"trainer.resume={saved / 'checkpoints'}"],
    )  # fmt: skip
    before, after = _metrics(saved), _metrics(resumed)
    assert [r["step"] for r in after] == [1, 2, 3]
    assert after[:2] == before
    assert after[2]["loss"] == after[2]["loss"]  # a finite step at the new layout
