"""The MoE load-balancing-loss case shared by the torchrun worker (moe_balance_worker.py) and the
single-process pp = 1 reference of tests/dist/test_moe_balance_pipeline.py.

One GRPO optimizer step (rlbatch.grpo.step.run_train_step: the real loss, normalization,
megatron schedule, DDP and optimizer) of a transformers-made tiny Qwen3-MoE (4 layers, layer 1
dense: at pp 2 the first stage holds one MoE layer and the second two) on 12 random samples cut
into several micro-batches, with a large load-balancing coefficient, no clipping (the gradients
stay as the pass left them). Returns the step's metrics and every HF-named gradient (rank 0).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: step_samples
from rlbatch.config.schema import BatchingMode, RunConfig  # noqa: E402
from step_samples import random_samples  # noqa: E402

COEFF = 0.5
CASES = {  # name -> (grpo.loss_agg_mode, normalization.mode, megatron's per-token loss)
    "token": ("token-mean", "eager_global", False),
    "seq": ("seq-mean-token-mean", "deferred_global", True),
}


def make_cfg(
    hf_dir: str,
    case: str,
    pp: int = 1,
    vpp: int = 1,
    coeff: float = COEFF,
    recompute: str = "none",
) -> RunConfig:
    from rlbatch.config.enums import Recompute
    from rlbatch.engine.hf_config import resolve_model_config

    agg, mode, _ = CASES[case]
    cfg = RunConfig()
    cfg.model = resolve_model_config(replace(cfg.model, hf_path=hf_dir))[0]
    cfg.model.moe_aux_loss_coeff = coeff
    cfg.model.recompute = Recompute(recompute)
    cfg.parallel.pp, cfg.parallel.vpp = pp, vpp
    cfg.grpo.num_generations = 4
    cfg.grpo.loss_agg_mode = agg
    cfg.normalization.mode = mode
    cfg.batching.train.mode = BatchingMode.dynamic
    cfg.batching.train.max_tokens = 64  # 4-6 micro-batches
    cfg.trainer.optim.clip_grad = 0.0
    return cfg


def run_step(cfg: RunConfig, case: str) -> dict[str, Any]:
    """One optimizer step from the checkpoint: its metrics, and (rank 0) every gradient."""
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.grpo.step import run_train_step

    model = build_model(cfg, calculate_per_token_loss=CASES[case][2])
    hf.load_hf_into(model, cfg.model.hf_path)
    optimizer, scheduler = build_optimizer(cfg, model)
    samples = random_samples(12, seed=5, max_response=20)
    metrics = run_train_step(cfg, model, optimizer, scheduler, samples, step=1)
    grads = {k: v.clone() for k, v in hf.gather_full(model, cfg.model, grads=True).items()}
    return {"metrics": metrics, "grads": grads}
