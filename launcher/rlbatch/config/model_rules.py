"""The model's own rules: its shape, how it splits over the layout, where its files are."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import Architecture, RunConfig


def check_model_shape(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Heads, groups and widths that fit together, and biases the export can write."""
    m = cfg.model
    if m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups:
        errors.append(
            ConfigError(
                "model.num_query_groups",
                m.num_query_groups,
                f"must divide model.num_attention_heads = {m.num_attention_heads}",
            )
        )
    if m.head_dim is None and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        errors.append(
            ConfigError(
                "model.hidden_size",
                m.hidden_size,
                f"must be divisible by model.num_attention_heads = {m.num_attention_heads}",
            )
        )
    arch = Architecture(m.architecture)
    if m.add_qkv_bias and arch not in (Architecture.qwen2, Architecture.qwen2_moe):
        errors.append(
            ConfigError(
                "model.add_qkv_bias",
                m.add_qkv_bias,
                f"model.architecture={arch.value} has no q/k/v biases in its Hugging Face form "
                "(its attention_bias would add an o_proj bias as well), so an export would "
                "drop the trained biases: set model.add_qkv_bias=false",
            )
        )
    qk_norm = arch in (Architecture.qwen3, Architecture.qwen3_moe)
    if m.qk_layernorm != qk_norm:
        errors.append(
            ConfigError(
                "model.qk_layernorm",
                m.qk_layernorm,
                f"model.architecture={arch.value} "
                + ("always has" if qk_norm else "has no")
                + " query/key RMSNorm in its Hugging Face form, so an export (and vLLM's copy) "
                "would compute another model than the one trained: set "
                f"model.qk_layernorm={str(qk_norm).lower()}",
            )
        )
    if m.logits_chunk_tokens < 0:
        errors.append(
            ConfigError(
                "model.logits_chunk_tokens",
                m.logits_chunk_tokens,
                "must be >= 0 (positions projected at a time; 0 = the whole micro-batch)",
            )
        )


def check_model_split(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The model splits over the pipeline (layers) and tensor (heads) groups."""
    p, m = cfg.parallel, cfg.model
    stages = p.pp * p.vpp
    if m.num_layers > 0 and stages > 0 and m.num_layers % stages:
        errors.append(
            ConfigError(
                "model.num_layers",
                m.num_layers,
                f"must be divisible by parallel.pp * parallel.vpp = {stages}",
            )
        )
    if p.tp > 1 and (m.num_query_groups % p.tp or m.num_attention_heads % p.tp):
        errors.append(
            ConfigError(
                "parallel.tp",
                p.tp,
                f"must divide model.num_query_groups = {m.num_query_groups} and "
                f"model.num_attention_heads = {m.num_attention_heads}",
            )
        )
    widths: list[tuple[str, Optional[int]]] = [("model.ffn_hidden_size", m.ffn_hidden_size)]
    if m.num_moe_experts is not None:  # the experts split over tp too (expert tp = tp)
        widths += [
            ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size),
            ("model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size),
        ]
    for key, width in widths:
        if p.tp > 1 and width and width > 0 and width % p.tp:
            errors.append(
                ConfigError(
                    key,
                    width,
                    f"must be divisible by parallel.tp = {p.tp} (its columns are split over the"
                    " tensor-parallel ranks): choose a multiple of parallel.tp, or a parallel.tp"
                    " that divides it",
                )
            )


def check_model_paths(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """model.hf_path / model.tokenizer_path name local directories (or a hub id)."""
    from rlbatch.config.hub_id import looks_like_hub_id

    for key, path in (
        ("model.hf_path", cfg.model.hf_path),
        ("model.tokenizer_path", cfg.model.tokenizer_path),
    ):
        if key == "model.hf_path" and path is not None and looks_like_hub_id(path):
            continue  # a hub id: resolved (or reported) by the CLI before these rules
        if path is not None and not Path(path).is_dir():
            errors.append(ConfigError(key, path, "no such directory (a local HF model dir)"))
