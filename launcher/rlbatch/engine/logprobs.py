"""Chunked logprob passes: forward-only over an infer plan, per-token logprobs in sample order.

    logps = compute_logprobs(model, sequences, plan, round_to=r)
    logps[i][j] == log p(sequences[i][j+1] | sequences[i][:j+1])      # len n_i - 1

Logits exist for one micro-batch at a time (``[R, S, V/tp]``), never for the whole batch.
With tp > 1 the log-softmax is vocab-parallel (megatron's vocab_parallel_cross_entropy, and a
vocab-parallel entropy). The result is on every rank: broadcast from the last pipeline stage,
and gathered over DP when the plan spreads the samples over the DP ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from rlbatch import distributed
from rlbatch.batching.plan import MicroBatch, PassPlan
from rlbatch.engine import schedule


def _tp_group() -> tuple[int, Any]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, None
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` (the same tensor at temperature 1): the distribution the
    rollout sampled from, which every logprob the GRPO loss compares must use."""
    return logits / temperature if temperature != 1.0 else logits


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    inplace: bool = False,
) -> torch.Tensor:
    """log p_T(label) per position from (vocab-parallel) logits ``[..., V/tp]``, differentiable:
    the one implementation of the train, reference and old passes.

    With tp == 1 and float64 logits (or no process group) it is ``log_softmax`` in float64
    (exactness checks); otherwise megatron's ``vocab_parallel_cross_entropy`` in float32, which
    subtracts the row max from its input in place: the input is copied first unless
    ``inplace`` (the train pass: the logits are not read afterwards, and a per-row shift changes
    neither logprobs nor entropy)."""
    import torch.distributed as dist

    x = scale_logits(logits, temperature)
    if _tp_group()[0] == 1 and (x.dtype == torch.float64 or not dist.is_initialized()):
        return torch.log_softmax(x, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = x.float()
    if x is logits and not inplace:
        x = x.clone()
    return -vocab_parallel_cross_entropy(x.contiguous(), labels)


def token_entropy(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the full (tp-sharded) vocabulary per row
    of ``[..., V/tp]``; float64 logits stay float64, others are computed in float32.
    Differentiable when grad is enabled (the entropy bonus): the row max is a constant shift
    (detached) and with tp > 1 the shard sums are reduced by megatron's autograd-aware
    all-reduce (backward: identity, the gradient of a sum over shards)."""
    import torch.distributed as dist

    x = scale_logits(logits, temperature)
    x = x if x.dtype == torch.float64 else x.float()
    size, group = _tp_group()
    m = x.detach().max(dim=-1, keepdim=True).values
    if size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m)
    sums = torch.stack([e.sum(-1), (e * x).sum(-1)])
    if size > 1:
        if sums.requires_grad:
            from megatron.core.tensor_parallel.mappings import (
                reduce_from_tensor_model_parallel_region,
            )

            sums = reduce_from_tensor_model_parallel_region(sums)
        else:
            dist.all_reduce(sums, group=group)
    z, ex = sums[0], sums[1]
    return torch.log(z) + m.squeeze(-1) - ex / z


def forward_logits(
    model: Any,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs: Any,
) -> torch.Tensor:
    """Logits [B, S, V/tp] of one forward for pp == 1 (generation, scoring). ``attention_mask``
    is bool [B, 1, S, S], True = masked (pass an explicit one on CPU: megatron builds its default
    causal mask on "cuda"); ``schedule.causal_mask(S)[None, None]`` is the plain causal one.
    With tp > 1 the vocabulary is sharded (gather with
    megatron.core.tensor_parallel.gather_from_tensor_model_parallel_region, or use the
    vocab-parallel helpers here). With pp > 1 use run_pass / compute_logprobs (docs/engine.md)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1 or distributed.pp_size() != 1:
        raise NotImplementedError(
            "forward_logits is for pp == 1; with pipeline parallelism run the schedule "
            "(rlbatch.engine.schedule.run_pass / logprobs.compute_logprobs)"
        )
    return chunks[0](tokens, position_ids, attention_mask, **kwargs)


def compute_logprobs(
    model: Sequence[Any],
    sequences: Sequence[Sequence[int]],
    plan: PassPlan,
    *,
    round_to: Optional[int] = None,
    entropy: bool = False,
    temperature: float = 1.0,
    on_micro_batch: Optional[Any] = None,
) -> Any:
    """Per-token logprobs (float32 tensors, ``len(sequences[i]) - 1`` each, in sample order)
    of every sample of ``plan`` (an infer plan over ``[len(s) for s in sequences]``); with
    ``entropy`` also per-token entropies: returns ``(logps, entropies)``.

    ``plan.dp`` == the DP size: each DP rank runs its own share and the results are gathered;
    ``plan.dp == 1``: every DP rank runs the whole plan. ``on_micro_batch(mb)``: called on every
    rank when the schedule pulls a micro-batch (progress bars). Logits are divided by ``temperature``."""
    dp_rank = distributed.dp_rank() if plan.dp > 1 else 0
    if plan.dp > 1 and plan.dp != distributed.dp_size():
        raise ValueError(f"plan for dp={plan.dp} on a run with dp={distributed.dp_size()}")
    rank_plan = plan.for_rank(dp_rank)
    results: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    def batch_fn(mb: MicroBatch) -> schedule.MicroBatchInputs:
        if on_micro_batch is not None:
            on_micro_batch(mb)
        return schedule.make_inputs([sequences[i] for i in mb.samples], mb, round_to=round_to)

    def loss_fn(output: torch.Tensor, inputs: schedule.MicroBatchInputs):
        with torch.no_grad():
            assert inputs.labels is not None
            ents = token_entropy(output, temperature=temperature) if entropy else None
            logps = token_logprobs(output, inputs.labels, temperature=temperature)  # [R, S]
            for seg, i in zip(inputs.segments, inputs.micro_batch.samples, strict=True):
                cut = slice(seg.start, seg.start + seg.length - 1)
                results[i] = (
                    logps[seg.row, cut].detach().clone(),
                    ents[seg.row, cut].detach().clone() if ents is not None else None,
                )
        return torch.zeros((), device=output.device), {}

    with torch.no_grad():
        schedule.run_pass(model, rank_plan, plan, batch_fn, loss_fn, forward_only=True)
    mine = {i: (lp.cpu(), None if en is None else en.cpu()) for i, (lp, en) in results.items()}
    mine = distributed.broadcast_object_from_last_stage(mine)
    if plan.dp > 1:
        merged: dict[int, Any] = {}
        for share in distributed.dp_gather_object(mine):
            merged.update(share)
        mine = merged
    missing = [i for i in range(len(sequences)) if i not in mine and len(sequences[i]) > 0]
    if missing:
        raise ValueError(f"samples {missing[:10]} are in no micro-batch of the plan")
    empty = torch.zeros(0)
    logps = [mine[i][0] if i in mine else empty for i in range(len(sequences))]
    if not entropy:
        return logps
    return logps, [mine[i][1] if i in mine else empty for i in range(len(sequences))]
