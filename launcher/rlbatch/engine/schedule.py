"""Plan-driven execution: a RankPlan's micro-batches through megatron's forward/backward.

    run_pass(model, rank_plan, plan, batch_fn, loss_fn, forward_only=False)

- ``get_forward_backward_func()`` picks no-pipelining, 1F1B or interleaved 1F1B from the
  parallel state; ``variable_seq_lengths=True`` (set by the adapter) makes every p2p exchange
  send its shape first, so micro-batches may differ in rows and length.
- LAZY data: the schedule pulls micro-batch i when it needs it; ``batch_fn(micro_batch)`` is
  called then, once per micro-batch per rank (with interleaving every virtual chunk has its own
  iterator, as megatron requires; they share one cache, so each micro-batch is still built once).
- Layouts (:func:`layout`): padded micro-batches are ``[rows, padded_len]`` with an explicit
  causal bool mask ``[rows, 1, S, S]`` (True = masked; megatron's default mask would be made on
  "cuda"); packed micro-batches are one row run as THD (``PackedSeqParams``: each sequence of the
  pack attends only to itself): Transformer Engine's kernels on GPU, rlbatch.engine.attention's
  per-sequence local attention on CPU; ``layout(..., thd=False)`` builds the equivalent
  block-diagonal causal mask instead (a cross-check in the tests). A filler micro-batch (no
  samples) is one dummy row whose loss weight is 0.
- ``loss_fn(output, inputs)`` follows megatron's loss_func contract: it returns
  ``(loss, metrics)`` (megatron divides by num_microbatches) or ``(loss, num_tokens, metrics)``.
  ``output`` is the last stage's :class:`rlbatch.engine.lm_head.LMOutput`: the hidden states
  and the output weight when the model projects in chunks (``model.logits_chunk_tokens`` > 0;
  ``output.logprobs(mask, labels)`` projects only the masked positions), else the logits
  ``[rows, S, V / tp]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlbatch.batching.plan import MicroBatch, PassPlan, RankPlan
from rlbatch.engine import lm_head, routing


def round_up(n: int, r: int) -> int:
    return -(-n // r) * r


def default_device() -> torch.device:
    """Where micro-batch tensors go: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Segment:
    """Where one sample sits in a micro-batch's input tensor."""

    row: int
    start: int
    length: int
    """real tokens"""
    width: int
    """slots it occupies (length rounded up for packed; the row length for padded)."""


def infer_round(micro_batch: MicroBatch) -> int:
    """The sequence_length_round a packed micro-batch was planned with, when its lengths and
    padded_len determine the layout unambiguously (else ValueError: pass round_to)."""
    candidates = [
        r
        for r in range(1, micro_batch.padded_len + 1)
        if sum(round_up(n, r) for n in micro_batch.lengths) == micro_batch.padded_len
    ]
    layouts = {tuple(round_up(n, r) for n in micro_batch.lengths) for r in candidates}
    if len(layouts) != 1:
        raise ValueError(
            "packed micro-batch: cannot tell the sequence_length_round from lengths "
            f"{micro_batch.lengths} and padded_len {micro_batch.padded_len}: pass round_to="
        )
    return candidates[0]


def segments(micro_batch: MicroBatch, round_to: Optional[int] = None) -> list[Segment]:
    """The samples' places: padded = row j from column 0; packed = row 0, consecutive blocks
    of round_up(length, round_to) (the planner's packed layout)."""
    if micro_batch.filler:
        return []
    if not micro_batch.packed:
        return [Segment(j, 0, n, micro_batch.padded_len) for j, n in enumerate(micro_batch.lengths)]
    r = round_to if round_to is not None else infer_round(micro_batch)
    out, col = [], 0
    for n in micro_batch.lengths:
        out.append(Segment(0, col, n, round_up(n, r)))
        col += round_up(n, r)
    if col > micro_batch.padded_len:
        raise ValueError(f"packed layout needs {col} slots > padded_len {micro_batch.padded_len}")
    return out


