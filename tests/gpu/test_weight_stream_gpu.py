"""The pipeline weight stream (rlbatch.rollout.weights) over NCCL: NCCL moves CUDA tensors only,
so the stream sends from and receives into tensors on the group's communication device.

One GPU: a world of one NCCL rank streams tensors made on the CPU (the sender moves them to
CUDA; a CPU tensor handed to NCCL raises). Two GPUs: rank 0 streams to rank 1, whose receive
buffers must be CUDA tensors (CPU buffers were the bug)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)

TENSORS = [
    ("model.embed_tokens.weight", torch.arange(12.0).reshape(4, 3)),
    ("model.layers.0.self_attn.q_proj.bias", torch.linspace(-1, 1, 5, dtype=torch.float64)),
    ("model.norm.weight", torch.ones(3, dtype=torch.bfloat16)),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@needs_cuda
def test_an_nccl_group_streams_on_cuda():
    from rlbatch.distributed import comm_device
    from rlbatch.rollout.weights import _stage_tensors

    port = _free_port()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        device = comm_device()
        assert device == torch.device("cuda", 0)
        got = list(_stage_tensors(iter(TENSORS), 0, dist.group.WORLD, device))
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    assert [n for n, _ in got] == [n for n, _ in TENSORS]
    for (_, want), (_, tensor) in zip(TENSORS, got, strict=True):
        assert tensor.is_cuda and tensor.dtype == want.dtype
        assert torch.equal(tensor.cpu(), want)


def _two_rank_worker(rank: int, port: int, out: str) -> None:
    from rlbatch.distributed import comm_device
    from rlbatch.rollout.weights import _stage_tensors

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        device = comm_device()
        local = iter(TENSORS) if rank == 0 else None
        got = [(n, t.device.type, t.cpu()) for n, t in _stage_tensors(local, 0, None, device)]
        torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_two_gpus
def test_a_second_rank_receives_the_stream_into_cuda_buffers(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    received = torch.load(tmp_path / "rank1.pt")
    assert [n for n, _, _ in received] == [n for n, _ in TENSORS]
    for (_, want), (_, device_type, tensor) in zip(TENSORS, received, strict=True):
        assert device_type == "cuda"
        assert tensor.dtype == want.dtype and torch.equal(tensor, want)
