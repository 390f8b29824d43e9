"""Model presets match the public Qwen2.5, Qwen3 and Llama-3 configs; the adapter's Megatron
settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlbatch.config.schema import ModelConfig, ParallelConfig
from rlbatch.engine import adapter

CONF = Path(__file__).resolve().parents[3] / "conf" / "model"
# name: (layers, hidden, ffn, heads, kv heads, vocab, tied, parameters in billions)
PUBLIC = {
    "qwen2_5_0_5b": (24, 896, 4864, 14, 2, 151936, True, 0.49),
    "qwen2_5_1_5b": (28, 1536, 8960, 12, 2, 151936, True, 1.54),
    "qwen2_5_7b": (28, 3584, 18944, 28, 4, 152064, False, 7.62),
}


def _load(name: str) -> ModelConfig:
    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / f"{name}.yaml"))
    )


def _num_params(m: ModelConfig) -> int:
    head = m.hidden_size // m.num_attention_heads
    kv = m.num_query_groups * head
    attn = m.hidden_size * (m.hidden_size + 2 * kv) + (m.hidden_size + 2 * kv) + m.hidden_size**2
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    layer = attn + mlp + 2 * m.hidden_size
    emb = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * layer + emb + m.hidden_size


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_matches_public_config(name):
    m = _load(name)
    layers, hidden, ffn, heads, kv, vocab, tied, billions = PUBLIC[name]
    got = (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads)
    assert got == (layers, hidden, ffn, heads)
    assert (m.num_query_groups, m.vocab_size, m.tie_word_embeddings) == (kv, vocab, tied)
    assert m.rope_theta == 1e6 and m.rms_norm_eps == 1e-6 and m.add_qkv_bias
    assert _num_params(m) / 1e9 == pytest.approx(billions, abs=0.01)


def test_transformer_config_cpu_and_interleaving():
    config = adapter.transformer_config(
        ModelConfig(num_layers=4), ParallelConfig(pp=2, vpp=2), microbatch_group_size=3
    )
    assert config.variable_seq_lengths and config.moe_token_dispatcher_type == "alltoall"
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and config.add_qkv_bias
    assert not config.add_bias_linear and config.num_query_groups == 2
    # pp=2 + vpp=2: the default batched p2p is silently wrong; overlapped, unbatched is right
    assert config.overlap_p2p_comm and not config.batch_p2p_comm
    assert config.microbatch_group_size_per_vp_stage == 3
    assert config.virtual_pipeline_model_parallel_size == 2
    flat = adapter.transformer_config(ModelConfig(), ParallelConfig())
    assert flat.virtual_pipeline_model_parallel_size is None


@pytest.mark.cpu_only
def test_bf16_training_on_cpu_is_a_config_error_naming_the_key():
    """megatron-core's mixed-precision optimizers need CUDA: on CPU the user gets the key and
    the fix instead of a dtype error from deep inside the optimizer's first step."""
    import torch

    from rlbatch.config.errors import ConfigErrors
    from rlbatch.config.schema import Dtype, OptimConfig

    if torch.cuda.is_available():
        pytest.skip("on GPU bf16 training is supported")
    model = ModelConfig(params_dtype=Dtype.bf16)
    with pytest.raises(ConfigErrors, match=r"model\.params_dtype=bf16.*params_dtype=fp32"):
        adapter.optimizer_config(OptimConfig(), model, ParallelConfig())
    fp32 = adapter.optimizer_config(OptimConfig(), ModelConfig(), ParallelConfig())
    assert fp32.params_dtype == torch.float32 and not fp32.bf16


# Qwen3 and Llama-3 presets: parameter counts of the public checkpoints (tied embeddings
# counted once), counted on transformers' own model built from the preset's exported config.
PUBLIC_PARAMS = {
    "qwen3_0_6b": 596_049_920,
    "qwen3_1_7b": 1_720_574_976,  # model card: 1.7B, 1.4B non-embedding
    "qwen3_8b": 8_190_735_360,
    "llama3_2_1b": 1_235_814_400,
    "llama3_1_8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAMS))
def test_qwen3_llama3_presets_match_public_models(name, tmp_path):
    import json

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rlbatch.engine.hf_config import config_from_hf, hf_config_dict

    m = _load(name)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(m)))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLIC_PARAMS[name]
    back = config_from_hf(tmp_path)  # the export's config.json reads back to the preset
    for key, value in back.items():
        if key not in ("name", "params_dtype"):
            assert getattr(m, key) == value, key