def causal_mask(length: int, device: Any = None) -> torch.Tensor:
    """[S, S] bool, True = masked (future positions)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu_(1)


@dataclass
class AttentionInputs:
    """Position ids, attention mask and (packed) THD parameters of a micro-batch."""

    position_ids: torch.Tensor
    """[R, S] long"""
    attention_mask: Optional[torch.Tensor]
    """[R, 1, S, S] bool (True = masked), or None with packed_seq_params"""
    packed_seq_params: Optional[Any] = None


def layout(
    micro_batch: MicroBatch,
    round_to: Optional[int] = None,
    device: Any = None,
    *,
    thd: bool = True,
) -> AttentionInputs:
    rows, width = max(1, micro_batch.num_rows), micro_batch.padded_len
    if not micro_batch.packed or micro_batch.filler:
        positions = torch.arange(width, device=device).expand(rows, width)
        mask = causal_mask(width, device)[None, None].expand(rows, 1, width, width)
        return AttentionInputs(positions, mask)
    segs = segments(micro_batch, round_to)
    positions = torch.zeros(1, width, dtype=torch.long, device=device)
    blocks = torch.full((width,), -1, dtype=torch.long, device=device)
    for k, s in enumerate(segs):
        positions[0, s.start : s.start + s.width] = torch.arange(s.width, device=device)
        blocks[s.start : s.start + s.width] = k
    tail = segs[-1].start + segs[-1].width if segs else 0
    if tail < width:  # unused slots at the end: their own block
        positions[0, tail:] = torch.arange(width - tail, device=device)
        blocks[tail:] = len(segs)
    if thd:
        return AttentionInputs(positions, None, packed_seq_params(segs, width, device))
    mask = causal_mask(width, device) | (blocks[:, None] != blocks[None, :])
    return AttentionInputs(positions, mask[None, None])


def packed_seq_params(segs: Sequence[Segment], width: int, device: Any) -> Any:
    """THD parameters: each sample's block (with its round-up slots) is one sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for s in segs:
        bounds.append(s.start + s.width)
    if bounds[-1] < width:
        bounds.append(width)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    max_len = int((cu[1:] - cu[:-1]).max()) if len(bounds) > 1 else width
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


# -------------------------------------------------------------------------------- inputs
@dataclass
class MicroBatchInputs:
    """What one micro-batch feeds the model and the loss."""

    tokens: torch.Tensor
    """[R, S] long"""
    position_ids: torch.Tensor
    """[R, S] long"""
    attention_mask: Optional[torch.Tensor]
    """[R, 1, S, S] bool, True = masked"""
    micro_batch: MicroBatch
    segments: list[Segment] = field(default_factory=list)
    packed_seq_params: Optional[Any] = None
    labels: Optional[torch.Tensor] = None
    """[R, S] long: the next token of the same sample (0 where none)"""
    loss_mask: Optional[torch.Tensor] = None
    """[R, S] float: 1 where labels is a real next token (0 for fillers / padding)"""
    payload: Any = None
    """The caller's own per-micro-batch object (e.g. the GRPO batch)."""
    routing: Optional[torch.Tensor] = None
    """MoE routing to replay, ``[num_moe_layers, S * R, k]`` long in megatron's token order
    (-1 = the router's own choice; rlbatch.engine.routing); None = the routers choose."""


