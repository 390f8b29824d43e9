"""The LoRA multi-process case, shared by the torchrun worker (lora_worker.py) and the
single-process reference in tests/dist/test_lora_parallel.py.

engine_case's 4-layer tiny Qwen2 and micro-batches, with adapters of rank 4 on every projection
set from one file of full (PEFT-named) tensors, so every layout starts from the same adapted
model: a train pass (losses, adapter gradients), the same pass with the output projection in
3-position chunks, an optimizer step, and logprob passes with the adapters on and off.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from engine_case import ROUND, infer_plan, make_cfg, plan_of, sequences

from rlbatch.batching.plan import MicroBatch
from rlbatch.config.schema import RunConfig


def lora_cfg(**layout: Any) -> RunConfig:
    cfg = make_cfg(**layout)
    cfg.model = replace(cfg.model, lora=replace(cfg.model.lora, rank=4, alpha=8.0))
    return cfg


def _gathered(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's share, merged (the same dict on every rank)."""
    from rlbatch import distributed

    merged: dict[str, torch.Tensor] = {}
    for share in distributed.all_gather_object({k: v.cpu() for k, v in part.items()}):
        merged.update(share)
    return merged


def run_lora_case(
    cfg: RunConfig,
    micro_batches: list[MicroBatch],
    adapters: dict[str, torch.Tensor],
    save_dir: Optional[str] = None,
) -> dict[str, Any]:
    """The case on this layout; ``save_dir``: the distributed checkpoint after the step
    (adapters and their Adam moments only: the base comes from model.hf_path)."""
    from rlbatch.engine import hf, lm_head, logprobs, lora, schedule
    from rlbatch.engine import model as engine_model

    seqs = sequences()
    chunks = engine_model.build_model(cfg)
    hf.load_hf_into(chunks, cfg.model.hf_path)
    lora.mark_base_loaded(chunks, cfg.model.hf_path)
    lora.load_full_adapters(chunks, adapters)
    plan = plan_of([micro_batches], cfg.parallel.pp)

    def batch_fn(mb: MicroBatch) -> schedule.MicroBatchInputs:
        return schedule.make_inputs([seqs[i] for i in mb.samples], mb, round_to=ROUND)

    result: dict[str, Any] = {}
    for tokens in (cfg.model.logits_chunk_tokens, 3):
        lm_head.set_logits_chunk_tokens(chunks, tokens)
        out = schedule.run_pass(chunks, plan.ranks[0], plan, batch_fn, schedule.next_token_loss)
        result[f"losses_{tokens}"] = [float(m["loss_sum"]) for m in out]
        result[f"grads_{tokens}"] = _gathered(lora.full_adapters(chunks, grads=True))
    lm_head.set_logits_chunk_tokens(chunks, cfg.model.logits_chunk_tokens)
    optimizer, _ = engine_model.build_optimizer(cfg, chunks)
    ok, grad_norm, _ = optimizer.step()
    result["grad_norm"] = float(grad_norm)
    result["after_step"] = _gathered(lora.full_adapters(chunks))
    if save_dir is not None:
        from rlbatch.engine.dist_checkpoint import save_sharded

        save_sharded(save_dir, chunks, optimizer)
    result["logprobs"] = logprobs.compute_logprobs(chunks, seqs, infer_plan(cfg), round_to=ROUND)
    with lora.adapters_disabled(chunks):
        result["base_logprobs"] = logprobs.compute_logprobs(
            chunks, seqs, infer_plan(cfg), round_to=ROUND
        )
    return result
