"""model.lora.rank larger than a layer it adapts is refused before launch: an adapter's update
B @ A of an (in x out) projection has rank at most min(in, out), so the extra rank only adds
parameters. The error names model.lora.rank, the layers and the largest rank that fits."""

from __future__ import annotations

from rlbatch.config.lora_rules import check_lora
from rlbatch.config.schema import RunConfig


def _errors(rank, targets=None, **model):
    cfg = RunConfig()
    cfg.model.lora.rank = rank
    if targets is not None:
        cfg.model.lora.target_modules = targets
    for key, value in model.items():
        setattr(cfg.model, key, value)
    errors = []
    check_lora(cfg, errors)
    return [str(e) for e in errors]


def test_a_rank_larger_than_an_adapted_layer_is_refused_with_the_rank_that_fits():
    # the tiny model: hidden 64, 4 heads of 16 in 2 groups (k / v: 64 -> 32), ffn 176
    (error,) = _errors(48)
    assert error.startswith("model.lora.rank=48: ")
    assert "k_proj (64 -> 32)" in error and "v_proj (64 -> 32)" in error
    assert "q_proj" not in error and "model.lora.rank<=32" in error
    (error,) = _errors(100)
    assert "down_proj (176 -> 64)" in error and "model.lora.rank<=32" in error


def test_ranks_that_fit_the_adapted_layers_are_accepted():
    assert _errors(32) == []
    assert _errors(64, ["q_proj", "o_proj", "gate_proj"]) == []  # k / v not adapted
    assert _errors(48, num_query_groups=4) == []  # k / v: 64 -> 64
    assert _errors(0) == []


def test_a_qwen2_moe_shared_experts_width_bounds_the_rank_of_its_mlp_adapters():
    """On an MoE model with a shared expert (Qwen2-MoE), the MLP names and all-linear adapt the
    shared expert: its width (8 here), not the dense ffn_hidden_size, bounds the rank."""
    moe = {"num_moe_experts": 4, "moe_shared_expert_intermediate_size": 8}
    (error,) = _errors(32, ["gate_proj", "up_proj", "down_proj"], **moe)
    assert "gate_proj (64 -> 8)" in error and "down_proj (8 -> 64)" in error, error
    assert "model.lora.rank<=8" in error
    (error,) = _errors(16, ["all-linear"], **moe)
    assert "up_proj (64 -> 8)" in error and "q_proj" not in error, error
    assert _errors(8, ["all-linear"], **moe) == []
    assert _errors(32, ["all-linear"], num_moe_experts=4) == []  # no shared expert: attention