def make_inputs(
    sequences: Sequence[Sequence[int]],
    micro_batch: MicroBatch,
    *,
    round_to: Optional[int] = None,
    pad_id: int = 0,
    device: Any = None,
    payload: Any = None,
) -> MicroBatchInputs:
    """Inputs of a micro-batch from its samples' token ids (``sequences[j]`` is sample
    ``micro_batch.samples[j]``; only its first ``micro_batch.lengths[j]`` tokens are used), with
    next-token labels and a loss mask. ``device``: default the current CUDA device, else CPU."""
    device = default_device() if device is None else torch.device(device)
    rows, width = max(1, micro_batch.num_rows), micro_batch.padded_len
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    segs = segments(micro_batch, round_to)
    for s, ids in zip(segs, sequences, strict=True):
        ids_t = torch.as_tensor(list(ids[: s.length]), dtype=torch.long)
        tokens[s.row, s.start : s.start + s.length] = ids_t
        labels[s.row, s.start : s.start + s.length - 1] = ids_t[1:]
        loss_mask[s.row, s.start : s.start + s.length - 1] = 1.0
    lay = layout(micro_batch, round_to, device)
    return MicroBatchInputs(
        tokens=tokens.to(device),
        position_ids=lay.position_ids,
        attention_mask=lay.attention_mask,
        micro_batch=micro_batch,
        segments=segs,
        packed_seq_params=lay.packed_seq_params,
        labels=labels.to(device),
        loss_mask=loss_mask.to(device),
        payload=payload,
    )


def inputs_from_tokens(
    tokens: torch.Tensor,
    micro_batch: MicroBatch,
    *,
    round_to: Optional[int] = None,
    payload: Any = None,
) -> MicroBatchInputs:
    """Inputs around an already-built ``[R, S]`` token tensor (e.g. the GRPO batch's), moved
    to the default device."""
    tokens = tokens.to(default_device())
    lay = layout(micro_batch, round_to, tokens.device)
    return MicroBatchInputs(
        tokens=tokens,
        position_ids=lay.position_ids,
        attention_mask=lay.attention_mask,
        micro_batch=micro_batch,
        segments=segments(micro_batch, round_to),
        packed_seq_params=lay.packed_seq_params,
        payload=payload,
    )


# ------------------------------------------------------------------------------- forward
def model_forward(chunk: Any, inputs: MicroBatchInputs) -> torch.Tensor:
    """One chunk's forward: logits [R, S, V/tp] on the last stage, hidden [S, R, H] elsewhere
    (the input of a non-first stage comes through set_input_tensor)."""
    kwargs = {}
    if inputs.packed_seq_params is not None:
        kwargs["packed_seq_params"] = inputs.packed_seq_params
    return chunk(inputs.tokens, inputs.position_ids, inputs.attention_mask, **kwargs)


def next_token_loss(
    output: lm_head.LMOutput, inputs: MicroBatchInputs
) -> tuple[torch.Tensor, dict]:
    """Plain next-token cross-entropy (vocab-parallel): summed over the loss mask, megatron's
    2-tuple contract (the schedule divides by num_microbatches). For tests and the bench."""
    assert inputs.labels is not None and inputs.loss_mask is not None
    mask = inputs.loss_mask > 0
    logps, _ = output.logprobs(mask, inputs.labels, inplace=True)  # [N]
    loss = -logps.sum()
    return loss, {"loss_sum": loss.detach().clone(), "num_tokens": mask.sum().detach()}


# ------------------------------------------------------------------------------ iterators
class _LazySource:
    """Builds micro-batch i on first request; shared by the virtual chunks' iterators and
    dropped once every chunk has pulled it."""

    def __init__(self, build: Callable[[int], MicroBatchInputs], num_consumers: int) -> None:
        self.build = build
        self.num_consumers = num_consumers
        self.cache: dict[int, tuple[MicroBatchInputs, int]] = {}
        self.built = 0

    def get(self, i: int) -> MicroBatchInputs:
        if i not in self.cache:
            self.cache[i] = (self.build(i), 0)
            self.built += 1
        item, pulls = self.cache[i]
        if pulls + 1 >= self.num_consumers:
            del self.cache[i]
        else:
            self.cache[i] = (item, pulls + 1)
        return item


