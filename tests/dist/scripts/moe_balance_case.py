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
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: step_samples
from rlbatch.config.schema import BatchingMode, RunConfig  # noqa: E402
from step_samples import random_samples  # noqa: E402

COEFF = 0.5
CASES = {  # name -> (grpo.loss_agg_mode, normalization.mode, megatron's per-token loss)
    "token": ("token-mean", "eager_global", False),
    "seq": ("seq-mean-token-mean", "deferred_global", True),
}
REPLAY_CASES = {  # name -> (the objective of CASES, grpo.routing_replay)
    "r3": ("token", "r3"),
    "r2": ("seq", "r2"),
}
NUM_SAMPLES = 12


def step_samples() -> list[Any]:
    return random_samples(NUM_SAMPLES, seed=5, max_response=20)


def perturbed_routing(hf_dir: str, noise: float = 0.4) -> list[Any]:
    """What the replay cases replay: per sample ``[length, 3, 2]`` int8, transformers' top-2
    experts of every token at the 3 sparse layers of the checkpoint with its routers perturbed
    (noise x N(0, 1) added to weights of std 0.5): the weights the routing was recorded with
    moved since, so the trainer's routers would choose differently for many tokens."""
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, experts_implementation="eager", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(noise * torch.randn_like(p))
        out = []
        for s in step_samples():
            ids = torch.tensor([s.input_ids])
            logits = model(input_ids=ids, output_router_logits=True).router_logits
            top = torch.stack([x.topk(2, dim=-1).indices for x in logits], 1)  # [len, 3, 2]
            out.append(top.numpy().astype(np.int8))
    return out


def make_cfg(
    hf_dir: str,
    case: str,
    pp: int = 1,
    vpp: int = 1,
    coeff: float = COEFF,
    recompute: str = "none",
    tp: int = 1,
) -> RunConfig:
    from rlbatch.config.enums import Recompute, RoutingReplay
    from rlbatch.engine.hf_config import resolve_model_config

    case, replay = REPLAY_CASES.get(case, (case, "none"))
    agg, mode, _ = CASES[case]
    cfg = RunConfig()
    cfg.model = resolve_model_config(replace(cfg.model, hf_path=hf_dir))[0]
    cfg.model.moe_aux_loss_coeff = coeff
    cfg.model.recompute = Recompute(recompute)
    cfg.parallel.pp, cfg.parallel.vpp = pp, vpp
    cfg.parallel.tp, cfg.parallel.sequence_parallel = tp, tp > 1  # MoE at tp > 1 needs it
    cfg.grpo.num_generations = 4
    cfg.grpo.loss_agg_mode = agg
    cfg.normalization.mode = mode
    cfg.batching.train.mode = BatchingMode.dynamic
    cfg.batching.train.max_tokens = 64  # 4-6 micro-batches
    cfg.trainer.optim.clip_grad = 0.0
    cfg.grpo.routing_replay = RoutingReplay(replay)
    return cfg


def record_old_routing(cfg: RunConfig) -> list[Any]:
    """grpo.routing_replay=r2's record: the old-logprob pass (rlbatch.grpo.stages.make_logps_fn,
    the real pass the step runs before training) over the step's samples, each sample's
    ``old_routing`` (``[length, 3, 2]``)."""
    from rlbatch.config.enums import RoutingReplay
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_model
    from rlbatch.grpo.stages import make_logps_fn

    cfg.grpo.routing_replay = RoutingReplay.r2
    model = build_model(cfg)
    hf.load_hf_into(model, cfg.model.hf_path)
    samples = step_samples()
    make_logps_fn(model, cfg, old_pass=True)(samples)
    return [s.old_routing for s in samples]


def run_step(cfg: RunConfig, case: str, routing: Optional[list[Any]] = None) -> dict[str, Any]:
    """One optimizer step from the checkpoint: its metrics, and (rank 0) every gradient. A
    replay case replays ``routing`` (:func:`perturbed_routing`): r3 as the rollout's (the
    last token never fed: unknown), r2 as the old-logprob pass's; ``mismatch`` counts, per
    sparse layer, the tokens with rollout routing and those the routers would route elsewhere
    (rlbatch.engine.routing.mismatch_counts, this rank's layers)."""
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.grpo.step import RoutingMismatch, run_train_step

    case, replay = REPLAY_CASES.get(case, (case, "none"))
    model = build_model(cfg, calculate_per_token_loss=CASES[case][2])
    hf.load_hf_into(model, cfg.model.hf_path)
    optimizer, scheduler = build_optimizer(cfg, model)
    samples = step_samples()
    if replay != "none":
        assert routing is not None
        for s, arr in zip(samples, routing, strict=True):
            if replay == "r3":
                s.routing = arr.copy()
                s.routing[-1] = -1
            else:
                s.old_routing = arr
    mismatch = RoutingMismatch(3, 2)
    metrics = run_train_step(
        cfg, model, optimizer, scheduler, samples, step=1, routing_mismatch=mismatch
    )
    grads = {k: v.clone() for k, v in hf.gather_full(model, cfg.model, grads=True).items()}
    return {"metrics": metrics, "grads": grads, "mismatch": mismatch.take()}
