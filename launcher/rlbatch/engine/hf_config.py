"""Hugging Face Qwen2 ``config.json`` <-> ModelConfig, without torch (the CLI may use it to
validate a run against the checkpoint's architecture before launching workers)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlbatch.config.schema import Dtype, ModelConfig

HF_CONFIG = "config.json"


# ------------------------------------------------------------------------------ config
def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / HF_CONFIG
    if not file.is_file():
        raise FileNotFoundError(
            f"model.hf_path={path}: no {HF_CONFIG} (a local HF Qwen2 directory)"
        )
    return json.loads(file.read_text())


def config_from_hf(path: str | Path) -> dict[str, Any]:
    """ModelConfig fields of a local HF Qwen2 / Qwen2.5 directory."""
    hf = read_hf_config(path)
    model_type = hf.get("model_type", "qwen2")
    if model_type != "qwen2":
        raise ValueError(f"model.hf_path={path}: model_type {model_type!r}, expected 'qwen2'")
    heads = hf["num_attention_heads"]
    dtype = {"bfloat16": Dtype.bf16, "float16": Dtype.fp16}.get(
        str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), Dtype.fp32
    )
    return {
        "name": Path(path).name,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 32768),
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "add_qkv_bias": True,
        "params_dtype": dtype,
    }


ARCH_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
)  # fmt: skip


def resolve_model_config(model: ModelConfig) -> tuple[ModelConfig, list[str]]:
    """With ``model.hf_path`` set, a copy whose architecture fields come from its config.json
    (params_dtype, recompute and max_position_embeddings stay the preset's), and the list of
    fields that changed (callers warn: the preset is ignored for those)."""
    if not model.hf_path:
        return model, []
    fields = config_from_hf(model.hf_path)
    changed = [
        f"model.{k}: {getattr(model, k)} -> {fields[k]}"
        for k in ARCH_FIELDS
        if getattr(model, k) != fields[k]
    ]
    return replace(model, **{k: fields[k] for k in ARCH_FIELDS}), changed


def hf_config_dict(model: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """A transformers Qwen2Config dict for ``model``."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.init_method_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "torch_dtype": dtype_name,
    }