class _ChunkIterator(Iterator[MicroBatchInputs]):
    def __init__(self, source: _LazySource, count: int) -> None:
        self.source, self.count, self.next_index = source, count, 0

    def __next__(self) -> MicroBatchInputs:
        if self.next_index >= self.count:
            raise StopIteration
        item = self.source.get(self.next_index)
        self.next_index += 1
        return item


def lazy_iterators(
    build: Callable[[int], MicroBatchInputs], count: int, num_chunks: int
) -> list[_ChunkIterator]:
    """One iterator per virtual chunk over micro-batches 0..count-1, built lazily and once."""
    source = _LazySource(build, num_chunks)
    return [_ChunkIterator(source, count) for _ in range(num_chunks)]


# ---------------------------------------------------------------------------------- passes
LossFn = Callable[[lm_head.LMOutput, MicroBatchInputs], tuple]
StageLossFn = Callable[[Any, MicroBatchInputs], Optional[torch.Tensor]]


class _AttachLoss(torch.autograd.Function):
    """Identity on a chunk's output; in backward, the gradient of ``loss`` (a scalar) is 1, so
    the loss's own graph back-propagates with the output's (megatron's MoEAuxLossAutoScaler
    does this for its aux loss, with a scale of its own). ``on_backward(1)`` first, if given."""

    @staticmethod
    def forward(
        ctx: Any,
        output: torch.Tensor,
        loss: torch.Tensor,
        on_backward: Optional[Callable[[torch.Tensor], None]],
    ) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.on_backward = on_backward
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        one = torch.ones_like(loss)
        if ctx.on_backward is not None:
            ctx.on_backward(one)
        return grad_output, one, None


class _BeforeChunkBackward(torch.autograd.Function):
    """Identity on a chunk's output; backward calls ``on_backward(None)`` first, before
    anything of the chunk's graph runs (megatron's recompute included)."""

    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, on_backward: Callable[[Optional[torch.Tensor]], None]
    ) -> torch.Tensor:
        ctx.on_backward = on_backward
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.on_backward(None)
        return grad_output, None


class _BeforeBackward(torch.autograd.Function):
    """Identity on a loss (a copy: megatron divides it in place); backward calls
    ``on_backward(gradient)`` before anything of the loss's graph runs."""

    @staticmethod
    def forward(
        ctx: Any, loss: torch.Tensor, on_backward: Callable[[torch.Tensor], None]
    ) -> torch.Tensor:
        ctx.on_backward = on_backward
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.on_backward(grad)
        return grad, None


def attach_loss(
    output: torch.Tensor,
    loss: torch.Tensor,
    on_backward: Optional[Callable[[torch.Tensor], None]] = None,
) -> torch.Tensor:
    """``output`` unchanged; backward through it also back-propagates ``loss`` (a scalar with
    autograd, the term a chunk that computes no loss adds to the objective). ``on_backward``:
    called with the loss's gradient (1) when the chunk's backward starts, before megatron
    recomputes any of its layers (rlbatch.engine.routing.recompute_handoff).

    Raises when ``loss`` has no autograd while gradients are on: the term would be dropped
    silently (e.g. computed from activations of a forward run without autograd that nothing
    hands to the recomputed forward). Outside autograd (``torch.no_grad``) nothing is
    attached."""
    if not torch.is_grad_enabled():
        return output
    if not loss.requires_grad:
        raise RuntimeError(
            "a loss term attached to a pipeline chunk's output has no gradient (it was computed "
            "from tensors without autograd, e.g. activations of a forward that model.recompute="
            "full runs without autograd): it would train nothing"
        )
    return _AttachLoss.apply(output, loss, on_backward)


def _with_handoff(chunk: Any, result: tuple) -> tuple:
    """A loss chunk's loss_fn result whose loss, when back-propagated, first hands the
    gradient of its routers' logits to their recomputed forward (full activation recompute:
    rlbatch.engine.routing.recompute_handoff)."""
    loss = result[0]
    hand_off = routing.recompute_handoff(chunk, loss)
    if hand_off is None:
        return result
    return (_BeforeBackward.apply(loss, hand_off), *result[1:])


