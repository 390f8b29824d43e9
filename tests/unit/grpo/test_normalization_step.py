"""run_train_step on the real tiny Megatron model (single-process world): the planner, the
engine's schedule, Megatron DDP, finalize_model_grads and the Megatron optimizer.

The pre-clip grad_norm the step reports must equal the norm of the global objective's gradient
computed independently (one sample per forward, torch.autograd.grad, no rlbatch loss code):
that holds only if the deferred c/D correction is applied before the optimizer's grad-norm and
clipping. A NaN loss skips the update and names the micro-batch and rank.
"""

from __future__ import annotations

import math

import megatron.core  # noqa: F401
import pytest
import torch

from rlbatch.config.schema import BatchingMode, NormalizationMode, RunConfig  # noqa: E402
from rlbatch.grpo.types import Sample  # noqa: E402
from step_samples import random_samples


@pytest.fixture(scope="module")
def world():
    from rlbatch.engine import parallel

    if not parallel.is_initialized():
        parallel.initialize(RunConfig())
    return parallel


def make_cfg(mode: NormalizationMode, temperature: float = 1.0) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.temperature = temperature
    cfg.normalization.mode = mode
    cfg.grpo.num_generations = 4
    cfg.grpo.beta = 0.05
    cfg.grpo.num_iterations = 2  # off-policy: the samples carry old logps from an old pass
    cfg.batching.train.mode = BatchingMode.dynamic
    cfg.batching.train.max_tokens = 64
    cfg.trainer.optim.clip_grad = 1e-3  # clipping active: the reported norm is pre-clip
    return cfg


def make_samples(n: int = 16) -> list[Sample]:
    return random_samples(n, seed=3, max_response=24, off_policy=True)


def sequence_logps(gpt, sample, temperature) -> torch.Tensor:
    """float64 log-softmax of logits / temperature at every position of the sample [T, V]."""
    ids = torch.tensor([sample.input_ids])
    w = ids.shape[1]
    mask = torch.ones(w, w, dtype=torch.bool).triu_(1).view(1, 1, w, w)
    logits = gpt(ids, torch.arange(w).unsqueeze(0), mask)[0].double()
    return torch.log_softmax(logits / temperature, -1)


def reference_grad_norm(model, samples, cfg) -> tuple[float, float, list[float]]:
    """token-mean decoupled objective written directly on the unwrapped GPTModel, float64
    math: logprobs of logits / rollout.temperature, the surrogate clipped around old, times the
    truncated weight pi_old / pi_behaviour. Returns (grad norm, loss, raw weights)."""
    from rlbatch.engine.adapter import unwrap

    gpt, terms, weights = unwrap(model[0]), [], []
    lo, hi = 1 - cfg.grpo.epsilon_low, 1 + cfg.grpo.epsilon_high
    temp, cap = cfg.rollout.temperature, cfg.grpo.rollout_correction_cap
    for s in samples:
        logp, p = sequence_logps(gpt, s, temp), len(s.prompt.prompt_ids)
        for k, tok in enumerate(s.response_ids):
            lp = logp[p - 1 + k, tok]
            r, a = torch.exp(lp - s.old_logps[k]), s.advantage
            d = s.ref_logps[k] - lp
            kl = torch.exp(d) - d - 1
            raw = math.exp(s.old_logps[k] - s.behaviour_logps[k])
            weights.append(raw)
            pg = torch.maximum(-a * r, -a * r.clamp(lo, hi))
            terms.append(min(raw, cap) * pg + cfg.grpo.beta * kl)
    loss = torch.stack(terms).mean()
    grads = torch.autograd.grad(loss, [p for p in gpt.parameters()])
    return torch.cat([g.flatten() for g in grads]).norm().item(), loss.item(), weights


def one_step(world, mode, *, inject_nan=False, temperature=1.0):
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.grpo.step import run_train_step

    cfg = make_cfg(mode, temperature)
    world.seed(cfg.trainer.seed)
    model = build_model(cfg, calculate_per_token_loss=True)
    optimizer, scheduler = build_optimizer(cfg, model)
    samples = make_samples()
    ref_norm, ref_loss, weights = reference_grad_norm(model, samples, cfg)
    before = [p.detach().clone() for p in model[0].parameters()]
    metrics = run_train_step(
        cfg, model, optimizer, scheduler, samples, step=1, inject_nan=inject_nan
    )
    changed = any(not torch.equal(a, b) for a, b in zip(before, model[0].parameters(), strict=True))
    metrics["reference_weights"] = weights
    return metrics, ref_norm, ref_loss, changed


