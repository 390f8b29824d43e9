"""HF interop against transformers' own Qwen2 (no download): logits parity on variable-length
sequences (fp32 max abs diff <= 1e-4) and an exact export round trip; Qwen2-MoE (shared
expert and its gate) imports and exports exactly."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from engine_helpers import megatron_world, padded_mb  # noqa: F401

from rlbatch.config.schema import ModelConfig  # noqa: E402
from rlbatch.engine import hf, schedule  # noqa: E402
from rlbatch.engine import model as engine_model  # noqa: E402

LENGTHS = [7, 16, 3, 12]


def _hf_model(tmp_path, tied: bool, shard: bool):
    config = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    ref = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in ref.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    out = tmp_path / ("tied" if tied else "untied")
    ref.save_pretrained(out, safe_serialization=True, max_shard_size="40KB" if shard else "1GB")
    return ref, out


@pytest.mark.parametrize("tied,shard", [(True, False), (False, True)])
def test_logits_match_transformers_and_export_round_trips(megatron_world, tmp_path, tied, shard):
    ref, path = _hf_model(tmp_path, tied, shard)
    assert shard == (path / hf.INDEX).is_file()
    cfg = replace(megatron_world)
    cfg.model = replace(ModelConfig(), hf_path=str(path))
    cfg.model, changed = hf.resolve_model_config(cfg.model)
    assert changed and cfg.model.vocab_size == 96 and cfg.model.tie_word_embeddings == tied
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    hf.load_hf_into(chunks, path)

    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in LENGTHS]
    inputs = schedule.make_inputs(seqs, padded_mb(range(4), LENGTHS, 4))
    with torch.no_grad():
        ours = schedule.model_forward(chunks[0].eval(), inputs)
        attn = torch.zeros_like(inputs.tokens)
        for j, n in enumerate(LENGTHS):
            attn[j, :n] = 1
        theirs = ref(input_ids=inputs.tokens, attention_mask=attn).logits
    for j, n in enumerate(LENGTHS):
        diff = (ours[j, :n] - theirs[j, :n]).abs().max().item()
        assert diff <= 1e-4, (j, diff)

    out = tmp_path / "export"
    hf.export_hf(chunks, cfg.model, out)
    weights = hf.HFWeights(out)
    exported = {k: weights.get(k) for k in weights.weight_map}
    original = ref.state_dict()
    if tied:
        original = {k: v for k, v in original.items() if k != "lm_head.weight"}
    assert set(exported) == set(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k
    again = transformers.Qwen2ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = again(input_ids=inputs.tokens, attention_mask=attn).logits
    torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-6)
    assert hf.config_from_hf(out)["num_query_groups"] == 2


def test_a_gathered_expert_tensor_takes_its_owners_global_index():
    """At ep > 1 the weight stream yields another rank's experts under their global index: the
    expert number is shifted, the layer number and the rest of the name are not."""
    name = "model.layers.12.mlp.experts.1.down_proj.weight"
    assert hf._expert_renumbered(name, 2) == "model.layers.12.mlp.experts.3.down_proj.weight"
    assert hf._expert_renumbered(name, -1) == "model.layers.12.mlp.experts.0.down_proj.weight"
    assert hf.is_expert_tensor(name)
    assert not hf.is_expert_tensor("model.layers.12.mlp.gate.weight")  # the router: replicated


def test_qwen2_moe_imports_and_exports_exactly(megatron_world, tmp_path):
    """A transformers-made Qwen2-MoE (routed experts, a gated shared expert, q/k/v biases, a
    dense layer): every tensor of the export equals the checkpoint's, and the export's
    config.json maps back onto the same model keys (per-token parity with transformers:
    tests/e2e/test_moe_cli.py)."""
    from hf_reference import save_tiny_qwen2_moe

    path = tmp_path / "qwen2_moe"
    ref = save_tiny_qwen2_moe(path)
    cfg = replace(megatron_world)
    cfg.model = replace(ModelConfig(), hf_path=str(path))
    cfg.model, _ = hf.resolve_model_config(cfg.model)
    assert cfg.model.moe_shared_expert_intermediate_size == 40 and cfg.model.add_qkv_bias
    chunks = engine_model.build_model(cfg, wrap_ddp=False)
    hf.load_hf_into(chunks, path)
    out = tmp_path / "export"
    hf.export_hf(chunks, cfg.model, out)
    exported = hf.HFWeights(out)
    original = hf.HFWeights(path)
    assert set(exported.weight_map) == set(original.weight_map)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in exported.weight_map
    for k in original.weight_map:
        assert torch.equal(exported.get(k), original.get(k)), k
    fields = ("architecture", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_layer_freq", "moe_norm_topk_prob", "moe_shared_expert_intermediate_size",
              "add_qkv_bias", "qk_layernorm", "head_dim")  # fmt: skip
    again, source = hf.config_from_hf(out), hf.config_from_hf(path)
    assert {k: again.get(k) for k in fields} == {k: source.get(k) for k in fields}
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)) is type(ref)
