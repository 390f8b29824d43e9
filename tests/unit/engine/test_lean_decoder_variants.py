"""The built-in engine's per-row KV-cache decoder computes the model megatron trains, for every
dense block it accepts (Qwen3's per-head QK norm, linear and llama3 RoPE scaling), and refuses
the ones it cannot compute instead of decoding some other model."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import megatron_world  # noqa: F401

from rlbatch.config.schema import Architecture, RopeScaling, RunConfig

VARIANTS = {
    "qwen2": {},
    "qwen3 qk norm": {"qk_layernorm": True, "architecture": Architecture.qwen3},
    "linear rope": {"rope_scaling": RopeScaling.linear, "rope_scaling_factor": 4.0},
    "llama3 rope": {"rope_scaling": RopeScaling.llama3, "rope_scaling_factor": 8.0,
                    "rope_original_max_position_embeddings": 16},
}  # fmt: skip


def _model(fields):
    from rlbatch.engine.model import build_model

    cfg = RunConfig()
    cfg.model = replace(cfg.model, **fields)
    torch.manual_seed(0)
    (chunk,) = build_model(cfg, wrap_ddp=False)
    with torch.no_grad():  # peaked logits and non-trivial norms, so a wrong block shows
        for p in chunk.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return chunk.eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_and_decode_equal_megatrons_forward(megatron_world, name):
    from rlbatch.engine.generation import LeanDecoder

    chunk = _model(VARIANTS[name])
    ids = torch.randint(2, 250, (1, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.triu(torch.ones(1, 1, 48, 48, dtype=torch.bool), 1)
    with torch.no_grad():
        full = chunk(ids, torch.arange(48)[None], mask)[0]  # [T, V]
        decoder = LeanDecoder(chunk, 1, 64)
        got = [decoder.prefill([0], [ids[0, :40].tolist()])[0]]
        got += [decoder.decode(ids[0, t : t + 1])[0] for t in range(40, 47)]
    # positions 39..46: past llama3's original context (16) and the linear factor's reach
    assert torch.allclose(torch.stack(got), full[39:47], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [({"rope_scaling": RopeScaling.yarn, "rope_scaling_factor": 4.0}, "yarn")],
)  # MoE blocks it computes: tests/unit/engine/test_lean_decoder_moe.py
def test_a_block_it_cannot_compute_is_refused(megatron_world, fields, reason):
    from rlbatch.engine.generation import LeanDecoder

    chunk = _model(fields)
    with pytest.raises(ValueError, match=reason):
        LeanDecoder(chunk, 1, 16)
