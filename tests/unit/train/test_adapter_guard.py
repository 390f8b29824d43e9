"""The LoRA guard: an optimizer step with gradient that leaves every adapter unchanged fails
the run with a clear error; steps that cannot move them (zero gradient, zero learning rate
during warm-up, a skipped non-finite step) are not held against it; a step that moves them
ends the checks."""

from __future__ import annotations

import pytest
import torch

from rlbatch.train.adapter_guard import CHECKED_STEPS, AdapterGuard, AdaptersNotTrainingError

MOVING = {"grad_norm": 0.5, "lr": 1e-3}


def _guard():
    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(2, 3))]
    return params, AdapterGuard(params, any_rank=lambda flag: flag)


def test_unchanged_adapters_after_a_step_with_gradient_fail_the_run():
    params, guard = _guard()
    guard.before()
    # a step that "ran" with gradient while the optimizer held other tensors
    with pytest.raises(AdaptersNotTrainingError, match="step 1: the LoRA adapters did not"):
        guard.after(dict(MOVING), step=1)


@pytest.mark.parametrize(
    "metrics",
    [
        {"grad_norm": 0.0, "lr": 1e-3},
        {"grad_norm": 0.5, "lr": 0.0},
        {"grad_norm": float("nan"), "lr": 1e-3},
        {**MOVING, "nonfinite_micro_batch": "gradients"},
    ],
    ids=["no_gradient", "warmup_lr_0", "nan_norm", "skipped"],
)
def test_steps_that_cannot_move_the_adapters_are_not_checked(metrics):
    _, guard = _guard()
    for step in range(1, 2 * CHECKED_STEPS):
        guard.before()
        guard.after(dict(metrics), step=step)
    assert guard.checks_left == CHECKED_STEPS


def test_a_step_that_moves_the_adapters_ends_the_checks():
    params, guard = _guard()
    guard.before()
    with torch.no_grad():
        params[1][0, 0] += 1e-3
    guard.after(dict(MOVING), step=1)
    assert not guard.active
    guard.before()
    guard.after(dict(MOVING), step=2)  # unchanged now, no longer checked


def test_another_rank_that_moved_its_adapters_counts():
    params = [torch.nn.Parameter(torch.ones(2))]
    guard = AdapterGuard(params, any_rank=lambda flag: True)  # some rank says yes
    guard.before()
    guard.after(dict(MOVING), step=1)
    assert not guard.active
