"""Hugging Face ``config.json`` <-> ModelConfig, without torch (the CLI validates a run against
the checkpoint's architecture before launching workers).

Reads the layouts of transformers 4 (top-level ``rope_theta``, ``rope_scaling``) and 5
(``rope_parameters``) for the dense Qwen2 / Qwen2.5, Qwen3 and Llama (2, 3, 3.1, 3.2)
architectures. Every field that changes the forward either maps exactly onto a ModelConfig
field or is a :class:`ConfigErrors` naming the field and its value: nothing is ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.errors import ConfigError, ConfigErrors
from rlbatch.config.moe import MOE_ARCHITECTURES
from rlbatch.config.schema import Architecture, Dtype, ModelConfig, RopeScaling

HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

_CLASSES = {
    Architecture.qwen2: "Qwen2ForCausalLM",
    Architecture.qwen3: "Qwen3ForCausalLM",
    Architecture.llama: "LlamaForCausalLM",
    Architecture.qwen3_moe: "Qwen3MoeForCausalLM",
    Architecture.qwen2_moe: "Qwen2MoeForCausalLM",
}
_ROPE_TYPES = {
    "default": RopeScaling.none,
    "linear": RopeScaling.linear,
    "llama3": RopeScaling.llama3,
    "yarn": RopeScaling.yarn,
}
_DEFAULT_THETA = 10000.0
_COMMON_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_ROPE_KEYS = {
    RopeScaling.none: set(),
    RopeScaling.linear: {"factor"},
    RopeScaling.llama3: {
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
    },
    RopeScaling.yarn: {
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attention_factor", "truncate",
    },
}  # fmt: skip
"""The rope_parameters fields each type may carry (any other is an error)."""


# ------------------------------------------------------------------------------ config
def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / HF_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"model.hf_path={path}: no {HF_CONFIG} (a Hugging Face model)")
    return json.loads(file.read_text())


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of either layout as one dict (rope_theta, rope_type, factor, ...):
    transformers 5 ``rope_parameters`` over transformers 4 ``rope_scaling`` + ``rope_theta``."""
    params: dict[str, Any] = {"rope_theta": hf.get("rope_theta", _DEFAULT_THETA)}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(key), dict):
            params.update({k: v for k, v in hf[key].items() if v is not None})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


