"""rlbatch.distributed in one process: identities, one collective for many values."""

# ruff: noqa: F811  (pytest fixtures imported from engine_helpers)

from __future__ import annotations

import pytest
import torch
from engine_helpers import megatron_world  # noqa: F401

from rlbatch import distributed


def test_single_process_identities(megatron_world):
    a, b = distributed.all_reduce_sum([torch.ones(2, 3), 2.5])
    assert a.shape == (2, 3) and float(b) == 2.5
    assert distributed.all_reduce_floats([1.0, 2.0]) == [1.0, 2.0]
    assert distributed.reduce_step(torch.tensor([3.0], dtype=torch.float64)).tolist() == [3.0]
    assert distributed.all_gather_object({"x": 1}) == [{"x": 1}]
    assert (distributed.dp_rank(), distributed.dp_size(), distributed.pp_size()) == (0, 1, 1)
    distributed.check_same_across_ranks([1, 2, 3], "plan")
    ops = distributed.WorldDist()
    assert (ops.rank, ops.world_size) == (0, 1)
    assert ops.all_reduce_sum([4.0]) == [4.0]


def test_broadcast_from_last_stage_single_stage():
    t = torch.arange(3)
    assert distributed.broadcast_from_last_stage(t, (3,), t.dtype) is t
    with pytest.raises(AssertionError):
        distributed.broadcast_from_last_stage(None, (3,), torch.float32)
