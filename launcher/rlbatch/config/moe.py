"""The Mixture-of-Experts keys of ``model`` (megatron-core's names), a base of ModelConfig.

A model is MoE when ``model.num_moe_experts`` is set: its sparse layers replace the dense MLP
by a router (fp32, softmax over the experts, top-k) and ``num_moe_experts`` SwiGLU experts of
width ``moe_ffn_hidden_size`` (plus, for Qwen2-MoE, a gated shared expert every token passes);
``moe_layer_freq`` says which layers are sparse. docs/engine.md
("MoE models") says how each key maps onto megatron-core and onto Hugging Face's Qwen3-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlbatch.config.enums import Architecture

MOE_ARCHITECTURES = (Architecture.qwen3_moe, Architecture.qwen2_moe)
"""The Hugging Face MoE families an MoE model maps onto (import, export, tensor names)."""


@dataclass
class MoeFields:
    num_moe_experts: Optional[int] = None
    """Routed experts of each MoE layer; null = a dense model (every other moe_* key unused)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF num_experts_per_tok)."""
    moe_ffn_hidden_size: Optional[int] = None
    """SwiGLU width of one routed expert (HF moe_intermediate_size); null = ffn_hidden_size."""
    moe_layer_freq: list[int] = field(default_factory=list)
    """Sparse and dense layers: one entry per layer, 1 = MoE, 0 = a dense MLP of
    ffn_hidden_size (megatron's list form of moe_layer_freq); [] = every layer MoE."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (HF norm_topk_prob; Qwen3-MoE: true);
    false = the softmax over all experts, kept as it is for the chosen k."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss added to the policy loss (0 = none; the metric
    moe/aux_loss is logged either way). Per sample, over its own tokens (padding excluded) and
    averaged over the MoE layers, then averaged like the policy loss (grpo.loss_agg_mode), so
    the step's loss and gradient do not depend on how the planner cuts micro-batches
    (docs/engine.md, "Load-balancing loss"); at any pp / vpp (each stage adds its own
    routers' share), any model.recompute (under full recompute its gradient reaches the
    routers through their recomputed forward) and any tp (under sequence parallelism each
    sample's statistics are summed over the tensor-parallel ranks); not at cp > 1."""
    moe_expert_capacity_factor: Optional[float] = None
    """Tokens an expert takes at most in one forward, as a multiple of its fair share of that
    forward's token-to-expert assignments (megatron's capacity, per micro-batch and rank,
    padding included; the lowest-probability assignments beyond it are dropped). null =
    dropless. Dropped assignments of the training forward are counted: moe/dropped_tokens and
    moe/dropped_fraction."""
    moe_freeze_router: bool = False
    """Keep the router weights fixed during training (no gradient, no optimizer state)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """SwiGLU width of the shared expert that every token of an MoE layer also passes, its
    output scaled by a sigmoid gate of the token (HF shared_expert_intermediate_size and
    shared_expert_gate, Qwen2-MoE); null = no shared expert (Qwen3-MoE)."""


def num_moe_layers(model: MoeFields) -> int:
    """MoE layers of the model (0 for a dense one): ``moe_layer_freq``'s ones, or every layer."""
    if model.num_moe_experts is None:
        return 0
    pattern = list(model.moe_layer_freq)
    return sum(1 for f in pattern if f) if pattern else int(getattr(model, "num_layers", 0))