def _rope_fields(hf: dict[str, Any], errors: list[ConfigError]) -> dict[str, Any]:
    params = rope_parameters(hf)
    kind = str(params["rope_type"])
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    if kind not in _ROPE_TYPES:
        errors.append(ConfigError("rope_parameters.rope_type", kind, _unsupported_rope(kind)))
        return out
    scaling = _ROPE_TYPES[kind]
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        errors.append(
            ConfigError(
                "partial_rotary_factor",
                params["partial_rotary_factor"],
                "rotary on part of the head is not supported (supported: 1.0)",
            )
        )
    for key in sorted(set(params) - _COMMON_ROPE_KEYS - _ROPE_KEYS[scaling]):
        errors.append(
            ConfigError(
                f"rope_parameters.{key}", params[key], f"not supported with rope_type={kind}"
            )
        )
    out["rope_scaling"] = scaling
    if scaling == RopeScaling.none:
        return out
    out["rope_scaling_factor"] = float(params.get("factor", 1.0))
    original = params.get("original_max_position_embeddings")
    if scaling in (RopeScaling.llama3, RopeScaling.yarn):
        original = original or hf.get("max_position_embeddings", 32768)
        out["rope_original_max_position_embeddings"] = int(original)
    if scaling == RopeScaling.llama3:
        out["rope_low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
    if scaling == RopeScaling.yarn:
        _check_yarn(params, errors)
        out["rope_beta_fast"] = float(params.get("beta_fast") or 32.0)
        out["rope_beta_slow"] = float(params.get("beta_slow") or 1.0)
    return out


def _unsupported_rope(kind: str) -> str:
    return (
        f"RoPE type {kind!r} is not supported by rlbatch's megatron-core model "
        "(supported: default, linear, llama3, yarn)"
    )


def yarn_attention_factor(factor: float) -> float:
    """transformers' and megatron's default YaRN cos/sin scale: 0.1 ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _check_yarn(params: dict[str, Any], errors: list[ConfigError]) -> None:
    if params.get("factor") is None:
        errors.append(ConfigError("rope_parameters.factor", None, "yarn needs a factor"))
        return
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key) not in (None, 0, 1):
            errors.append(
                ConfigError(f"rope_parameters.{key}", params[key], "yarn mscale is not supported")
            )
    given = params.get("attention_factor")
    if given is not None and not math.isclose(
        float(given), yarn_attention_factor(float(params["factor"])), rel_tol=1e-9
    ):
        errors.append(
            ConfigError(
                "rope_parameters.attention_factor",
                given,
                "only the default 0.1*ln(factor)+1 is supported",
            )
        )
    if params.get("truncate", True) is not True:
        errors.append(
            ConfigError("rope_parameters.truncate", params["truncate"], "supported: true")
        )


def _arch_checks(hf: dict[str, Any], arch: Architecture, errors: list[ConfigError]) -> None:
    """Forward-changing options outside the mapped set: an error each when set."""
    if hf.get("hidden_act", "silu") != "silu":
        errors.append(ConfigError("hidden_act", hf["hidden_act"], "supported: silu (SwiGLU)"))
    if arch != Architecture.qwen2 and hf.get("attention_bias"):
        errors.append(
            ConfigError(
                "attention_bias",
                True,
                "a bias on q/k/v and o_proj is not supported for this architecture",
            )
        )
    if hf.get("mlp_bias"):
        errors.append(ConfigError("mlp_bias", True, "MLP biases are not supported"))
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        errors.append(ConfigError("attention_dropout", hf["attention_dropout"], "supported: 0.0"))
    if hf.get("quantization_config"):
        errors.append(
            ConfigError("quantization_config", "set", "quantized checkpoints are not supported")
        )
    window = hf.get("sliding_window")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    uses_window = hf.get("use_sliding_window", arch == Architecture.llama and window)
    if sliding or (uses_window and window and window < hf.get("max_position_embeddings", 0)):
        errors.append(
            ConfigError(
                "sliding_window",
                window,
                "sliding-window attention is not supported (use_sliding_window must be false, "
                "or the window cover max_position_embeddings)",
            )
        )


_MOE_REFUSED = {
    "first_k_dense_replace": "DeepSeek-style leading dense layers are not supported",
    "n_shared_experts": "shared experts are not supported",
    "moe_router_topk_scaling_factor": "a routed-weight scaling factor is not supported",
    "routed_scaling_factor": "a routed-weight scaling factor is not supported",
    "n_group": "group-limited routing is not supported",
    "topk_group": "group-limited routing is not supported",
}
"""MoE fields of other families whose presence changes the forward: an error each when set."""


def _moe_fields(
    hf: dict[str, Any], arch: Architecture, errors: list[ConfigError]
) -> dict[str, Any]:
    """Qwen3-MoE's and Qwen2-MoE's routing fields as ModelConfig's megatron-named keys. A layer
    is sparse when it is not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0
    (transformers' rule); config.json names the expert count ``num_experts`` (transformers 4)
    or ``num_local_experts`` (transformers 5). Qwen2-MoE adds the gated shared expert
    (``shared_expert_intermediate_size``); on Qwen3-MoE that field is another family's."""
    shared = hf.get("shared_expert_intermediate_size")
    if shared and arch != Architecture.qwen2_moe:
        errors.append(
            ConfigError(
                "shared_expert_intermediate_size",
                shared,
                f"shared experts are mapped for model_type qwen2_moe only, not {arch.value}",
            )
        )
    for key, why in _MOE_REFUSED.items():
        if hf.get(key):
            errors.append(ConfigError(key, hf[key], why))
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts:
        errors.append(ConfigError("num_experts", experts, f"a {arch.value} model needs experts"))
        return {}
    layers = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return {
        "num_moe_experts": int(experts),
        "moe_router_topk": int(hf.get("num_experts_per_tok", 2)),
        "moe_ffn_hidden_size": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        "moe_layer_freq": [] if all(pattern) else pattern,
        "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_shared_expert_intermediate_size": int(shared) if shared else None,
    }


def config_from_hf(path: str | Path) -> dict[str, Any]:
    """ModelConfig fields of a local HF Qwen2 / Qwen2.5 / Qwen3 / Llama directory. Raises
    ConfigErrors listing every unsupported field."""
    hf = read_hf_config(path)
    model_type = hf.get("model_type", "qwen2")
    try:
        arch = Architecture(model_type)
    except ValueError:
        raise ConfigErrors(
            [
                ConfigError(
                    "model_type",
                    model_type,
                    f"{path}: supported architectures: {', '.join(a.value for a in Architecture)}",
                )
            ]
        ) from None
    errors: list[ConfigError] = []
    heads = hf["num_attention_heads"]
    _arch_checks(hf, arch, errors)
    fields = _rope_fields(hf, errors)
    if arch in MOE_ARCHITECTURES:
        fields.update(_moe_fields(hf, arch, errors))
    if errors:
        raise ConfigErrors(errors)
    dtype = {"bfloat16": Dtype.bf16, "float16": Dtype.fp16}.get(
        str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), Dtype.fp32
    )
    return {
        **fields,
        "name": Path(path).name,
        "architecture": arch,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim"),
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 32768),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "add_qkv_bias": arch == Architecture.qwen2
        or (arch == Architecture.qwen2_moe and bool(hf.get("qkv_bias", True))),
        "qk_layernorm": arch in (Architecture.qwen3, Architecture.qwen3_moe),
        "params_dtype": dtype,
    }


