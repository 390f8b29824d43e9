"""grpo.routing_replay=r2 in run_train_step on the real tiny Qwen3-MoE (megatron model,
schedule, DDP, optimizer; single process): the training forward replays each sample's
``old_routing`` (the old-logprob pass's record). The experts moved after that record (the
weights the old pass saw are not the ones that train), and the record is not what the routers
now pick: with r2 the training forward's log-probs (read where the real loss receives them,
over several micro-batches) equal transformers' float64 forward of the same weights with the
recorded experts forced, on every response token; without replay they do not (free routing)."""

from __future__ import annotations

import megatron.core  # noqa: F401
import numpy as np
import pytest
import torch

from hf_reference import moe_reference, moe_reference_replayed
from rlbatch.config.enums import RolloutCorrection
from rlbatch.config.schema import Architecture, BatchingMode, RoutingReplay, RunConfig
from rlbatch.grpo.types import Sample
from step_samples import random_samples

EXPERTS, TOPK, LAYERS = 4, 2, 2


@pytest.fixture(scope="module")
def world():
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        parallel.initialize(RunConfig())
    return parallel


def make_cfg(mode: RoutingReplay) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.architecture, m.num_layers, m.hidden_size = Architecture.qwen3_moe, LAYERS, 32
    m.num_attention_heads, m.num_query_groups, m.head_dim = 4, 2, 8
    m.ffn_hidden_size, m.vocab_size, m.qk_layernorm = 64, 264, True
    m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = EXPERTS, TOPK, 16
    cfg.grpo.num_generations = 4
    cfg.grpo.routing_replay = mode
    cfg.grpo.num_iterations = 2  # rounds of 2 steps: pi_old is the old pass's (sample.old_logps)
    cfg.grpo.rollout_correction = RolloutCorrection.token_tis
    cfg.rollout.temperature = 1.0
    cfg.batching.train.mode = BatchingMode.dynamic
    cfg.batching.train.max_tokens = 64  # several micro-batches: the relayout per micro-batch
    return cfg


def recorded_routing(samples: list[Sample]) -> list[np.ndarray]:
    """An old pass's record per sample: [length, MoE layers, k] distinct experts per token."""
    g = torch.Generator().manual_seed(3)
    out = []
    for s in samples:
        n = len(s.input_ids)
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n * LAYERS)])
        out.append(ids.view(n, LAYERS, TOPK).numpy().astype(np.int8))
    return out


def moved_model(world, cfg: RunConfig) -> list:
    """The seeded model, its experts moved away from their initialisation (the update between
    the old pass and this step; large enough that the expert choice shows in the log-probs)."""
    from rlbatch.engine.adapter import unwrap
    from rlbatch.engine.model import build_model

    world.seed(cfg.trainer.seed)
    model = build_model(cfg, calculate_per_token_loss=True)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in unwrap(model[0]).named_parameters():
            if ".experts." in name or "router" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def response_logps(per_token: list[list[float]], samples: list[Sample]) -> list[list[float]]:
    return [row[len(s.prompt.prompt_ids) - 1 :] for row, s in zip(per_token, samples, strict=True)]


def train_step(world, mode: RoutingReplay, tmp_path, monkeypatch) -> tuple[dict, list, list]:
    """One step with old_logps = transformers' float64 forward of the moved weights with the
    recorded experts forced. Returns the step's metrics, each sample's response log-probs as
    the training forward computed them (read where the loss receives them), and the
    references: (forced, free) per sample."""
    import rlbatch.grpo.loss as loss_module
    from rlbatch.engine import hf
    from rlbatch.engine.model import build_optimizer
    from rlbatch.grpo.step import run_train_step

    cfg = make_cfg(mode)
    model = moved_model(world, cfg)
    optimizer, scheduler = build_optimizer(cfg, model)
    samples = random_samples(12, seed=5, max_response=20)
    routing = recorded_routing(samples)
    path = tmp_path / mode.value
    hf.export_hf(model, cfg.model, path)
    rows = [s.input_ids for s in samples]
    forced = response_logps(
        moe_reference_replayed(path, rows, [r.tolist() for r in routing]), samples
    )
    free = response_logps(moe_reference(path, rows)[0], samples)
    for s, r, logps in zip(samples, routing, forced, strict=True):
        s.old_routing, s.old_logps = r, logps

    trained: list[list[float]] = [[] for _ in samples]
    real = loss_module.loss_from_logps

    def observed(logps, batch, settings, **kwargs):  # the real loss, its input recorded
        assert batch.micro_batch is not None
        owners = [batch.micro_batch.samples[i] for i in batch.seq_index[batch.loss_mask].tolist()]
        for owner, value in zip(owners, logps.detach().tolist(), strict=True):
            trained[owner].append(value)
        return real(logps, batch, settings, **kwargs)

    monkeypatch.setattr(loss_module, "loss_from_logps", observed)
    metrics = run_train_step(cfg, model, optimizer, scheduler, samples, step=1)
    return metrics, trained, [forced, free]


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def test_r2_training_forward_replays_the_old_pass_routing(world, tmp_path, monkeypatch):
    metrics, trained, (forced, free) = train_step(world, RoutingReplay.r2, tmp_path, monkeypatch)
    assert metrics["num_micro_batches"] > 1  # the record laid out per micro-batch
    assert _max_gap(forced, free) > 1e-2  # the record is not the routers' own choice
    # every response token: the forced-expert reference (fp32 forward vs float64)
    assert _max_gap(trained, forced) <= 1e-5
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # every ratio within 1e-5 of 1: so is their spread (float64 sums; fp32 ones read 2e-4 here)
    assert metrics["ratio_std"] < 1e-5
    assert metrics["clip_fraction"] == 0.0


def test_without_replay_the_training_forward_routes_freely(world, tmp_path, monkeypatch):
    metrics, trained, (forced, _) = train_step(world, RoutingReplay.none, tmp_path, monkeypatch)
    assert _max_gap(trained, forced) > 1e-2
    assert metrics["clip_fraction"] > 0  # pi_theta / pi_old leaves the clip range on some tokens
