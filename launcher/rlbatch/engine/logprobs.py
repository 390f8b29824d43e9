"""Chunked logprob passes: forward-only over an infer plan, per-token logprobs in sample order.

    logps = compute_logprobs(model, sequences, plan, round_to=r)
    logps[i][j] == log p(sequences[i][j+1] | sequences[i][:j+1])      # len n_i - 1

Only scored positions are projected to the vocabulary, ``model.logits_chunk_tokens`` at a time
(rlbatch.engine.lm_head); with chunking off, logits exist for one micro-batch at a time
(``[R, S, V/tp]``), never for the whole batch. With tp > 1 the log-softmax is vocab-parallel
(megatron's vocab_parallel_cross_entropy, and a vocab-parallel entropy). The result is on every rank: broadcast from the last pipeline stage,
and gathered over DP when the plan spreads the samples over the DP ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from rlbatch import distributed
from rlbatch.batching.plan import MicroBatch, PassPlan
from rlbatch.engine import routing, schedule
from rlbatch.engine.lm_head import scale_logits, token_entropy, token_logprobs

__all__ = ["compute_logprobs", "forward_logits", "scale_logits", "token_entropy", "token_logprobs"]


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
    score_from: Optional[Sequence[int]] = None,
    score_mask: Optional[Sequence[Sequence[int]]] = None,
    replay: Optional[Sequence[Any]] = None,
    record: Optional[dict[int, Any]] = None,
) -> Any:
    """Per-token logprobs (float32 tensors, ``len(sequences[i]) - 1`` each, in sample order)
    of every sample of ``plan`` (an infer plan over ``[len(s) for s in sequences]``); with
    ``entropy`` also per-token entropies: returns ``(logps, entropies)``.

    ``score_from[i]``: the first scored position of sample i (e.g. ``len(prompt) - 1``: the
    response tokens only); ``logps[i]`` then holds the ``len(sequences[i]) - 1 - score_from[i]``
    values from there, and positions before it are never projected to the vocabulary.
    ``score_mask[i]``: 0/1 per value from ``score_from[i]`` on (e.g. a multi-turn sample's
    loss mask: observation tokens 0); the positions of a 0 are not projected either and hold 0.0
    (and entropy 0.0) in the result, so every sample keeps one value per scored position.
    ``plan.dp`` == the DP size: each DP rank runs its own share and the results are gathered;
    ``plan.dp == 1``: every DP rank runs the whole plan. ``on_micro_batch(mb)``: called on every
    rank when the schedule pulls a micro-batch (progress bars). Logits are divided by ``temperature``.

    MoE policies (rlbatch.engine.routing): ``replay[i]``, sample i's ``[length, num_moe_layers,
    k]`` routing (or None), is replayed by every router; ``record`` (a dict) receives each
    sample's routing as this pass's routers chose it, every pipeline stage's layers merged, on
    every rank (``plan.dp == 1`` only)."""
    dp_rank = distributed.dp_rank() if plan.dp > 1 else 0
    if plan.dp > 1 and plan.dp != distributed.dp_size():
        raise ValueError(f"plan for dp={plan.dp} on a run with dp={distributed.dp_size()}")
    if record is not None and plan.dp > 1:
        raise ValueError("compute_logprobs(record=...) needs a plan with dp = 1")
    shape = _routing_shape(model) if replay is not None or record is not None else None
    scoring = _Scoring(
        sequences,
        first=list(score_from) if score_from is not None else [0] * len(sequences),
        score_mask=score_mask,
        temperature=temperature,
        entropy=entropy,
        round_to=round_to,
        on_micro_batch=on_micro_batch,
        replay=replay,
        record=record,
        routing_shape=shape,
        routing_dtype=routing.routing_dtype(routing.num_experts(model)) if shape else None,
    )
    with torch.no_grad():
        schedule.run_pass(
            model,
            plan.for_rank(dp_rank),
            plan,
            scoring.batch_fn,
            scoring.loss_fn,
            forward_only=True,
            routing_sink=scoring.routing_sink if record is not None else None,
        )
    if record is not None:
        _merge_stages(record)
    return _collect(scoring.results, sequences, plan, entropy)


@dataclasses.dataclass
class _Scoring:
    """One logprob pass's callbacks for schedule.run_pass: the micro-batch inputs (scored
    positions masked in, routing to replay laid out), the per-sample results, the routing record.
    """

    sequences: Sequence[Sequence[int]]
    first: list[int]
    score_mask: Optional[Sequence[Sequence[int]]]
    temperature: float
    entropy: bool
    round_to: Optional[int]
    on_micro_batch: Optional[Any]
    replay: Optional[Sequence[Any]]
    record: Optional[dict[int, Any]]
    routing_shape: Optional[tuple[int, int]]
    routing_dtype: Optional[np.dtype] = None
    results: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = dataclasses.field(
        default_factory=dict
    )

    def batch_fn(self, mb: MicroBatch) -> schedule.MicroBatchInputs:
        if self.on_micro_batch is not None:
            self.on_micro_batch(mb)
        inputs = schedule.make_inputs(
            [self.sequences[i] for i in mb.samples], mb, round_to=self.round_to
        )
        self._mask_scored(inputs)
        if self.replay is not None and self.routing_shape is not None:
            arrays = [self.replay[i] for i in mb.samples]
            if any(a is not None for a in arrays):
                inputs.routing = routing.micro_batch_routing(
                    arrays, inputs.segments, max(1, mb.num_rows), mb.padded_len,
                    *self.routing_shape,
                )  # fmt: skip
        return inputs

    def _mask_scored(self, inputs: schedule.MicroBatchInputs) -> None:
        """Loss mask 1 on the scored positions only: from ``first[i]`` on, times ``score_mask``."""
        assert inputs.loss_mask is not None
        for seg, i in zip(inputs.segments, inputs.micro_batch.samples, strict=True):
            first = self.first[i]
            inputs.loss_mask[seg.row, seg.start : seg.start + min(first, seg.length)] = 0.0
            if self.score_mask is not None:
                lo, hi = seg.start + first, seg.start + seg.length - 1
                keep = torch.tensor(self.score_mask[i][: max(0, hi - lo)], dtype=torch.float32)
                inputs.loss_mask[seg.row, lo : lo + len(keep)] *= keep.to(inputs.loss_mask.device)

    def routing_sink(self, chunk: Any, natural: dict, inputs: schedule.MicroBatchInputs) -> None:
        assert self.record is not None and self.routing_shape is not None
        assert self.routing_dtype is not None
        mb = inputs.micro_batch
        arrays = routing.sample_routing(
            routing.whole_sequence(chunk, natural),
            inputs.segments,
            max(1, mb.num_rows),
            mb.padded_len,
            *self.routing_shape,
            self.routing_dtype,
        )
        for i, arr in zip(mb.samples, arrays, strict=True):
            self.record[i] = routing.merge([self.record.get(i), arr])

    def loss_fn(self, output: Any, inputs: schedule.MicroBatchInputs):
        assert inputs.labels is not None and inputs.loss_mask is not None
        mask = inputs.loss_mask > 0
        logps, ents = output.logprobs(
            mask, inputs.labels, temperature=self.temperature, entropy=self.entropy
        )  # [N]: row-major over the mask, i.e. sample after sample
        counts = [int(mask[s.row, s.start : s.start + s.length].sum()) for s in inputs.segments]
        parts = zip(logps.detach().split(counts), _split(ents, counts), strict=True)
        for seg, i, (lp, en) in zip(
            inputs.segments, inputs.micro_batch.samples, parts, strict=True
        ):
            if self.score_mask is not None:  # back to one value per position from first[i] on
                kept = mask[seg.row, seg.start + self.first[i] : seg.start + seg.length - 1]
                lp, en = _scatter(lp, kept), None if en is None else _scatter(en, kept)
            self.results[i] = (lp.clone(), None if en is None else en.clone())
        return torch.zeros((), device=output.device), {}


def _routing_shape(model: Sequence[Any]) -> tuple[int, int]:
    """(MoE layers, k) of the model; attaches the routers' replay slots."""
    layers = routing.attach(list(model))
    return layers, schedule._unwrap(model[0]).config.moe_router_topk


def _merge_stages(record: dict[int, Any]) -> None:
    """Each pipeline stage recorded its own layers: every stage gets them all."""
    if distributed.pp_size() == 1:
        return
    _, _, group = distributed.pipeline_stage()
    for part in distributed.all_gather_object(dict(record), group):
        for i, arr in part.items():
            record[i] = routing.merge([record.get(i), arr])


def _scatter(values: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``values`` (one per True of ``kept``) at their positions, 0.0 elsewhere."""
    out = torch.zeros(kept.shape[0], dtype=values.dtype, device=values.device)
    out[kept] = values
    return out


def _split(values: Optional[torch.Tensor], counts: list[int]) -> Sequence[Optional[torch.Tensor]]:
    return [None] * len(counts) if values is None else values.detach().split(counts)


def _collect(
    results: dict, sequences: Sequence[Sequence[int]], plan: PassPlan, entropy: bool
) -> Any:
    """Every sample's results on every rank: from the last stage, then over DP."""
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
