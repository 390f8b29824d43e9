"""Config section ``model.lora``: low-rank adapters on the policy's linear layers
(docs/lora.md).

With ``rank > 0`` every targeted projection gets a pair of trainable matrices A [rank, in] and
B [out, rank] and computes ``W x + (alpha / rank) * B A x``; the base weights are frozen (no
gradient, no optimizer state, no gradient buffer). ``rank: 0`` (the default) trains every
weight, as without this section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Hugging Face names of the projections an adapter can target (Qwen2 / Qwen3 / Llama)."""
ALL_LINEAR = "all-linear"
"""target_modules entry that means every projection in PROJECTIONS (PEFT's spelling)."""


class LoraInit(str, Enum):
    """How A starts (B always starts at zero, so the adapted model starts as the base model)."""

    kaiming = "kaiming"
    gaussian = "gaussian"


@dataclass
class LoraConfig:
    rank: int = 0
    """Adapter rank r; 0 = no adapters (full fine-tuning). 16 to 64 suits RL: the reward is a
    few bits per episode, so small ranks hold what it teaches."""
    alpha: Optional[float] = None
    """Scale numerator: the adapter's output is multiplied by alpha / rank; null = rank (scale 1).
    Keep alpha = rank when changing the rank, and tune the learning rate instead."""
    dropout: float = 0.0
    """Dropout on the adapters' input; must stay 0 with adapters (rank > 0): it would be on in
    the training forward and off in the log-prob passes, so the first on-policy importance
    ratio would not be 1 (refused before launch; docs/lora.md)."""
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """Projections that get adapters, by Hugging Face name: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj, or all-linear (all seven)."""
    init: LoraInit = LoraInit.kaiming
    """A's initialisation: kaiming (uniform, PEFT's default) or gaussian (normal, std 1/rank);
    drawn from trainer.seed per layer and projection, the same under every parallel layout. B
    starts at zero."""
