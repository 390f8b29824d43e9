"""rlbatch-bench memory --lora RANKS: the memory of a whole GRPO training step with LoRA adapters
of each rank (0 = full fine-tuning), at Qwen2.5-0.5B's width.

    rlbatch-bench memory --lora 0,16 [--layers 2] [--tokens 512 --prompt 128] [--json]

Each rank runs in a fresh subprocess: build the policy (megatron DDP), its optimizer and, with
grpo.beta > 0, the reference (a frozen copy of the policy under full fine-tuning; the policy
with its adapters off under LoRA), then one reference log-prob pass, one GRPO train pass and one
optimizer step (Adam's moments are allocated at the first step). ``state_gb``: RSS after the
step above the RSS before the model was built (weights, gradient buffers, optimizer state,
reference copy); ``peak_gb``: the process's peak RSS above that same start (activations
included); on GPU the CUDA allocator's figures instead. ``trainable`` counts the parameters the
optimizer updates.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any


def measure_step(rank: int, layers: int, tokens: int, prompt: int) -> dict[str, Any]:
    """One LoRA rank in this (fresh) process."""
    from dataclasses import replace

    import torch

    from rlbatch.bench import memory_probe
    from rlbatch.config.schema import Dtype, RunConfig
    from rlbatch.engine import parallel
    from rlbatch.engine.model import build_model, build_optimizer, num_trainable_parameters
    from rlbatch.grpo.stages import build_reference, reference_logps_fn

    cfg = RunConfig()
    cfg.model = replace(cfg.model, **{**memory_probe.MODEL, "num_layers": layers})  # type: ignore[arg-type]
    cfg.model.lora = replace(cfg.model.lora, rank=rank)
    if memory_probe.cuda():
        cfg.model = replace(cfg.model, params_dtype=Dtype.bf16)
    cfg.grpo.beta = 0.04
    cfg.grpo.num_generations = 1
    parallel.initialize(cfg)
    parallel.seed(0)
    cuda = memory_probe.cuda()
    start = memory_probe.rss_gb()
    cuda_start = torch.cuda.memory_allocated() if cuda else 0
    memory_probe.reset_hwm()
    model = build_model(cfg)
    optimizer, _ = build_optimizer(cfg, model)
    ref = build_reference(cfg, model)
    ref_fn = reference_logps_fn(cfg, ref, model)
    assert ref_fn is not None
    mb, seqs = memory_probe.micro_batch(tokens, prompt, cfg.model.vocab_size)
    begin = time.perf_counter()
    ref_pass = ref if ref is not None else model
    with _maybe_adapters_off(ref is None, model):
        memory_probe.logprob_pass(ref_pass, mb, seqs, prompt, True)
    memory_probe.train_pass(model, mb, seqs, prompt, True)
    optimizer.step()
    row: dict[str, Any] = {
        "lora_rank": rank,
        "layers": layers,
        "tokens": tokens,
        "trainable": num_trainable_parameters(model),
        "reference_copy": ref is not None,
        "state_gb": memory_probe.rss_gb() - start,
        "peak_gb": memory_probe.hwm_gb() - start,
        "step_seconds": time.perf_counter() - begin,
    }
    if cuda:
        row["cuda_state_gb"] = (torch.cuda.memory_allocated() - cuda_start) / 2**30
        row["cuda_peak_gb"] = (torch.cuda.max_memory_allocated() - cuda_start) / 2**30
    return row


def _maybe_adapters_off(off: bool, model: list[Any]) -> Any:
    import contextlib

    from rlbatch.engine.lora import adapters_disabled

    return adapters_disabled(model) if off else contextlib.nullcontext()


def run(ranks: list[int], layers: int, tokens: int, prompt: int, as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    for rank in ranks:
        cmd = [sys.executable, "-m", "rlbatch.bench.memory_lora", str(rank), str(layers),
               str(tokens), str(prompt)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["killed"])[-1][:200]
            rows.append({"lora_rank": rank, "error": tail})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if as_json:
        print(json.dumps({"rows": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one GRPO step (grpo.beta > 0), Qwen2.5-0.5B width, {layers} layers")
    for col in ("LoRA rank", "trainable", "reference copy", "state GB", "peak GB", "step s"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(str(r["lora_rank"]), r["error"], "", "", "", "")
            continue
        table.add_row(
            str(r["lora_rank"]) if r["lora_rank"] else "0 (full)", f"{r['trainable']:,}",
            "yes" if r["reference_copy"] else "no (adapters off)", f"{r['state_gb']:.2f}",
            f"{r['peak_gb']:.2f}", f"{r['step_seconds']:.1f}",
        )  # fmt: skip
    Console().print(table)
    return 0


if __name__ == "__main__":
    rank, layers, tokens, prompt = (int(x) for x in sys.argv[1:5])
    print(json.dumps(measure_step(rank, layers, tokens, prompt)))