ARCH_FIELDS = (
    "architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "head_dim", "vocab_size", "rope_theta", "rms_norm_eps",
    "tie_word_embeddings", "add_qkv_bias", "qk_layernorm", "rope_scaling", "rope_scaling_factor",
    "rope_original_max_position_embeddings", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_beta_fast", "rope_beta_slow", "max_position_embeddings", "num_moe_experts",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_norm_topk_prob",
    "moe_shared_expert_intermediate_size",
)  # fmt: skip


def resolve_model_config(model: ModelConfig) -> tuple[ModelConfig, list[str]]:
    """With ``model.hf_path`` set, a copy whose architecture fields come from its config.json
    (max_position_embeddings included: the checkpoint's own context; params_dtype and recompute
    stay the preset's), and the list of
    fields that changed (callers warn: the preset is ignored for those)."""
    if not model.hf_path:
        return model, []
    from rlbatch.engine.hub import resolve_hf_path

    path = resolve_hf_path(model.hf_path)
    defaults = ModelConfig()
    fields = config_from_hf(path)
    new = {k: fields.get(k, getattr(defaults, k)) for k in ARCH_FIELDS}
    changed = [
        f"model.{k}: {getattr(model, k)} -> {new[k]}"
        for k in ARCH_FIELDS
        if getattr(model, k) != new[k]
    ]
    return replace(model, **new, hf_path=str(path)), changed


def head_dim_of(model: ModelConfig) -> int:
    return model.head_dim or model.hidden_size // model.num_attention_heads


def _rope_dict(model: ModelConfig) -> dict[str, Any] | None:
    """transformers-4 ``rope_scaling`` (transformers 5 reads it too)."""
    scaling = RopeScaling(model.rope_scaling)
    if scaling == RopeScaling.none:
        return None
    out: dict[str, Any] = {"rope_type": scaling.value, "factor": model.rope_scaling_factor}
    if scaling in (RopeScaling.llama3, RopeScaling.yarn):
        out["original_max_position_embeddings"] = (
            model.rope_original_max_position_embeddings or model.max_position_embeddings
        )
    if scaling == RopeScaling.llama3:
        out.update(
            low_freq_factor=model.rope_low_freq_factor,
            high_freq_factor=model.rope_high_freq_factor,
        )
    if scaling == RopeScaling.yarn:
        out.update(beta_fast=model.rope_beta_fast, beta_slow=model.rope_beta_slow)
    return out


def special_ids(eos_ids: Sequence[int], bos_id: Optional[int]) -> dict[str, Any]:
    """A config's eos_token_id (one id, or the list when there are several, as transformers
    writes it) and bos_token_id: without them transformers falls back to the architecture's
    defaults (LlamaConfig: EOS 2, BOS 1), which a reader such as vLLM then stops at."""
    eos: Any = int(eos_ids[0]) if len(eos_ids) == 1 else [int(i) for i in eos_ids]
    return {"eos_token_id": eos, "bos_token_id": bos_id}


def hf_config_dict(model: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """A transformers config dict (Qwen2 / Qwen3 / Llama) for ``model``."""
    arch = Architecture(model.architecture)
    out: dict[str, Any] = {
        "architectures": [_CLASSES[arch]],
        "model_type": arch.value,
        "hidden_act": "silu",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": head_dim_of(model),
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_theta": model.rope_theta,
        "rope_scaling": _rope_dict(model),
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.init_method_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype_name,
    }
    if arch in (Architecture.qwen2, Architecture.qwen2_moe) and model.head_dim is None:
        del out["head_dim"]  # Qwen2Config and Qwen2MoeConfig have no head_dim
    if arch in (Architecture.qwen2, Architecture.qwen3, *MOE_ARCHITECTURES):
        out["use_sliding_window"] = False
    else:
        out.update(attention_bias=False, mlp_bias=False)
    if arch in (Architecture.qwen3, Architecture.qwen3_moe):
        out["attention_bias"] = False
    if arch in MOE_ARCHITECTURES:
        out.update(_moe_dict(model))
    if arch == Architecture.qwen2_moe:
        out["qkv_bias"] = model.add_qkv_bias
        out["shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size or 0
    return out


def _moe_dict(model: ModelConfig) -> dict[str, Any]:
    """Qwen3MoeConfig's / Qwen2MoeConfig's routing fields (the expert count under both of
    transformers' names)."""
    layers = list(model.moe_layer_freq) or [1] * model.num_layers
    return {
        "num_experts": model.num_moe_experts,
        "num_local_experts": model.num_moe_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.moe_ffn_hidden_size or model.ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, sparse in enumerate(layers) if not sparse],
        "norm_topk_prob": model.moe_norm_topk_prob,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "output_router_logits": False,
    }
