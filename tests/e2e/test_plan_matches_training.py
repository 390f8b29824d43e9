"""rlbatch-plan previews what training runs: for the default recipe, the plan rlbatch-plan
prints for the first mini-batch's lengths equals the plan rlbatch-train used (and wrote with
logging.plans=true) for step 1, in every batching mode."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.e2e

MODES = ("fixed", "dynamic", "packed", "pool")


def _run(cmd, env, cwd):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _without_timing(doc):
    doc = dict(doc, stats=dict(doc["stats"]))
    doc["stats"].pop("planner_seconds")
    doc.pop("cost_model", None)  # what rlbatch-plan adds: the cost model it balanced
    return doc


def test_plan_preview_equals_the_plan_of_step_one(bin_dir, subprocess_env, tmp_path):
    sweep = tmp_path / "sweep"
    _run(
        [str(bin_dir / "rlbatch-train"), "-m", "+recipe=grpo_qwen", "trainer.max_steps=1",
         "logging.plans=true", "logging.plot=false", "logging.tensorboard=false",
         "trainer.checkpoint.export_hf=false", f"hydra.sweep.dir={sweep}",
         f"batching.train.mode={','.join(MODES)}"],
        subprocess_env, tmp_path,
    )  # fmt: skip
    for job, mode in enumerate(MODES):
        logged = json.loads((sweep / str(job) / "plans" / "step_00001.json").read_text())
        assert logged["step"] == 1 and logged["plan"]["mode"] == mode
        lengths = tmp_path / f"lengths_{mode}.json"
        lengths.write_text(json.dumps(logged["lengths"]))
        out = _run(
            [str(bin_dir / "rlbatch-plan"), "+recipe=grpo_qwen", f"plan.lengths={lengths}",
             "plan.json=true", f"batching.train.mode={mode}"],
            subprocess_env, tmp_path,
        )  # fmt: skip
        assert _without_timing(json.loads(out)) == _without_timing(logged["plan"]), mode
