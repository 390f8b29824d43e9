"""The DP cost model: cost(L) = a*L + b*L^2 per sequence row of L computed tokens.

``a`` stands for the per-token work that grows linearly with length (QKV/output projections,
the SwiGLU MLP, or for an MoE layer the router and the k experts a token uses, the logits); ``b`` for causal attention, quadratic in length. Derived defaults
are normalised so that a = 1: a cost is then measured in "linear token equivalents", and b is the
attention share of one extra token pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.config.schema import BatchingPassConfig, ModelConfig


@dataclass(frozen=True)
class CostModel:
    """cost(L) = a*L + b*L^2 for one sequence row of L (rounded) tokens."""

    a: float = 1.0
    b: float = 0.0

    def __call__(self, length: int) -> float:
        return self.a * length + self.b * length * length

    def padded(self, rows: int, padded_len: int) -> float:
        """Cost of a padded (BSHD) micro-batch: every row computes padded_len tokens."""
        return rows * (self.a * padded_len + self.b * padded_len * padded_len)


TOKEN_COUNT = CostModel(1.0, 0.0)
"""The cost model that balances computed tokens only."""


def linear_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token that do not depend on sequence length (2 per multiply-add)."""
    h = model.hidden_size
    head_dim = model.head_dim or h // model.num_attention_heads
    q = model.num_attention_heads * head_dim  # h unless head_dim is set (Qwen3)
    kv = model.num_query_groups * head_dim
    qkv = h * (q + 2 * kv)
    out = q * h
    logits = h * model.vocab_size
    return 2.0 * (model.num_layers * (qkv + out) + mlp_multiply_adds(model) + logits)


def mlp_multiply_adds(model: ModelConfig) -> float:
    """Multiply-adds of every layer's MLP for one token: SwiGLU (gate, up, down) of
    ffn_hidden_size in a dense layer; in an MoE layer (``model.num_moe_experts``, the layers
    ``model.moe_layer_freq`` marks) the router plus the k experts the token is routed to, and
    the shared expert with its gate where there is one: its active parameters, not the layer's
    total."""
    h = model.hidden_size
    dense = 3 * h * model.ffn_hidden_size
    if not model.num_moe_experts:
        return float(model.num_layers * dense)
    expert = 3 * h * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
    sparse = h * model.num_moe_experts + model.moe_router_topk * expert
    if model.moe_shared_expert_intermediate_size:
        sparse += 3 * h * model.moe_shared_expert_intermediate_size + h
    pattern = list(model.moe_layer_freq) or [1] * model.num_layers
    return float(sum(sparse if is_moe else dense for is_moe in pattern))


def attention_flops_per_token_pair(model: ModelConfig) -> float:
    """Forward FLOPs per (query, key) pair: QK^T and AV, 2*h each; causal masking halves the
    pairs, so b*L^2 with b = 2*h per layer counts the L^2/2 pairs a causal kernel computes."""
    head_dim = model.head_dim or model.hidden_size // model.num_attention_heads
    return 2.0 * model.num_attention_heads * head_dim * model.num_layers


def cost_model_for(model: ModelConfig, cfg: BatchingPassConfig) -> CostModel:
    """The cost model of one pass: derived from the model's dimensions, normalised to a = 1;
    ``cfg.cost_linear`` / ``cfg.cost_quadratic`` override a and b (each independently)."""
    lin = linear_flops_per_token(model)
    quad = attention_flops_per_token_pair(model)
    a = 1.0 if cfg.cost_linear is None else float(cfg.cost_linear)
    b = quad / lin if cfg.cost_quadratic is None else float(cfg.cost_quadratic)
    if a < 0 or b < 0 or (a == 0 and b == 0):
        raise ValueError(
            f"batching cost model a={a}, b={b} must be non-negative and not both zero: "
            "fix batching.<pass>.cost_linear / cost_quadratic"
        )
    return CostModel(a, b)
