"""The policy's weights as a stream of Hugging Face-named full tensors, for an engine that holds
the whole model (vLLM): one tensor at a time, never the whole model at once on any rank.

Every rank of a model-parallel group (tp x pp) gets every tensor: tensor-parallel shards are
gathered over tp (rlbatch.engine.hf.iter_full_tensors, the mapping the HF export uses), and
each pipeline stage in turn broadcasts its layers over pp. Data-parallel replicas stream
independently (their weights are equal). An MoE model's routed experts are spread over the
expert-parallel ranks (carved out of the data-parallel ones): each expert tensor is gathered
over the expert-parallel group, so every replica streams every expert under its released
per-expert name (``model.layers.N.mlp.experts.E.*``, E global). A tied model also yields ``lm_head.weight`` (the
embedding): engines that keep their own copy of the output layer need it.

A LoRA model's adapters travel on their own (:func:`stream_adapters`: PEFT-named full factors),
for an engine that applies them itself; its base weights then go once, with the adapters
switched off (every base weight is frozen under LoRA).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlbatch.config.schema import ModelConfig

TIED_HEAD = "lm_head.weight"


def _local_tensors(chunks: list[Any], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from rlbatch.engine.hf import iter_full_tensors, with_every_expert

    for chunk in chunks:
        if cfg.num_moe_experts is None:
            yield from iter_full_tensors(chunk, cfg)
        else:
            yield from with_every_expert(iter_full_tensors(chunk, cfg), cfg.num_moe_experts)


def stream_hf_weights(model: Any, model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every weight of the model, on every rank of this rank's
    model-parallel group (collective over tp and pp, and for an MoE model over the
    expert-parallel group: every rank of these groups iterates to the end in step)."""
    from rlbatch.distributed import pipeline_stage
    from rlbatch.engine.hf import _chunks, full_model_config

    chunks = _chunks(model)
    cfg = full_model_config(chunks, model_cfg)
    rank, size, group = pipeline_stage()
    if size == 1:
        stream: Iterator[tuple[str, torch.Tensor]] = _local_tensors(chunks, cfg)
    else:
        stream = _pipeline_stream(lambda: _local_tensors(chunks, cfg), rank, size, group)
    for name, tensor in stream:
        yield name, tensor
        if cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
            yield TIED_HEAD, tensor


def stream_adapters(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of every LoRA factor of the model (rlbatch.engine.lora.peft_name:
    A [r, in], B [out, r]), on every rank of this rank's model-parallel group (collective over
    tp and pp, as :func:`stream_hf_weights`)."""
    from rlbatch.distributed import pipeline_stage
    from rlbatch.engine.hf import _chunks
    from rlbatch.engine.lora import full_adapters

    chunks = _chunks(model)
    rank, size, group = pipeline_stage()
    if size == 1:
        yield from full_adapters(chunks).items()
        return
    yield from _pipeline_stream(lambda: iter(full_adapters(chunks).items()), rank, size, group)


def _pipeline_stream(
    local_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    rank: int,
    size: int,
    group: Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage 0's tensors, then stage 1's, ...: the owner (which iterates ``local_tensors()``)
    sends each tensor's name, shape and dtype, then the tensor, over the pipeline group, on that
    group's communication device (CUDA for nccl, the CPU for gloo)."""
    from rlbatch.distributed import comm_device

    device = comm_device(group)
    for stage in range(size):
        local = local_tensors() if stage == rank else None
        yield from _stage_tensors(local, dist.get_global_rank(group, stage), group, device)


def _stage_tensors(
    local: Optional[Iterator[tuple[str, torch.Tensor]]],
    source: int,
    group: Any,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One stage's tensors from global rank ``source`` (which passes ``local``, its own
    tensors; the others pass None) to every rank of ``group``: sent from and received into
    tensors on ``device``, which the group's backend must be able to move."""
    while True:
        item = next(local, None) if local is not None else None
        header: list[Any] = [None]
        if item is not None:
            header = [(item[0], tuple(item[1].shape), item[1].dtype)]
        dist.broadcast_object_list(header, src=source, group=group)
        if header[0] is None:
            return
        name, shape, dtype = header[0]
        if item is not None:
            tensor = item[1].to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=source, group=group)
        yield name, tensor
