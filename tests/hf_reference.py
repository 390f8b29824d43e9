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
