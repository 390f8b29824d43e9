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


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cuda"), ("mpi", "cpu")],
)
def test_the_communication_device_follows_the_backend(backend, device):
    """NCCL moves CUDA tensors only, gloo CPU tensors: buffers sent or received over a group
    are allocated on its backend's device (the pipeline weight stream's buffers once lived on
    the CPU whatever the backend)."""
    assert distributed.device_for_backend(backend) == torch.device(device)


def test_a_gloo_world_communicates_on_the_cpu(megatron_world):
    from megatron.core import parallel_state as ps

    assert distributed.comm_device() == torch.device("cpu")
    assert distributed.comm_device(ps.get_pipeline_model_parallel_group()).type == "cpu"


def test_the_pipeline_stream_sends_and_receives_on_the_groups_device(megatron_world):
    """A stage's tensors go over the group on its communication device: the sender's tensor
    is moved there (a CPU tensor over NCCL would fail), in order, with names, and the stage's
    end is announced (the stream stops)."""
    import torch.distributed as dist

    from rlbatch.rollout.weights import _stage_tensors

    sent = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(4).double())]
    device = distributed.comm_device()
    got = list(_stage_tensors(iter(sent), 0, dist.group.WORLD, device))
    assert [name for name, _ in got] == ["a.weight", "b.bias"]
    for (_, want), (_, tensor) in zip(sent, got, strict=True):
        assert tensor.device == device and tensor.dtype == want.dtype
        assert torch.equal(tensor, want)


def test_a_call_on_the_groups_first_rank_returns_or_raises_there_alone(megatron_world):
    """In a group of one the first rank is this rank: the call's result comes back, and its
    error is raised (in larger groups the same outcome reaches every rank: the vLLM e2e
    tests at tp 2)."""

    def fail() -> None:
        raise ValueError("boom")

    assert distributed.from_first_in_model_parallel_group(lambda: [1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="boom"):
        distributed.from_first_in_model_parallel_group(fail)
