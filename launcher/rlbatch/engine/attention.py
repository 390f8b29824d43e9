"""Packed (THD) attention without Transformer Engine: Megatron's local DotProductAttention run
once per packed sequence.

Megatron's local attention refuses ``packed_seq_params``; the alternative, one row with a
block-diagonal causal mask, computes the full (sum of lengths)^2 score matrix, most of it
masked. Here each sequence of the pack (``cu_seqlens``) gets its own causal attention, so the
cost follows sum(length^2) as with TE's THD kernels, and the math per sequence is exactly
Megatron's (same scaling, softmax, dropout RNG): packed logits equal unpacked ones.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked (a query never sees later keys)."""
    ones = torch.ones(length, length, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)[None, None]


class SegmentedDotProductAttention(DotProductAttention):
    """DotProductAttention that also takes THD input: per-sequence causal attention."""

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        # THD: query [t, np, hn], key / value [t, ng, hn]; the pack's sequences are the
        # intervals of cu_seqlens (the padded bounds when given, as TE reads them).
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        bounds = [int(b) for b in cu.tolist()]
        outputs = []
        for start, end in itertools.pairwise(bounds):
            if end == start:
                continue
            rows = slice(start, end)
            out = super().forward(
                query[rows].unsqueeze(1),  # [s, b=1, np, hn]
                key[rows].unsqueeze(1),
                value[rows].unsqueeze(1),
                _causal_mask(end - start, query.device),
                attn_mask_type,
                attention_bias,
            )  # [s, 1, hp]
            outputs.append(out)
        return torch.cat(outputs, dim=0)  # [t, 1, hp]
