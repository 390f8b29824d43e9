"""The planner's cost model counts a token's active parameters in MoE layers (router + the k
experts it is routed to), not the layer's total; rlbatch-plan shows it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

from rlbatch.batching import linear_flops_per_token
from rlbatch.config.schema import ModelConfig


def _qwen3_30b_a3b(**changes) -> ModelConfig:
    base = ModelConfig(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
        num_query_groups=4, head_dim=128, vocab_size=151936, num_moe_experts=128,
        moe_router_topk=8, moe_ffn_hidden_size=768,
    )  # fmt: skip
    return replace(base, **changes)


def test_moe_layers_count_router_and_k_experts():
    # by hand: q 4096, kv 2 x 512, o 4096 x 2048, router 2048 x 128, 8 SwiGLU experts of 768
    attention = 2048 * (4096 + 1024) + 4096 * 2048
    moe = 2048 * 128 + 8 * 3 * 2048 * 768
    want = 2 * (48 * (attention + moe) + 2048 * 151936)
    assert linear_flops_per_token(_qwen3_30b_a3b()) == want
    # 6.08e9 FLOPs: 3.0B active multiply-adds a token (3.3B active parameters with the
    # embedding), a tenth of the 30.5B total
    assert 5.9e9 < want < 6.2e9


def test_dense_layers_of_an_moe_model_count_their_mlp():
    pattern = [0] + [1] * 47
    got = linear_flops_per_token(_qwen3_30b_a3b(moe_layer_freq=pattern))
    dense, moe = 3 * 2048 * 6144, 2048 * 128 + 8 * 3 * 2048 * 768
    assert got - linear_flops_per_token(_qwen3_30b_a3b()) == 2 * (dense - moe)


def test_a_shared_expert_counts_with_its_gate_in_every_sparse_layer():
    # Qwen2-MoE: every token also passes the shared SwiGLU (width 5632 in Qwen1.5-MoE-A2.7B)
    # and its gate (one output), in each of the 48 sparse layers here
    got = linear_flops_per_token(_qwen3_30b_a3b(moe_shared_expert_intermediate_size=5632))
    shared = 3 * 2048 * 5632 + 2048
    assert got - linear_flops_per_token(_qwen3_30b_a3b()) == 2 * 48 * shared


def test_rlbatch_plan_shows_the_moe_cost(tmp_path, bin_dir, subprocess_env):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 900, 300, 700, 500, 200, 800, 400]))
    proc = subprocess.run(
        [str(bin_dir / "rlbatch-plan"), "model=qwen3_30b_a3b", f"plan.lengths={lengths}",
         "plan.json=true", "parallel.dp=2", "grpo.num_generations=2"],
        capture_output=True, text=True, env=subprocess_env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    cost = json.loads(proc.stdout)["cost_model"]
    assert cost["linear_flops_per_token"] == linear_flops_per_token(_qwen3_30b_a3b())
    assert cost["b"] == cost["attention_flops_per_token_pair"] / cost["linear_flops_per_token"]
