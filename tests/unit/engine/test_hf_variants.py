"""HF import of every supported forward-changing option (RoPE base, linear / llama3 / yarn
scaling, Qwen3 QK-norm and head_dim, Llama untied without biases; transformers 4 and 5
config layouts) against transformers' own forward (fp32 max abs <= 1e-4 on logprobs), and the
exact export round trip. Unsupported options are config errors naming the field."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import megatron_world  # noqa: F401

transformers = pytest.importorskip("transformers")

from hf_reference import VARIANTS, reference_logps, save_tiny  # noqa: E402
from rlbatch.config.errors import ConfigErrors  # noqa: E402
from rlbatch.config.schema import ModelConfig, RunConfig  # noqa: E402
from rlbatch.engine import hf, schedule  # noqa: E402
from rlbatch.engine.hf_config import config_from_hf  # noqa: E402
from rlbatch.engine.setup import set_up_model  # noqa: E402

LENGTHS = [70, 5, 33]  # past the llama3 / yarn original context (32)


def _our_logps(model, seqs):
    from rlbatch.batching.plan import MicroBatch

    width = max(LENGTHS)
    mb = MicroBatch(tuple(range(len(seqs))), tuple(LENGTHS), width, width * len(seqs), sum(LENGTHS))
    inputs = schedule.make_inputs(seqs, mb)
    with torch.no_grad():
        logits = schedule.model_forward(model[0].eval(), inputs).double()
    out = []
    for j, ids in enumerate(seqs):
        logp = torch.log_softmax(logits[j, : len(ids)], -1)
        out.append(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize(
    "variant,legacy",
    [(v, False) for v in VARIANTS] + [("qwen2_linear", True), ("llama3", True)],
)
def test_logprobs_match_transformers_and_export_round_trips(
    megatron_world, tmp_path, variant, legacy
):
    ref = save_tiny(tmp_path / "hf", variant, legacy=legacy)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert ("rope_parameters" in raw) != legacy
    cfg = RunConfig()
    cfg.model = ModelConfig(hf_path=str(tmp_path / "hf"), max_position_embeddings=256)
    setup = set_up_model(cfg, wrap_ddp=False)
    assert cfg.model.rope_theta != setup.cfg.model.rope_theta == 50000.0  # cfg left unchanged

    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 264, (n,), generator=g).tolist() for n in LENGTHS]
    for ours, ids in zip(_our_logps(setup.model, seqs), seqs, strict=True):
        want = reference_logps(ref, ids)
        assert max(abs(a - b) for a, b in zip(ours, want, strict=True)) <= 1e-4

    out = tmp_path / "export"
    hf.export_hf(setup.model, setup.cfg.model, out, max_shard_bytes=30_000)
    index = json.loads((out / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    exported = hf.HFWeights(out)
    original = ref.state_dict()
    if raw.get("tie_word_embeddings"):
        original.pop("lm_head.weight")
    assert set(exported.weight_map) == set(original)
    for k, v in original.items():
        assert torch.equal(exported.get(k), v), k
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(again) is type(ref)
    with torch.no_grad():
        ids = torch.tensor([seqs[0]])
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)


def _write_config(tmp_path, **changes):
    save_tiny(tmp_path, "qwen2_theta")
    file = tmp_path / "config.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "rope_parameters.rope_type=dynamic"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
         "rope_parameters.rope_type=longrope"),
        ({"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64"),
        ({"hidden_act": "gelu"}, "hidden_act=gelu"),
        ({"model_type": "mistral"}, "model_type=mistral"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_config_errors(tmp_path, changes, field):
    path = _write_config(tmp_path, **changes)
    with pytest.raises(ConfigErrors) as err:
        config_from_hf(path)
    assert field in str(err.value)


def test_llama_attention_bias_and_mlp_bias_are_errors_together(tmp_path):
    save_tiny(tmp_path, "llama3")
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "attention_bias": True,
                                "mlp_bias": True}))  # fmt: skip
    with pytest.raises(ConfigErrors) as err:
        config_from_hf(tmp_path)
    assert "attention_bias=true" in str(err.value) and "mlp_bias=true" in str(err.value)
