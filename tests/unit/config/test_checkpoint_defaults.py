"""Every recipe, and the defaults, checkpoint periodically: a crash loses bounded work."""

from __future__ import annotations

import pytest

from rlbatch.cli.common import compose
from rlbatch.config.store import list_recipes

# Site-specific values a recipe's launch line asks the user for.
SITE = {
    "grpo_qwen2_5_7b": ["data.path={data}", "parallel.rdzv_endpoint=node0:29500"]
    + ["parallel.node_rank=0", "parallel.run_id=q7b"],
    "grpo_qwen3_moe": ["data.path={data}", "parallel.rdzv_endpoint=node0:29500"]
    + ["parallel.node_rank=0", "parallel.run_id=moe"],
    "distill_qwen": ["grpo.distill.teacher={teacher}"],  # the user's teacher directory
    "distill_qwen3_8b_to_1_7b": ["data.path={data}", "grpo.distill.teacher={teacher}"],
}


@pytest.mark.parametrize("name", [None] + [r.name for r in list_recipes()])
def test_periodic_checkpoints_by_default(name, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    site = [o.format(data=data, teacher=tmp_path) for o in SITE.get(name or "", [])]
    overrides = [] if name is None else [f"+recipe={name}", *site]
    ckpt = compose(overrides, "test").trainer.checkpoint
    assert 0 < ckpt.every_steps <= 50 and 0 < ckpt.every_minutes <= 30
    assert ckpt.keep_last >= 1