def _config(model: Sequence[Any]) -> Any:
    from megatron.core.utils import get_model_config

    return get_model_config(model[0])


def check_interleaving(plan: PassPlan, pp: int) -> None:
    """Megatron's rule for interleaved schedules (N = microbatch_group_size_per_vp_stage, M =
    micro-batches): pp <= N <= M and (M mod N == 0 or M mod N >= pp)."""
    n, m = plan.microbatch_group_size, plan.num_micro_batches
    if not (pp <= n <= m and (m % n == 0 or m % n >= pp)):
        raise ValueError(
            f"pass plan with {m} micro-batches and microbatch_group_size {n} is invalid for "
            f"interleaving with pp={pp} (need pp <= N <= M and M mod N == 0 or >= pp): plan it "
            "with rlbatch.batching.plan_pass(..., pp=cfg.parallel.pp, vpp=cfg.parallel.vpp, "
            "microbatch_group_size=cfg.parallel.microbatch_group_size_per_vp_stage)"
        )


def run_pass(
    model: Sequence[Any],
    rank_plan: RankPlan,
    plan: PassPlan,
    batch_fn: Callable[[MicroBatch], MicroBatchInputs],
    loss_fn: LossFn,
    forward_only: bool = False,
    *,
    zero_grad: bool = True,
    routing_sink: Optional[Callable[[Any, dict, MicroBatchInputs], None]] = None,
    stage_loss: Optional[StageLossFn] = None,
) -> list[Any]:
    """Run this rank's micro-batches (``rank_plan``) through megatron's forward/backward
    schedule. Returns the loss_fn metrics of every micro-batch on the last pipeline stage (an
    empty list on other stages).

    ``stage_loss(chunk, inputs)``: a scalar with autograd that a chunk which does not compute
    the loss (a pipeline stage before the last, or an earlier virtual chunk) adds to the
    objective, already scaled as back-propagated (or None): its gradient reaches that chunk's
    parameters in the chunk's own backward (:func:`attach_loss`). The loss chunk's terms are
    ``loss_fn``'s.

    Training (``forward_only=False``): grad buffers are zeroed first when ``zero_grad``; after
    the last backward megatron runs ``finalize_model_grads`` (DP reduction, tied embeddings).

    MoE: each chunk's routers replay ``inputs.routing`` (else route freely), and after each
    chunk's forward ``routing_sink(chunk, {slot: [N, k]}, inputs)`` gets what they chose
    themselves (rlbatch.engine.routing)."""
    mbs = rank_plan.micro_batches
    model = list(model)
    _prepare_pass(model, plan, len(mbs), zero_grad=zero_grad and not forward_only)
    iterators = lazy_iterators(lambda i: batch_fn(mbs[i]), len(mbs), len(model))
    gpts = [_unwrap(c) for c in model]
    chunk_tokens = lm_head.logits_chunk_tokens(gpts[-1])

    routed = any(routing.chunk_replays(c) for c in model)

    def forward_step(data_iterator: Iterator[MicroBatchInputs], chunk: Any):
        inputs = next(data_iterator)
        if routed:
            routing.set_routing(chunk, inputs.routing)
        output = model_forward(chunk, inputs)
        if routed and routing_sink is not None:
            routing_sink(chunk, routing.taken(chunk), inputs)
        gpt = _unwrap(chunk)
        if not forward_only and not gpt.post_process:
            extra = stage_loss(chunk, inputs) if stage_loss is not None else None
            hand_off = routing.recompute_handoff(chunk, extra) if routed else None
            if extra is not None:
                output = attach_loss(output, extra, hand_off)
            elif hand_off is not None:
                output = _BeforeChunkBackward.apply(output, hand_off)

        def loss_func(output_tensor: torch.Tensor, **_: Any):
            if chunk_tokens > 0:
                weight = lm_head.output_weight(gpt)
                out = lm_head.LMOutput.from_hidden(output_tensor, weight, chunk_tokens)
            else:
                out = lm_head.LMOutput(logits=output_tensor)
            result = loss_fn(out, inputs)
            if routed and not forward_only:
                result = _with_handoff(chunk, result)
            return result

        return output, loss_func

    was_training = [c.training for c in model]
    for c in model:
        c.train(not forward_only)
    mode = "hidden" if chunk_tokens > 0 else "logits"
    try:
        with lm_head.output_layer_mode(gpts, mode):
            return _run_schedule(model, iterators, mbs, forward_step, forward_only)
    finally:
        for c, was in zip(model, was_training, strict=True):
            c.train(was)
        if routed:
            routing.clear(model)