@pytest.mark.parametrize(
    ("mode", "temperature"),
    [(NormalizationMode.deferred_global, 1.0), (NormalizationMode.eager_global, 0.7)],
)
def test_step_grad_norm_and_loss_are_exact(world, mode, temperature):
    """Stale samples (old logps from an old pass, behaviour logps from an older policy): the
    step's gradient, loss and importance-weight metrics equal the float64 reference."""
    metrics, ref_norm, ref_loss, changed = one_step(world, mode, temperature=temperature)
    assert metrics["num_micro_batches"] >= 3  # dynamic batching cut the 16 samples
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert changed
    for key in ("clip_fraction", "kl", "entropy", "padding_efficiency", "dp_imbalance", "lr"):
        assert key in metrics
    assert 0 < metrics["entropy"] <= torch.log(torch.tensor(264.0)).item()
    assert metrics["tokens"] == sum(len(s.response_ids) for s in make_samples())
    weights = metrics["reference_weights"]
    cap = make_cfg(mode).grpo.rollout_correction_cap
    assert metrics["is_weight_mean"] == pytest.approx(
        sum(min(w, cap) for w in weights) / len(weights), rel=1e-6
    )
    assert metrics["is_weight_max"] == pytest.approx(max(weights), rel=1e-6)  # float32 loss
    capped = sum(w > cap for w in weights) / len(weights)
    assert 0 < capped < 1  # the cap truncates some tokens, not all
    assert metrics["is_capped_fraction"] == pytest.approx(capped, abs=1e-12)


def test_per_micro_batch_step_reports_its_bias(world):
    metrics, ref_norm, _, _ = one_step(world, NormalizationMode.per_micro_batch)
    assert metrics["pmb_weight_max"] > 1.0 > metrics["pmb_weight_min"]
    assert metrics["grad_norm"] != pytest.approx(ref_norm, rel=1e-3)


def test_nan_loss_skips_the_update_and_names_the_micro_batch(world):
    metrics, _, _, changed = one_step(world, NormalizationMode.deferred_global, inject_nan=True)
    assert metrics["nonfinite_micro_batch"] == "micro-batch 0 on rank 0"
    assert metrics["loss"] != metrics["loss"]  # NaN
    assert not changed


def policy_logps(model, samples, temperature) -> list[list[float]]:
    """float64 logps of each response token under the model as it is now (pi_old)."""
    from rlbatch.engine.adapter import unwrap

    gpt, out = unwrap(model[0]), []
    with torch.no_grad():
        for s in samples:
            logp, p = sequence_logps(gpt, s, temperature), len(s.prompt.prompt_ids)
            out.append([logp[p - 1 + k, t].item() for k, t in enumerate(s.response_ids)])
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stale_round_of_one_step_takes_pi_old_from_the_training_forward(world, temperature):
    """Samples generated ahead (num_steps_async=1) and trained in one step: no old-logprob
    pass; pi_old is the policy of the training forward. The step equals the float64 decoupled
    objective with pi_old = the model before the update, and nothing clips (ratio exactly 1)."""
    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.grpo.lcm import old_from_forward, old_pass_runs
    from rlbatch.grpo.step import run_train_step

    cfg = make_cfg(NormalizationMode.deferred_global, temperature)
    cfg.grpo.num_iterations, cfg.grpo.num_steps_async = 1, 1
    assert old_from_forward(cfg) and not old_pass_runs(cfg)
    world.seed(cfg.trainer.seed)
    model = build_model(cfg, calculate_per_token_loss=True)
    optimizer, scheduler = build_optimizer(cfg, model)
    samples = make_samples()
    for s in samples:
        s.old_logps = None  # what the loop hands over without an old pass
    reference = make_samples()
    for s, lp in zip(reference, policy_logps(model, reference, temperature), strict=True):
        s.behaviour_logps = [o - 0.9 + 0.2 * (k % 9) for k, o in enumerate(lp)]  # stale
        s.old_logps = lp
    for s, r in zip(samples, reference, strict=True):
        s.behaviour_logps = list(r.behaviour_logps)
    ref_norm, ref_loss, weights = reference_grad_norm(model, reference, cfg)
    metrics = run_train_step(cfg, model, optimizer, scheduler, samples, step=1)
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == 1.0
    cap = cfg.grpo.rollout_correction_cap
    assert metrics["is_weight_mean"] == pytest.approx(
        sum(min(w, cap) for w in weights) / len(weights), rel=1e-5
    )
    assert metrics["is_weight_max"] == pytest.approx(max(weights), rel=1e-5)
    assert 0 < metrics["is_capped_fraction"] < 1


