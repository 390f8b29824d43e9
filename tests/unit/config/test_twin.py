"""Shape twins (rlbatch.config.twin): every recipe's twin keeps its layout and options, fits
one machine, divides the tiny model, and composes into a valid config."""

from __future__ import annotations

import math

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.store import list_recipes
from rlbatch.config.twin import MAX_DP, MAX_TP, compose_recipe, twin_overrides

RECIPES = [r.name for r in list_recipes()]


@pytest.mark.parametrize("name", RECIPES)
def test_twin_keeps_the_layout_and_shrinks_the_model(name, tmp_path):
    recipe = compose_recipe(name)
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    site = [f"data.path={data}"]
    if recipe.grpo.distill.reward_coef == 0 and not recipe.grpo.distill.teacher:
        site.append(f"grpo.distill.teacher={tmp_path}")  # the user's teacher directory
    twin = compose([f"+recipe={name}", *twin_overrides(recipe), *site], "test")
    p, r = twin.parallel, recipe.parallel
    assert (p.pp, p.vpp, p.sequence_parallel, p.use_distributed_optimizer) == (
        r.pp, r.vpp, r.sequence_parallel, r.use_distributed_optimizer
    )  # fmt: skip
    assert p.tp == min(r.tp, MAX_TP) and p.dp == min(r.dp, MAX_DP) and p.nnodes == 1
    # an MoE recipe's twin is the tiny MoE, its experts split as far as the twin's dp allows
    assert twin.model.name == ("tiny_moe" if recipe.model.num_moe_experts else "tiny_twin")
    assert p.ep == math.gcd(r.ep, p.dp)
    assert twin.model.moe_freeze_router == recipe.model.moe_freeze_router
    assert twin.model.num_layers % (p.pp * p.vpp) == 0
    assert twin.model.num_query_groups % p.tp == 0 and twin.model.vocab_size % p.tp == 0
    assert twin.model.tie_word_embeddings == recipe.model.tie_word_embeddings
    assert twin.batching == recipe.batching
    assert twin.grpo.loss_agg_mode == recipe.grpo.loss_agg_mode
    assert twin.grpo.steps_per_generation == recipe.grpo.steps_per_generation


def test_the_moe_twin_runs_expert_parallel():
    recipe = compose_recipe("grpo_qwen3_moe")
    twin = compose_recipe("grpo_qwen3_moe", twin_overrides(recipe))
    assert (twin.parallel.dp, twin.parallel.ep, twin.model.num_moe_experts) == (2, 2, 4)


def test_the_7b_twin_is_the_8_process_layout():
    twin = compose_recipe("grpo_qwen2_5_7b", twin_overrides(compose_recipe("grpo_qwen2_5_7b")))
    p = twin.parallel
    assert (p.tp, p.pp, p.vpp, p.dp) == (2, 2, 2, 2) and p.sequence_parallel
