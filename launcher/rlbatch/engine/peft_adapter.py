"""A LoRA run's adapters as a Hugging Face PEFT adapter directory (docs/lora.md, "Export and
serving").

    export_peft_adapter(model, cfg.model, out_dir, base="Qwen/Qwen2.5-0.5B")

writes ``adapter_config.json`` (peft_type LORA, r, lora_alpha, lora_dropout, the HF
target_modules, base_model_name_or_path, task_type CAUSAL_LM) and
``adapter_model.safetensors`` (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
[r, in], ``...lora_B.weight`` [out, r], ...), which ``peft.PeftModel.from_pretrained(base,
out_dir)`` loads onto the base Hugging Face model. Only the adapters travel: each pipeline
stage gathers its layers' factors over tp (rlbatch.engine.lora.full_adapters) and the first
tp / dp copy of every stage sends them to global rank 0, which writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from rlbatch.config.lora import LoraConfig
from rlbatch.config.schema import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_config(
    lora: LoraConfig, base: Optional[str], adapted: Optional[Sequence[str]] = None
) -> dict[str, Any]:
    """PEFT's LoraConfig of ``lora`` as written to adapter_config.json: the adapted projections
    by name (all-linear spelled out; ``adapted``: the projections the model holds adapters on,
    which on an MoE model are the attention's, and a Qwen2-MoE's shared expert's), lora_alpha such that PEFT's scale
    lora_alpha / r is rlbatch's alpha / rank, and the base model PEFT should load under it
    (None: unknown)."""
    from rlbatch.engine.lora import lora_scale, targeted

    alpha = lora_scale(lora) * lora.rank
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [p for p in targeted(lora) if adapted is None or p in adapted],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def gather_adapters(model: Any) -> dict[str, torch.Tensor]:
    """{PEFT tensor name: full tensor} of every adapter of the model on global rank 0 ({}
    elsewhere). Every rank calls (collectives over tp and the world)."""
    from rlbatch.engine.hf import _chunks, gather_to_root
    from rlbatch.engine.lora import full_adapters

    return gather_to_root(full_adapters(_chunks(model)))


def export_peft_adapter(
    model: Any,
    model_cfg: ModelConfig,
    path: str | Path,
    base: Optional[str],
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write the PEFT adapter directory of ``model``'s adapters (every rank calls; global rank
    0 writes). ``base``: base_model_name_or_path; ``dtype``: the tensors' (default: their
    own)."""
    from safetensors.torch import save_file

    tensors = gather_adapters(model)
    if not tensors:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype or v.dtype).contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapted = {name.rsplit(".", 3)[-3] for name in tensors}  # ...<projection>.lora_A.weight
    config = peft_adapter_config(model_cfg.lora, base, sorted(adapted))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
