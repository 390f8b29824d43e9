"""Every shipped recipe composes with Hydra and passes validation; the help lists them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.schema import BatchingMode, RunConfig
from rlbatch.config.store import list_recipes

RECIPES = [r.name for r in list_recipes()]
# Site-specific values a recipe's launch line asks the user for.
SITE = {
    "grpo_qwen2_5_7b": [
        "data.path={data}",
        *("parallel.rdzv_endpoint=node0:29500", "parallel.node_rank=0", "parallel.run_id=q7b"),
    ],
    "grpo_qwen3_moe": [
        "data.path={data}",
        *("parallel.rdzv_endpoint=node0:29500", "parallel.node_rank=0", "parallel.run_id=moe"),
    ],
    "distill_qwen": ["grpo.distill.teacher={teacher}"],  # the user's teacher directory
    "distill_qwen3_8b_to_1_7b": ["data.path={data}", "grpo.distill.teacher={teacher}"],
}


@pytest.fixture
def site_overrides(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return lambda name: [o.format(data=data, teacher=tmp_path) for o in SITE.get(name, [])]


def test_ships_the_required_recipes():
    assert {"grpo_qwen", "grpo_qwen2_5_7b"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates(name, site_overrides):
    cfg = compose([f"+recipe={name}", *site_overrides(name)], "test")
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_has_header(name):
    text = next(r for r in list_recipes() if r.name == name).path.read_text()
    header = text.split("defaults:")[0]
    assert header.startswith("# @package _global_")
    for part in ("Hardware:", "Launch:", "Override:", f"rlbatch-train +recipe={name}"):
        assert part in header, f"recipe {name} header lacks {part!r}"


def test_recipe_is_a_delta_over_defaults_and_overrides_apply():
    base = compose([], "test")
    cfg = compose(["+recipe=grpo_qwen", "trainer.max_steps=7", "batching.train.mode=packed"], "t")
    assert cfg.trainer.max_steps == 7
    assert cfg.batching.train.mode == BatchingMode.packed
    assert cfg.grpo.beta != base.grpo.beta  # the recipe's own delta
    assert cfg.batching.infer.mode == BatchingMode.dynamic


def test_big_recipe_uses_real_parallelism(site_overrides):
    name = "grpo_qwen2_5_7b"
    cfg = compose([f"+recipe={name}", *site_overrides(name)], "test")
    p = cfg.parallel
    assert p.tp > 1 and p.pp > 1 and p.vpp > 1 and p.dp > 1
    assert cfg.model.num_layers % (p.pp * p.vpp) == 0
    assert cfg.batching.train.max_tokens >= cfg.data.max_prompt_len + cfg.rollout.max_new_tokens


def test_gpu_distillation_recipe_splits_student_and_teacher_over_its_layout(site_overrides):
    """Qwen3-8B (the public config: 36 layers, 32/8 heads) built on Qwen3-1.7B's run layout:
    the layers split over pp * vpp and the heads over tp, as the teacher check requires."""
    from rlbatch.grpo.teacher import _layout_errors

    name = "distill_qwen3_8b_to_1_7b"
    cfg = compose([f"+recipe={name}", *site_overrides(name)], "test")
    teacher = compose([f"+recipe={name}", *site_overrides(name), "model=qwen3_8b"], "test").model
    p = cfg.parallel
    assert (cfg.model.num_layers, teacher.num_layers) == (28, 36)
    assert p.tp * p.pp * p.dp == p.nproc_per_node == 8 and p.tp > 1 and p.sequence_parallel
    assert _layout_errors(cfg, teacher) == []
    assert cfg.grpo.distill.reward_coef == 0 and cfg.grpo.beta == 0
    assert cfg.rollout.temperature == 1.0  # a served teacher's requirement too


def test_help_lists_recipes_and_groups(bin_dir, subprocess_env):
    out = subprocess.run(
        [str(bin_dir / "rlbatch-train"), "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env,
        check=True,
    ).stdout
    for name in RECIPES:
        assert name in out
    for group in (
        "model",
        "data",
        "rollout",
        "batching",
        "normalization",
        "parallel",
        "grpo",
        "trainer",
        "logging",
        "debug",
    ):
        assert f"  {group} " in out


def test_cli_import_stays_light():
    """Importing the CLI must not import torch or megatron (fast --help)."""
    code = (
        "import sys, rlbatch.cli.train, rlbatch.cli.plan, rlbatch.cli.bench, rlbatch.cli.logprobs,"
        " rlbatch.cli.export;"
        "bad=[m for m in ('torch','megatron') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
