"""Every shipped recipe runs for real as its shape twin (rlbatch.config.twin: the recipe's
parallel layout and options, a tiny model of the same architecture): NUM_STEPS (2) optimizer
steps through rlbatch-train, with a checkpoint after each step; the last step again, resumed
from the checkpoint before it (trainer.resume=<step dir>) in a new run directory, reproduces
every step exactly (loss, grad norm, reward, every non-timing metric). For
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


def _train(bin_dir, env, cwd, overrides):
    started = time.monotonic()
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *overrides],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
    ref_dir, resumed_dir = tmp_path / "ref", tmp_path / "resumed"
    ref = [*overrides, "trainer.checkpoint.every_steps=1", f"hydra.run.dir={ref_dir}"]
    seconds = _train(bin_dir, subprocess_env, tmp_path, ref)
    print(f"{name} shape twin: {NUM_STEPS} steps in {seconds:.0f} s")
    # the run's last step again, resumed from the checkpoint before it in a new run directory
    # (whose metrics.jsonl starts with the checkpoint's history)
    before_last = ref_dir / "checkpoints" / f"step_{NUM_STEPS - 1:08d}"
    assert (before_last / "model_optim").is_dir()
    resumed = [*overrides, f"trainer.resume={before_last}", f"hydra.run.dir={resumed_dir}"]
    _train(bin_dir, subprocess_env, tmp_path, resumed)
    expected = _metrics(ref_dir)  # with eval.every_steps > 0 also the step-0 evaluation's record
    assert _steps(expected) == list(range(1, NUM_STEPS + 1))
    if cfg.rollout.backend.value == "megatron" and not cfg.env.path:  # the round engine counts
        # its decode slots at every layout (at tp > 1 with sequence parallel too)
        assert all("rollout/slot_occupancy" in r for r in expected if "loss" in r), expected
    assert _metrics(resumed_dir) == expected


def test_resume_at_another_layout(bin_dir, subprocess_env, tmp_path):
    """docs/parallelism.md's resharding resume through the CLI: 2 steps (one generation round,
    grpo.steps_per_generation=2) at tp2 (sequence parallel) x pp2, then step 3 at dp2 from the
    round's last checkpoint; the history carries over. Step 1's checkpoint, half the round still
    to train, is refused at dp2 before launch, naming the layout key and what is in flight."""
    base = ["+recipe=grpo_qwen", "model.num_layers=4", "trainer.checkpoint.every_steps=1",
            "grpo.steps_per_generation=2"]  # fmt: skip
    saved, resumed = tmp_path / "tp2pp2", tmp_path / "dp2"
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    _train(bin_dir, subprocess_env, tmp_path,
           [*base, *layout, "trainer.max_steps=2", f"hydra.run.dir={saved}"])  # fmt: skip
    at_dp2 = [*base, "parallel.dp=2", "trainer.max_steps=3", f"hydra.run.dir={resumed}"]
    mid_round = saved / "checkpoints" / "step_00000001"
    refused = subprocess.run(
        [str(bin_dir / "rlbatch-train"), *at_dp2, f"trainer.resume={mid_round}"],
        capture_output=True, text=True, env=subprocess_env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    message = " ".join(refused.stderr.split())
    for part in ("parallel.tp=1: was 2", "parallel.pp=1: was 2", "parallel.dp=2: was 1",
                 "round being trained (grpo.steps_per_generation > 1)"):  # fmt: skip
        assert part in message, refused.stderr[-3000:]
    assert not (resumed / "metrics.jsonl").exists()
    _train(bin_dir, subprocess_env, tmp_path,
           [*at_dp2, f"trainer.resume={saved / 'checkpoints'}"])  # fmt: skip
    before, after = _metrics(saved), _metrics(resumed)
    assert [r["step"] for r in after] == [1, 2, 3]
    assert after[:2] == before
    assert after[2]["loss"] == after[2]["loss"]  # a finite step at the new layout
