"""An MoE policy's load-balancing loss in run_train_step on the real tiny Qwen3-MoE (megatron
model, schedule, DDP, optimizer; single process): the step's loss, grad norm and
moe/aux_loss do not depend on how batching.train.max_tokens cuts the mini-batch into
micro-batches, and moe/aux_loss equals a float64 computation from the routers' inputs (the
Switch balance loss per sample over its own tokens, padding excluded, token-weighted like
the token-mean policy loss)."""

from __future__ import annotations

import megatron.core  # noqa: F401
import pytest
import torch

from rlbatch.config.schema import Architecture, BatchingMode, RunConfig
from rlbatch.grpo.types import Sample
from step_samples import random_samples


@pytest.fixture(scope="module")
def world():
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        parallel.initialize(RunConfig())
    return parallel


def make_cfg(max_tokens: int, coeff: float, capacity: float | None = None) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.architecture, m.num_layers, m.hidden_size = Architecture.qwen3_moe, 2, 32
    m.num_attention_heads, m.num_query_groups, m.head_dim = 4, 2, 8
    m.ffn_hidden_size, m.vocab_size, m.qk_layernorm = 64, 264, True
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 16
    m.moe_aux_loss_coeff, m.moe_expert_capacity_factor = coeff, capacity
    cfg.grpo.num_generations = 4
    cfg.batching.train.mode = BatchingMode.dynamic
    cfg.batching.train.max_tokens = max_tokens
    return cfg


def make_samples(n: int = 12) -> list[Sample]:
    return random_samples(n, seed=5, max_response=20)


def reference_aux(gpt, samples: list[Sample], topk: int) -> float:
    """float64 from the routers' inputs, one sample per forward: per MoE layer
    E * sum_e f_e * P_e over the sample's tokens, averaged over layers, then weighted by the
    sample's loss tokens (token-mean)."""
    inputs: list[torch.Tensor] = []
    routers = [layer.mlp.router for layer in gpt.decoder.layers]
    hooks = [r.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for r in routers]
    total = weight = 0.0
    try:
        with torch.no_grad():
            for s in samples:
                inputs.clear()
                ids = torch.tensor([s.input_ids])
                w = ids.shape[1]
                mask = torch.ones(w, w, dtype=torch.bool).triu_(1).view(1, 1, w, w)
                gpt(ids, torch.arange(w).unsqueeze(0), mask)
                per_layer = []
                for router, hidden in zip(routers, inputs, strict=True):
                    logits = hidden.reshape(w, -1).double() @ router.weight.double().t()
                    probs = torch.softmax(logits, -1)  # [w, E]
                    experts = probs.shape[1]
                    counts = [0.0] * experts
                    for row in logits.topk(topk, -1).indices.tolist():
                        for e in row:
                            counts[e] += 1.0
                    f = [c / (w * topk) for c in counts]
                    p_mean = probs.mean(0).tolist()
                    per_layer.append(experts * sum(a * b for a, b in zip(f, p_mean, strict=True)))
                total += len(s.response_ids) * sum(per_layer) / len(per_layer)
                weight += len(s.response_ids)
    finally:
        for h in hooks:
            h.remove()
    return total / weight


def one_step(
    world, max_tokens: int, coeff: float, capacity: float | None = None
) -> tuple[dict, float]:
    from rlbatch.engine.adapter import unwrap
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.grpo.step import run_train_step

    cfg = make_cfg(max_tokens, coeff, capacity)
    world.seed(cfg.trainer.seed)
    model = build_model(cfg, calculate_per_token_loss=True)
    optimizer, scheduler = build_optimizer(cfg, model)
    reference = reference_aux(unwrap(model[0]), make_samples(), cfg.model.moe_router_topk)
    metrics = run_train_step(cfg, model, optimizer, scheduler, make_samples(), step=1)
    return metrics, reference


def test_balance_loss_is_the_same_however_the_step_is_cut(world):
    small, reference = one_step(world, 48, 0.5)
    large, _ = one_step(world, 512, 0.5)
    assert small["num_micro_batches"] > large["num_micro_batches"]
    assert 1.0 <= small["moe/aux_loss"] <= 2.0  # 1 = balanced, E / k = 2 at worst
    assert small["moe/aux_loss"] == pytest.approx(reference, rel=1e-6)
    for key in ("moe/aux_loss", "loss", "grad_norm"):
        assert small[key] == pytest.approx(large[key], rel=1e-6), key
    without, _ = one_step(world, 48, 0.0)  # the metric is there, the gradient term is not
    assert without["moe/aux_loss"] == pytest.approx(small["moe/aux_loss"], rel=1e-6)
    assert abs(without["grad_norm"] - small["grad_norm"]) > 1e-4 * small["grad_norm"]
    assert small["loss"] == pytest.approx(without["loss"] + 0.5 * small["moe/aux_loss"], rel=1e-5)


def test_balance_loss_counts_the_routers_choice_before_a_capacity_factor_drops(world):
    """A capacity factor drops the overflowing experts' assignments from the dispatch, not from
    the balance loss: its f_e counts the router's own top-k, so the loss still sees (and
    penalizes) the load the router asked for."""
    free, reference = one_step(world, 512, 0.5)
    capped, _ = one_step(world, 512, 0.5, capacity=0.5)
    # half the fair share drops assignments: the dispatch, and so the policy loss, changed
    assert abs(capped["grad_norm"] - free["grad_norm"]) > 1e-5 * free["grad_norm"]
    assert capped["moe/aux_loss"] == pytest.approx(reference, rel=1e-6)
    assert capped["moe/aux_loss"] == pytest.approx(free["moe/aux_loss"], rel=1e-6)
