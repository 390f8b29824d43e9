"""Fault injection, finite checks and heartbeat-based naming of silent ranks."""

from __future__ import annotations

import math
import time

import pytest

from rlbatch.config.schema import DebugConfig, FailKind
from rlbatch.train.health import (
    Heartbeat,
    InjectedFailure,
    NonFiniteError,
    check_finite,
    inject_fault,
    laggards,
)


def test_inject_fault_only_at_its_step_and_rank():
    debug = DebugConfig(fail_at_step=3, fail_rank=1, fail_kind=FailKind.raise_error)
    assert inject_fault(debug, 2, 1) is False and inject_fault(debug, 3, 0) is False
    with pytest.raises(InjectedFailure, match="step 3 on rank 1"):
        inject_fault(debug, 3, 1)
    assert inject_fault(DebugConfig(fail_at_step=3, fail_kind=FailKind.nan_loss), 3, 0) is True
    assert inject_fault(DebugConfig(), 3, 0) is False
    t0 = time.monotonic()
    hang = DebugConfig(fail_at_step=1, fail_kind=FailKind.hang)
    assert inject_fault(hang, 1, 0, hang_s=0.05) is False and time.monotonic() - t0 >= 0.05


def test_check_finite_names_step_micro_batch_and_rank():
    check_finite({"loss": 1.0, "grad_norm": 2.0}, step=1, rank=0)
    with pytest.raises(NonFiniteError, match=r"grad_norm=inf at step 7: micro-batch 2 on rank 3"):
        check_finite(
            {
                "loss": 1.0,
                "grad_norm": math.inf,
                "nonfinite_micro_batch": "micro-batch 2 on rank 3",
            },
            step=7,
            rank=0,
        )
    with pytest.raises(NonFiniteError, match="loss=nan at step 1: rank 0"):
        check_finite({"loss": math.nan}, step=1, rank=0)


def test_laggards_names_the_hung_rank_only(tmp_path):
    for rank, (step, phase) in enumerate([(3, "agree"), (3, "batch"), (3, "agree"), (4, "batch")]):
        Heartbeat(tmp_path, rank).beat(step, phase)
    behind = laggards(tmp_path, 5, 3, "agree")
    assert len(behind) == 2
    assert behind[0].startswith("rank 1 (last seen step 3 batch")
    assert behind[1] == "rank 4 (no heartbeat)"
