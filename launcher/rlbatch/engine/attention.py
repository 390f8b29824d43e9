"""Packed (THD) attention without Transformer Engine: Megatron's local DotProductAttention run
once per packed sequence.

Megatron's local attention refuses ``packed_seq_params``; the alternative, one row with a
block-diagonal causal mask, computes the full (sum of lengths)^2 score matrix, most of it
masked. Here each sequence of the pack (``cu_seqlens``) gets its own causal attention, so the
cost follows sum(length^2) as with TE's THD kernels: packed logits equal unpacked ones.

Without attention dropout (rlbatch's default) sequences of equal length share one batched
``torch.nn.functional.scaled_dot_product_attention`` call (causal, grouped-query heads, the
layer's softmax scale): far fewer kernel calls than one Megatron attention per sequence, which
dominated packed training on CPU. With dropout, Megatron's own attention runs per sequence
(same dropout RNG use as unpacked).
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from rlbatch.engine.cpu_compat import import_megatron

import_megatron()  # before megatron's first import: on the CPU without torch.compile

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402


def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked (a query never sees later keys)."""
    ones = torch.ones(length, length, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)[None, None]


class SegmentedDotProductAttention(DotProductAttention):
    """DotProductAttention that also takes THD input: per-sequence causal attention."""

    def _fused_ok(self) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return dropout == 0.0 and not self.config.apply_query_key_layer_scaling

    def _grouped_sdpa(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """Causal attention per sequence, sequences of one length batched together.
        query [t, np, hn], key / value [t, ng, hn] -> [t, 1, np * hn]."""
        by_len: dict[int, list[int]] = {}
        for start, end in itertools.pairwise(bounds):
            if end > start:
                by_len.setdefault(end - start, []).append(start)
        out = query.new_zeros(query.shape[0], query.shape[1] * query.shape[2])
        for length, starts in by_len.items():
            rows = torch.cat([torch.arange(s, s + length) for s in starts]).to(query.device)
            q, k, v = (
                t[rows].view(len(starts), length, t.shape[1], t.shape[2]).transpose(1, 2)
                for t in (query, key, value)
            )  # [b, heads, s, hn]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=True
            )  # [b, np, s, hn]
            out[rows] = o.transpose(1, 2).reshape(len(starts) * length, -1)
        return out[:, None]  # [t, 1, hp]

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
        if self._fused_ok():
            return self._grouped_sdpa(query, key, value, bounds)
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
