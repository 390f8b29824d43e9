"""The transformers side of rlbatch's HF parity tests: a tiny random Qwen2 saved as a local HF
directory (no download), and its per-token logprobs in float64 as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_tiny_qwen2(path: Path, num_layers: int, seed: int = 0) -> Any:
    """A random Qwen2ForCausalLM over the byte tokenizer's vocabulary, saved to ``path``."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    model.save_pretrained(path)
    return model


def reference_logps(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[j+1] | ids[:j+1]) for j in 0..n-2, in float64."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


ROPE_THETA = 50000.0
VARIANTS = {
    # name: (transformers config class, extra config fields)
    "qwen2_theta": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2_linear": ("Qwen2Config", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2_yarn": (
        "Qwen2Config",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32}},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "llama3": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
         "rms_norm_eps": 1e-5},
    ),
}  # fmt: skip
"""Tiny random checkpoints, one per supported forward-changing option (RoPE base 50000
everywhere, so a base read as the 10000 default shows)."""


def save_tiny(path: Path, variant: str, num_layers: int = 2, legacy: bool = False) -> Any:
    """A random model of ``variant`` over the byte tokenizer's vocabulary, saved to ``path``
    by transformers (5.x layout: rope_parameters), norms and biases perturbed. ``legacy``
    rewrites config.json to the transformers 4 layout (top-level rope_theta, rope_scaling)."""
    import json

    import torch
    import transformers

    cls_name, extra = VARIANTS[variant]
    extra = dict(extra)
    rope = {"rope_type": "default", **extra.pop("rope_parameters", {}), "rope_theta": ROPE_THETA}
    config = getattr(transformers, cls_name)(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters=rope, attn_implementation="eager", **extra,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if legacy:
        file = Path(path) / "config.json"
        data = json.loads(file.read_text())
        params = data.pop("rope_parameters")
        data["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type") != "default":
            data["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        file.write_text(json.dumps(data))
    return model
