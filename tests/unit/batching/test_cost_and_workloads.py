"""Cost model defaults from model dimensions, and the synthetic workloads."""

from __future__ import annotations

import pytest

from rlbatch.batching import GROUP_SIZE, MAX_LENGTH, CostModel, cost_model_for, make_workload
from rlbatch.config.schema import BatchingPassConfig, ModelConfig, Workload

QWEN_7B = ModelConfig(
    num_layers=28,
    hidden_size=3584,
    ffn_hidden_size=18944,
    num_attention_heads=28,
    num_query_groups=4,
    vocab_size=152064,
)


def test_derived_cost_model_for_qwen_7b() -> None:
    """Independent count: per layer, q/k/v/o projections 3584*(3584+2*512) + 3584^2, SwiGLU
    3*3584*18944; plus logits 3584*152064; 2 FLOPs per multiply-add. Attention: 2*h per token
    pair per layer (causal)."""
    h = 3584
    linear = 2 * (28 * (h * (h + 2 * 512) + h * h + 3 * h * 18944) + h * 152064)
    cm = cost_model_for(QWEN_7B, BatchingPassConfig())
    assert cm.a == 1.0
    assert cm.b == pytest.approx(2 * h * 28 / linear)
    # attention is ~12% of a 8192-token sequence's forward cost for this model
    assert 0.08 < cm.b * 8192 / (1 + cm.b * 8192) < 0.16


def test_config_overrides() -> None:
    cfg = BatchingPassConfig(cost_linear=2.0, cost_quadratic=0.5)
    assert cost_model_for(QWEN_7B, cfg) == CostModel(2.0, 0.5)
    with pytest.raises(ValueError, match="cost_linear"):
        cost_model_for(QWEN_7B, BatchingPassConfig(cost_linear=0.0, cost_quadratic=0.0))


@pytest.mark.parametrize("workload", list(Workload))
def test_workloads_deterministic_bounded_and_grouped(workload: Workload) -> None:
    a = make_workload(workload, 1000, seed=5)
    assert a == make_workload(workload.value, 1000, seed=5)
    assert a != make_workload(workload, 1000, seed=6)
    assert len(a) == 1000 and all(type(x) is int and 1 <= x <= MAX_LENGTH[workload] for x in a)
    g = GROUP_SIZE[workload]
    if workload in (Workload.grpo_math, Workload.long_cot):  # siblings share the prompt
        assert g == 16
    assert make_workload(workload, 0) == []