def reference_ratios(model, samples, cfg) -> tuple[list[float], int]:
    """float64 ratios pi / pi_old of every loss token under the model as it is now, and the
    tokens where the clipped branch of max(-A r, -A clip(r)) is the active one."""
    lo, hi = 1 - cfg.grpo.epsilon_low, 1 + cfg.grpo.epsilon_high
    now = policy_logps(model, samples, cfg.rollout.temperature)
    ratios, clipped = [], 0
    for s, lps in zip(samples, now, strict=True):
        for lp, old in zip(lps, s.old_logps, strict=True):
            r = math.exp(lp - old)
            ratios.append(r)
            clipped += (s.advantage > 0 and r > hi) or (s.advantage < 0 and r < lo)
    return ratios, clipped


def test_second_step_of_a_synchronous_round_clips_against_the_generating_policy(world):
    """grpo.steps_per_generation=2, synchronous: version 0 generates the round; step 1 trains
    its first half, step 2 the second half with the policy at version 1. Step 2's pi_old is
    the generating policy (the old-logprob pass at the round's first step), so its loss and
    gradient equal the float64 objective with old = behaviour = version 0's logps, and its
    ratio moves and clips (pi_old from step 2's own forward would make it exactly 1)."""
    import copy

    from rlbatch.engine.model import build_model, build_optimizer
    from rlbatch.grpo.lcm import old_pass_runs
    from rlbatch.grpo.step import run_train_step
    from rlbatch.train.build import make_round_start

    cfg = make_cfg(NormalizationMode.deferred_global)
    cfg.grpo.num_iterations, cfg.grpo.steps_per_generation = 1, 2  # synchronous (no run-ahead)
    cfg.grpo.epsilon_low, cfg.grpo.epsilon_high = 0.02, 0.03
    cfg.trainer.optim.clip_grad, cfg.trainer.optim.lr = 1.0, 1e-2
    assert old_pass_runs(cfg)
    world.seed(cfg.trainer.seed)
    model = build_model(cfg, calculate_per_token_loss=True)
    optimizer, scheduler = build_optimizer(cfg, model)
    samples = make_samples(32)
    generating = policy_logps(model, samples, cfg.rollout.temperature)  # version 0, float64
    for s, lp in zip(samples, generating, strict=True):
        s.behaviour_logps, s.old_logps = list(lp), None  # as the rollout hands them over
    reference = copy.deepcopy(samples[16:])
    for s, lp in zip(reference, generating[16:], strict=True):
        s.old_logps = list(lp)  # the intended pi_old: the policy that generated the round

    prepared = make_round_start(cfg, model)(samples)  # the round's first step
    assert "old_logps_seconds" in prepared
    first = run_train_step(cfg, model, optimizer, scheduler, samples[:16], step=1)
    assert first["clip_fraction"] == 0.0  # step 1: pi_old is the policy being trained
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)

    ref_norm, ref_loss, weights = reference_grad_norm(model, reference, cfg)
    ratios, clipped = reference_ratios(model, reference, cfg)
    second = run_train_step(cfg, model, optimizer, scheduler, samples[16:], step=2)
    assert second["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert second["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert second["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert second["clip_fraction"] == pytest.approx(clipped / len(ratios), abs=2 / len(ratios))
    assert 0.0 < second["clip_fraction"] < 1.0 and second["ratio_std"] > 1e-3
    assert max(abs(w - 1.0) for w in weights) < 1e-5  # behaviour = pi_old: no correction
    assert second["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
