"""Checks of ``model.lora`` before launch (torch-free): each with its key, value and fix."""

from __future__ import annotations

import math

from rlbatch.config.errors import ConfigError
from rlbatch.config.lora import ALL_LINEAR, PROJECTIONS
from rlbatch.config.schema import RunConfig

DROPOUT_CHANGES_OBJECTIVE = (
    "adapter dropout is on in the training forward but off when the behaviour and old"
    " log-probs are computed, so the first on-policy importance ratio is not 1, clipping acts on"
    " dropout noise and the gradient is that of a different policy; set model.lora.dropout=0"
    " (the usual setting for RL: verl and NeMo-RL train LoRA without dropout)"
)


MOE_MODULES = frozenset(
    {"gate", "router", "experts", "gate_up_proj", "shared_expert", "shared_experts",
     "shared_expert_gate"}
)  # fmt: skip
"""Hugging Face (and megatron) names of MoE routers and experts, refused with their reason."""


def check_lora(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Every error of ``model.lora`` (its values are checked even with rank 0, so a typo in a
    recipe that turns adapters off later is still caught)."""
    lora = cfg.model.lora
    if lora.rank < 0:
        errors.append(
            ConfigError(
                "model.lora.rank", lora.rank, "must be >= 0 (0 = no adapters; 16-64 for RL)"
            )
        )
    if lora.alpha is not None and not (math.isfinite(lora.alpha) and lora.alpha > 0):
        errors.append(
            ConfigError(
                "model.lora.alpha",
                lora.alpha,
                "must be a finite number > 0, or null (= model.lora.rank, scale 1)",
            )
        )
    if not (math.isfinite(lora.dropout) and 0 <= lora.dropout < 1):
        errors.append(ConfigError("model.lora.dropout", lora.dropout, "must be in [0, 1)"))
    elif lora.rank > 0 and lora.dropout > 0:
        errors.append(ConfigError("model.lora.dropout", lora.dropout, DROPOUT_CHANGES_OBJECTIVE))
    unknown = [m for m in lora.target_modules if m not in PROJECTIONS and m != ALL_LINEAR]
    moe = [m for m in unknown if m in MOE_MODULES]
    if moe:
        errors.append(
            ConfigError(
                "model.lora.target_modules",
                list(lora.target_modules),
                f"names {moe}: LoRA does not adapt MoE routers or routed experts (the router"
                " picks a token's experts, so an adapter there changes the routing, and vLLM /"
                " PEFT serve no such adapter from rlbatch); on an MoE model the adapters go on"
                f" the attention, [q_proj,k_proj,v_proj,o_proj] or [{ALL_LINEAR}], and a"
                " Qwen2-MoE's shared expert is adapted through its projections' names"
                " (gate_proj, up_proj, down_proj, or all-linear); to train the experts set"
                " model.lora.rank=0",
            )
        )
    elif unknown:
        errors.append(
            ConfigError(
                "model.lora.target_modules",
                list(lora.target_modules),
                f"unknown module(s) {unknown}: use Hugging Face projection names"
                f" ({', '.join(PROJECTIONS)}) or {ALL_LINEAR}",
            )
        )
    elif lora.rank > 0 and not lora.target_modules:
        errors.append(
            ConfigError(
                "model.lora.target_modules",
                [],
                f"is empty while model.lora.rank={lora.rank}: name the projections to adapt"
                f" (e.g. [{ALL_LINEAR}]), or set model.lora.rank=0",
            )
        )
    if lora.rank > 0 and not unknown:
        _check_rank_fits(cfg, errors)


def _shared_expert_width(cfg: RunConfig) -> int:
    """The width the MLP names (and all-linear) adapt on an MoE model with a shared expert
    (Qwen2-MoE); 0 on a dense model or an MoE model without one."""
    m = cfg.model
    return (m.moe_shared_expert_intermediate_size or 0) if m.num_moe_experts is not None else 0


def projection_shapes(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """(input, output) features of every projection LoRA can adapt, from model.* (empty when
    the head count is not positive: the positivity checks report that)."""
    m = cfg.model
    if m.num_attention_heads <= 0:
        return {}
    hidden, ffn = m.hidden_size, _shared_expert_width(cfg) or m.ffn_hidden_size
    head = m.head_dim or hidden // m.num_attention_heads
    return {
        "q_proj": (hidden, m.num_attention_heads * head),
        "k_proj": (hidden, m.num_query_groups * head),
        "v_proj": (hidden, m.num_query_groups * head),
        "o_proj": (m.num_attention_heads * head, hidden),
        "gate_proj": (hidden, ffn),
        "up_proj": (hidden, ffn),
        "down_proj": (ffn, hidden),
    }


def _check_rank_fits(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """A rank-r update B @ A of an (in x out) layer has rank at most min(in, out): a larger
    model.lora.rank only adds parameters that cannot change the policy."""
    lora, shapes = cfg.model.lora, projection_shapes(cfg)
    if not shapes:
        return
    moe_attention_only = cfg.model.num_moe_experts is not None and not _shared_expert_width(cfg)
    every = PROJECTIONS[:4] if moe_attention_only else PROJECTIONS
    targets = every if ALL_LINEAR in lora.target_modules else lora.target_modules
    too_small = {t: shapes[t] for t in targets if lora.rank > min(shapes[t])}
    if too_small:
        limit = min(min(shape) for shape in too_small.values())
        layers = ", ".join(f"{t} ({i} -> {o})" for t, (i, o) in too_small.items())
        errors.append(
            ConfigError(
                "model.lora.rank",
                lora.rank,
                f"is larger than the layers it adapts: {layers}; an adapter's update has rank"
                f" at most min(input, output) features: set model.lora.rank<={limit}, or leave"
                " those projections out of model.lora.target_modules",
            )
        )