def _prepare_pass(
    model: list[Any], plan: PassPlan, num_micro_batches: int, zero_grad: bool
) -> None:
    """Before a pass: the rank's micro-batch count is the pass's, an interleaved schedule's
    groups are set on the config, and the grad buffers are zeroed when ``zero_grad``."""
    if num_micro_batches != plan.num_micro_batches:
        raise ValueError(
            f"rank plan has {num_micro_batches} micro-batches, the pass {plan.num_micro_batches}"
        )
    config = _config(model)
    if len(model) > 1:
        check_interleaving(plan, config.pipeline_model_parallel_size)
        config.microbatch_group_size_per_vp_stage = plan.microbatch_group_size
    if zero_grad:
        for chunk in model:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)


def _unwrap(chunk: Any) -> Any:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _run_schedule(
    model: list[Any],
    iterators: list[Any],
    mbs: Sequence[MicroBatch],
    forward_step: Callable,
    forward_only: bool,
) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(mbs),
        seq_length=max(mb.padded_len for mb in mbs),
        micro_batch_size=max(max(1, mb.num_rows) for mb in mbs),
        forward_only=forward_only,
    )


def run_grpo_pass(
    model: Sequence[Any],
    rank_plan: RankPlan,
    plan: PassPlan,
    batches: Iterable[Any],
    loss_fn: Callable[[lm_head.LMOutput, Any], tuple],
    *,
    round_to: Optional[int] = None,
    routing_sink: Optional[Callable[[Any, dict, MicroBatchInputs], None]] = None,
    stage_loss: Optional[Callable[[Any, Any], Optional[torch.Tensor]]] = None,
) -> list[Any]:
    """Training pass over caller-built batches (the GRPO step): ``batches`` yields, lazily
    and in plan order, objects with ``.tokens`` ([R, S] long) and ``.micro_batch``;
    ``loss_fn(output, batch)`` follows megatron's contract (``output``: an LMOutput). ``round_to``: the pass's
    sequence_length_round (needed for packed micro-batches whose layout is ambiguous). A batch's
    ``replay_routing`` (if any) is the MoE routing its forward and backward replay.
    ``stage_loss(chunk, batch)``: :func:`run_pass`'s, on the caller's batch."""
    stream = iter(batches)
    if round_to is None:  # the planner may record it; else inferred per packed micro-batch
        round_to = plan.extra.get("sequence_length_round")

    def batch_fn(micro_batch: MicroBatch) -> MicroBatchInputs:
        batch = next(stream)
        mb = getattr(batch, "micro_batch", micro_batch)
        inputs = inputs_from_tokens(batch.tokens, mb, round_to=round_to, payload=batch)
        inputs.routing = getattr(batch, "replay_routing", None)
        return inputs

    return run_pass(
        model,
        rank_plan,
        plan,
        batch_fn,
        lambda out, inputs: loss_fn(out, inputs.payload),
        routing_sink=routing_sink,
        stage_loss=None
        if stage_loss is None
        else lambda chunk, inputs: stage_loss(chunk, inputs.payload),
    )
