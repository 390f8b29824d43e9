"""LoRA runs leave through rlbatch-export as a merged Hugging Face model plus a PEFT adapter
directory that the real ``peft`` package loads onto the base model with the merged model's
logits; with rollout.backend=vllm the engine samples from the adapted policy (the adapters
sent as a vLLM LoRA adapter at every sync, over the base weights), not the base.

References are independent of rlbatch: transformers' Qwen2 (the base checkpoint and the merged
export) and peft's LoRA layers (the adapter directory)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from hf_reference import save_tiny  # noqa: E402

pytestmark = pytest.mark.e2e

LAYERS = 2
IDS = torch.randint(3, 259, (1, 24), generator=torch.Generator().manual_seed(0))


def _run(cmd, cwd, env):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train(bin_dir, env, run, *overrides):
    _run(
        [
            str(bin_dir / "rlbatch-train"), "+recipe=grpo_qwen", f"hydra.run.dir={run}",
            "logging.plot=false", "logging.tensorboard=false", "trainer.checkpoint.export_hf=false",
            "trainer.checkpoint.every_steps=1", "trainer.checkpoint.keep_last=3",
            "grpo.global_batch_size=32", "grpo.beta=0", "trainer.optim.lr=0.03", *overrides,
        ],
        run.parent, env,
    )  # fmt: skip


def _export(bin_dir, env, run, out, step):
    _run([str(bin_dir / "rlbatch-export"), str(run), "--out", str(out), "--step", str(step)],
         run.parent, env)  # fmt: skip


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits[0].double()  # [T, V]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) of the next-token distributions."""
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _load(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _peft_matches_merged(out: Path, base_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's model (base + out/adapter) against transformers on the merged export: equal
    logits. Returns (base logits, merged logits)."""
    from peft import PeftModel

    merged = _logits(_load(out))
    base = _load(base_dir)
    base_logits = _logits(base)
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    peft_logits = _logits(adapted)
    assert torch.allclose(peft_logits, merged, atol=2e-5, rtol=0), (
        (peft_logits - merged).abs().max()
    )
    return base_logits, merged


def test_peft_loads_the_exported_adapters_of_a_tp2_lora_run(tmp_path, bin_dir, subprocess_env):
    """One step of a rank-4 LoRA run (alpha 8; q/v inside the fused QKV, up inside the fused
    gate/up, down_proj) at tp 2 from a transformers-made Qwen2 checkpoint: rlbatch-export writes the
    merged model (config.json free of adapter keys) and adapter/ with PEFT's names and config;
    PeftModel.from_pretrained(the source checkpoint, adapter/) gives the merged model's logits,
    and those differ from the source's (the adapters trained)."""
    src = tmp_path / "src"
    save_tiny(src, "qwen2_theta", num_layers=LAYERS)
    run, out = tmp_path / "run", tmp_path / "out"
    targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    _train(
        bin_dir, subprocess_env, run, f"model.hf_path={src}", "model.tokenizer=bytes",
        "parallel.tp=2", "trainer.max_steps=1", "model.lora.rank=4", "model.lora.alpha=8",
        f"model.lora.target_modules=[{','.join(targets)}]",
    )  # fmt: skip
    _export(bin_dir, subprocess_env, run, out, step=1)

    config = json.loads((out / "config.json").read_text())
    assert not [k for k in config if "lora" in k.lower() or "adapter" in k.lower()]
    assert not (out / "base").exists()  # the run started from src: that is the base
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["task_type"] == "CAUSAL_LM"
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (4, 8, 0.0)
    assert sorted(adapter["target_modules"]) == sorted(targets)
    assert adapter["base_model_name_or_path"] == str(src.resolve())

    from safetensors.torch import load_file

    tensors = load_file(out / "adapter" / "adapter_model.safetensors")
    mlp = {"up_proj", "down_proj"}
    expected = {
        f"base_model.model.model.layers.{i}.{'mlp' if p in mlp else 'self_attn'}.{p}.lora_{f}.weight"
        for i in range(LAYERS)
        for p in targets
        for f in "AB"
    }
    assert set(tensors) == expected
    assert tensors[next(k for k in expected if "q_proj.lora_B" in k)].shape == (32, 4)
    assert tensors[next(k for k in expected if "down_proj.lora_A" in k)].shape == (4, 64)
    assert all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)  # trained

    base_logits, merged = _peft_matches_merged(out, src)
    assert _kl(merged, base_logits) > 1e-4


@pytest.mark.slow
@pytest.mark.optional_extra
def test_vllm_samples_the_adapted_policy(tmp_path, bin_dir, subprocess_env):
    """rollout.backend=vllm with LoRA (rank 8, every projection, no model.hf_path): the sync
    sends the adapters as vLLM LoRA over the base weights, so vLLM's behaviour logprobs equal the trainer's adapted
    forward at every step (importance weights 1) although, by the last step, the adapted
    policy is far from the base (KL through transformers on the export of the step whose
    weights vLLM sampled with); had vLLM kept the base, the mismatch would be that KL. The
    export of a run without a source model also writes base/, on which PEFT loads adapter/."""
    pytest.importorskip("vllm")
    run, out = tmp_path / "run", tmp_path / "out"
    steps = 2
    _train(
        bin_dir, subprocess_env, run, "rollout.backend=vllm", "model.num_attention_heads=2",
        "model.num_query_groups=2", "rollout.vllm.kv_cache_space_gb=0.25",
        f"trainer.max_steps={steps}", "rollout.temperature=0.7", "grpo.epsilon_low=0.01",
        "grpo.epsilon_high=0.01", "model.lora.rank=8",
    )  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert abs(r["mismatch_kl_k1"]) < 1e-6
        assert r["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["clip_fraction"] == 0.0

    _export(bin_dir, subprocess_env, run, out, step=steps - 1)  # the weights of the last rollout
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(out / "base")
    assert sorted(adapter["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    base_logits, merged = _peft_matches_merged(out, out / "base")
    assert _kl(base_logits / 0.7, merged / 0.7) > 5e-4  # 500x the mismatch bound above
