"""The guard against a LoRA run that silently does not train its adapters.

When the optimizer does not reach the adapters (they are frozen, left out of the optimizer,
or a weight sync keeps the engine on other tensors), a LoRA run goes on sampling the base model
with no error: the reward stays flat and the loss looks normal. :class:`AdapterGuard` checks the
first optimizer steps that should move the adapters (a finite, non-zero gradient norm and a
positive learning rate) and fails the run with a clear error when they did not change on any
rank. Once a step has moved them it stops checking (one copy of the adapters per checked step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

CHECKED_STEPS = 3
"""Steps with gradient that are checked at most (the first one that moves the adapters ends
the checks)."""


class AdaptersNotTrainingError(RuntimeError):
    """An optimizer step with gradient left every LoRA adapter unchanged."""


class AdapterGuard:
    """``before()`` ahead of an optimizer step, ``after(metrics, step)`` after it.
    ``any_rank(flag)``: whether ``flag`` is True on any rank (a collective: every rank calls)."""

    def __init__(self, adapters: list[torch.nn.Parameter], any_rank: Callable[[bool], bool]):
        self.adapters = adapters
        self.any_rank = any_rank
        self.checks_left = CHECKED_STEPS
        self._before: list[torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.checks_left > 0

    def before(self) -> None:
        if self.active:
            self._before = [p.detach().clone() for p in self.adapters]

    def after(self, metrics: dict[str, Any], step: int) -> None:
        if not self.active or self._before is None:
            return
        before, self._before = self._before, None
        grad_norm, lr = metrics.get("grad_norm", math.nan), metrics.get("lr", math.nan)
        should_move = (
            math.isfinite(grad_norm) and grad_norm > 0 and math.isfinite(lr) and lr > 0
        ) and "nonfinite_micro_batch" not in metrics
        if not self.any_rank(should_move):
            return
        self.checks_left -= 1
        moved = any(
            not torch.equal(p.detach(), b) for p, b in zip(self.adapters, before, strict=True)
        )
        if self.any_rank(moved):
            self.checks_left = 0
            return
        raise AdaptersNotTrainingError(
            f"step {step}: the LoRA adapters did not change in an optimizer step with gradient "
            f"norm {grad_norm:.3g} and learning rate {lr:.3g}: the optimizer does not update "
            "them, so the rollouts keep sampling the base model. Check that the adapters are "
            "trainable and in the optimizer (model.lora.rank > 0 builds them so), and that no "
            "code replaced them after the model was built."
        )
