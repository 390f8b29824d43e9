"""The Qwen2.5-0.5B shape on a GPU, through the real commands (megatron's local layer spec when
Transformer Engine is not installed; rlbatch's per-sequence attention for packed micro-batches).

- Forward parity: ``rlbatch-logprobs`` on the GPU in fp32 and bf16, padded (``dynamic``) and
  packed (THD) micro-batches, against transformers' Qwen2 in fp32 on the CPU over the same random
  checkpoint; rlbatch's own CPU fp32 path (GPU hidden) must equal that reference too.
- A whole GRPO step of the 0.5B shape in bf16 (``rlbatch-train``): finite loss, tokens/s and
  peak GPU memory reported.
- LoRA in bf16: the rollout engine's policy adds no more rollout-vs-trainer mismatch than full
  fine-tuning's bf16 noise.

Errors are relative to the reference's spread: ``||a - b|| / ||b - mean(b)||`` over every scored
token (a random model's log-probs sit near -log(vocab) with a spread of about 0.5 nats, which is
what a forward bug would change).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gpu_support import DRYRUN, has_cuda, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (has_cuda() or DRYRUN), reason="needs CUDA"),
]

# Qwen2.5-0.5B (conf/model/qwen2_5_0_5b.yaml); the dry run on a CPU shrinks depth and vocabulary
SHAPE = dict(
    num_hidden_layers=2 if DRYRUN else 24, hidden_size=896, intermediate_size=4864,
    num_attention_heads=14, num_key_value_heads=2, vocab_size=4096 if DRYRUN else 151936,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    max_position_embeddings=4096,
)  # fmt: skip
LENGTHS = [7, 64, 200, 31, 129, 300, 18, 96]
TOLERANCE = {"fp32": 2e-3, "bf16": 0.1}
"""Relative error against the fp32 reference: fp32 allows kernel-order differences over 24
layers; bf16 an 8-bit mantissa through 24 layers."""


def _rel(a: list[float], b: list[float]) -> float:
    mean = sum(b) / len(b)
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    return num / math.sqrt(sum((y - mean) ** 2 for y in b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random checkpoint of the shape, the sequences, and transformers' fp32 CPU log-probs."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("qwen_shape")
    config = transformers.Qwen2Config(**SHAPE, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "hf")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]
    (root / "in.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    ref = []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=torch.tensor([s])).logits[0].double()
            logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(s[1:])[:, None])
            ref.append(logp[:, 0].tolist())
    del model
    return root, ref


def _logprobs(root: Path, name: str, dtype: str, mode: str, *, cpu: bool) -> list[list[float]]:
    out = root / f"{name}.jsonl"
    run_cli(
        ["rlbatch-logprobs", "model=qwen2_5_0_5b", f"model.hf_path={root / 'hf'}",
         f"model.params_dtype={dtype}", f"logprobs.input={root / 'in.jsonl'}",
         f"logprobs.output={out}", f"batching.infer.mode={mode}",
         "batching.infer.max_tokens=1024"],
        cwd=root, cpu=cpu,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return [r["token_logprobs"] for r in sorted(rows, key=lambda r: r["index"])]


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def test_cpu_fp32_path_equals_transformers(reference, gpu_figures):
    """The CPU reference chain: rlbatch on the CPU (GPU hidden) against transformers."""
    root, ref = reference
    got = _logprobs(root, "cpu_fp32", "fp32", "dynamic", cpu=True)
    rel = _rel(_flat(got), _flat(ref))
    gpu_figures("parity_cpu_fp32_vs_transformers", rel_error=rel)
    assert rel <= 1e-4


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_forward_matches_cpu_fp32_reference(reference, gpu_figures, dtype):
    root, ref = reference
    padded = _logprobs(root, f"gpu_{dtype}_dynamic", dtype, "dynamic", cpu=False)
    packed = _logprobs(root, f"gpu_{dtype}_packed", dtype, "packed", cpu=False)
    assert [len(r) for r in padded] == [len(r) for r in packed] == [n - 1 for n in LENGTHS]
    rel_padded, rel_packed = _rel(_flat(padded), _flat(ref)), _rel(_flat(packed), _flat(ref))
    rel_layouts = _rel(_flat(packed), _flat(padded))
    gpu_figures(
        f"parity_gpu_{dtype}", rel_error_padded=rel_padded, rel_error_packed_thd=rel_packed,
        rel_packed_vs_padded=rel_layouts,
        max_abs_padded=max(abs(a - b) for a, b in zip(_flat(padded), _flat(ref), strict=True)),
    )  # fmt: skip
    assert rel_padded <= TOLERANCE[dtype]
    assert rel_packed <= TOLERANCE[dtype]
    assert rel_layouts <= TOLERANCE[dtype] / 2


def _train(root: Path, name: str, *overrides: str) -> list[dict]:
    run_dir = root / name
    run_cli(
        ["rlbatch-train", "+recipe=grpo_qwen", f"hydra.run.dir={run_dir}", "logging.plot=false",
         "logging.tensorboard=false", "trainer.checkpoint.export_hf=false",
         "logging.progress=false", "trainer.checkpoint.every_steps=0",
         "trainer.checkpoint.every_minutes=0", *overrides],
        cwd=root, timeout=900,
    )  # fmt: skip
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_step_0_5b_bf16(tmp_path, gpu_figures):
    """Whole GRPO steps (rollout, reference and old log-probs, train, optimizer) of the 0.5B
    shape in bf16 with random weights and the byte tokenizer."""
    dtype = "fp32" if DRYRUN else "bf16"  # bf16 parameters need a GPU optimizer
    small = ["model.num_layers=2", "model.vocab_size=4096", "grpo.num_generations=4"]
    records = _train(
        tmp_path, "grpo_0_5b", "model=qwen2_5_0_5b", f"model.params_dtype={dtype}",
        "trainer.max_steps=3", "grpo.global_batch_size=64", "grpo.num_generations=8",
        f"rollout.max_new_tokens={16 if DRYRUN else 128}", "batching.train.max_tokens=8192",
        "batching.infer.max_tokens=16384", *(small if DRYRUN else []),
    )  # fmt: skip
    assert len(records) == 3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    steady = records[1:]  # the first step carries one-time costs (kernels, allocator)
    tokens_per_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
    gpu_figures(
        "grpo_step_0_5b_" + dtype, tokens_per_s=tokens_per_s,
        step_time_s=sum(r["step_time_s"] for r in steady) / len(steady),
        tokens_per_step=steady[-1]["tokens"], peak_memory_gb=max(r["peak_memory_gb"] for r in records),
        response_len_mean=steady[-1]["response_len_mean"],
    )  # fmt: skip
    assert tokens_per_s > 0 and records[-1]["peak_memory_gb"] > 0


def test_lora_bf16_rollouts_sample_the_trained_policy(tmp_path, gpu_figures):
    """The rollout engine's log-probs against the trainer's (mismatch_kl_k1) in bf16: LoRA (the
    adapters reach the engine after every step) stays at full fine-tuning's bf16 noise floor."""
    if DRYRUN:
        pytest.skip("bf16 training needs a GPU")
    common = ("model.params_dtype=bf16", "trainer.max_steps=4")
    full = _train(tmp_path, "full", *common)
    lora = _train(tmp_path, "lora", "model.init_method_std=0.2", "model.lora.rank=16",
                  "model.lora.alpha=16", "trainer.optim.lr=3e-2", *common)  # fmt: skip

    def mismatch(records: list[dict]) -> float:
        return sum(abs(r["mismatch_kl_k1"]) for r in records[1:]) / (len(records) - 1)

    gpu_figures("lora_bf16_mismatch", full_kl_k1=mismatch(full), lora_kl_k1=mismatch(lora))
    assert mismatch(lora) <= max(3 * mismatch(full), 1e-3)
