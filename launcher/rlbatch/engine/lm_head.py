"""The output projection and the log-softmax, in chunks of positions, for scored positions only.

    output = LMOutput.from_hidden(hidden, weight, chunk_tokens=1024)   # [R, S, H], [V/tp, H]
    logps, entropy = output.logprobs(mask, labels, temperature=0.7, entropy=True)   # [N], [N]

The last pipeline stage hands the loss its hidden states (the output layer passes them
through, see :func:`output_layer_mode`) and the loss projects only the positions of ``mask``
(those whose label is scored: response tokens, never prompt tokens), ``chunk_tokens`` positions
at a time, inside :class:`ChunkedLogprobs`: its forward keeps one chunk's logits
``[chunk, V/tp]`` at a time and its backward recomputes them chunk by chunk, so no more than one
chunk of logits (and of their gradient) ever exists. When the scored positions fit one chunk
(and pp == 1) the forward keeps that chunk's exponentials for the backward instead of
recomputing them: the same memory, one output-layer matmul fewer. Vocab-parallel under tp > 1 (the row max
and the sums are all-reduced over the tensor-parallel group, as megatron's
vocab_parallel_cross_entropy does); the gradient flows to the hidden states and to the output
weight (the embedding when tied). ``chunk_tokens == 0`` is the unchunked path: the output layer
makes the full logits ``[R, S, V/tp]`` and the same call reads them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

OUTPUT_MODES = ("logits", "hidden", "last")
"""What the switchable output layer returns: the logits of every position (megatron's own
forward), the hidden states (the loss projects them), or the logits of the last position only
(generation's prefill)."""


def _tp_group() -> tuple[int, int, Any]:
    """(size, rank, group) of tensor parallelism; (1, 0, None) without a model-parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return 1, 0, None
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


# ---------------------------------------------------------------------- full-logits path
def _tp_size_group() -> tuple[int, Any]:
    size, _, group = _tp_group()
    return size, group


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
    if _tp_size_group()[0] == 1 and (x.dtype == torch.float64 or not dist.is_initialized()):
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
    size, group = _tp_size_group()
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


# ------------------------------------------------------------------------- chunked function
def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 (fp64 for fp64 weights) logits / temperature ``[n, V/tp]`` of hidden rows ``[n, H]``
    (the matmul in the weight's dtype, scaled before the cast: the order of the unchunked path)."""
    x = h @ weight.t()
    if temperature != 1.0:
        x = x / temperature
    return x.to(_acc_dtype(weight))


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _one_stage() -> bool:
    """No pipeline parallelism: a micro-batch's backward follows its forward (no other
    micro-batch's forward in between holding its own chunk)."""
    from megatron.core import parallel_state as ps

    return (
        not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1
    )


def _label_columns(labels: torch.Tensor, vocab_start: int, width: int) -> tuple[Any, Any]:
    """(local column of each label clamped into this shard, bool: the label is in the shard)."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


class ChunkedLogprobs(torch.autograd.Function):
    """log p(label) (differentiable) and the entropy (differentiable with ``entropy_grad``: the
    entropy bonus) of softmax(h W^T / T) per row of ``h`` ``[N, H]``, ``chunk`` rows at a time,
    vocab-parallel over ``W`` ``[V/tp, H]``.

    Backward, per chunk with x = h W^T / T and p = softmax(x): d logp / dx = onehot - p and
    d H / dx = -p (x - E_p[x]); E_p[x] (on the max-shifted x) is kept from the forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        temperature: float,
        want_entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        size, rank, group = _tp_group()
        width = weight.shape[0]
        n = h.shape[0]
        acc = _acc_dtype(weight)
        logps = torch.empty(n, dtype=acc, device=h.device)
        entropy = torch.zeros(n if want_entropy else 0, dtype=acc, device=h.device)
        row_max = torch.empty(n, dtype=acc, device=h.device)
        sum_exp = torch.empty(n, dtype=acc, device=h.device)
        mean_x = torch.empty(n if want_entropy else 0, dtype=acc, device=h.device)
        # one chunk without pipelining: keep its exponentials for the backward rather than
        # recomputing the logits there (the same one chunk of memory, freed by the backward
        # that follows this micro-batch's forward; saves a [n, H] x [H, V/tp] matmul)
        keep = n <= chunk and not (want_entropy and entropy_grad) and _one_stage()
        kept = torch.empty(0, dtype=acc, device=h.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            x = _chunk_logits(h[lo:hi], weight, temperature)  # [c, V/tp]
            m = x.max(dim=-1).values
            if size > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x.sub_(m[:, None])
            col, inside = _label_columns(labels[lo:hi], rank * width, width)
            picked = x.gather(-1, col[:, None]).squeeze(-1) * inside
            ex = x.exp()
            if keep:
                kept = ex
            sums = [ex.sum(-1), picked] + ([(ex * x).sum(-1)] if want_entropy else [])
            stacked = torch.stack(sums)
            if size > 1:
                dist.all_reduce(stacked, group=group)
            z = stacked[0]
            logps[lo:hi] = stacked[1] - torch.log(z)
            if want_entropy:  # H = log Z - sum p (x - m)
                mean_x[lo:hi] = stacked[2] / z
                entropy[lo:hi] = torch.log(z) - mean_x[lo:hi]
            row_max[lo:hi], sum_exp[lo:hi] = m, z
        ctx.save_for_backward(h, weight, labels, row_max, sum_exp, mean_x, kept)
        ctx.chunk, ctx.temperature, ctx.vocab_start = chunk, temperature, rank * width
        ctx.entropy_grad = want_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx: Any, grad_logps: torch.Tensor, grad_entropy: Any) -> tuple:  # type: ignore[override]
        h, weight, labels, row_max, sum_exp, mean_x, kept = ctx.saved_tensors
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        width = weight.shape[0]
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight), device=weight.device)
        for lo in range(0, h.shape[0], ctx.chunk):
            hi = min(h.shape[0], lo + ctx.chunk)
            if kept.numel():  # the forward's one chunk: exp(x - max) kept
                shifted, p = None, kept.div_(sum_exp[:, None])
            else:
                x = _chunk_logits(h[lo:hi], weight, ctx.temperature)  # recomputed [c, V/tp]
                x.sub_(row_max[lo:hi, None])
                shifted = x.clone() if with_entropy else None
                p = x.exp_().div_(sum_exp[lo:hi, None])  # softmax
            g = grad_logps[lo:hi].to(p.dtype)
            if shifted is not None:  # d H / d x = -p (x - E_p[x])
                ge = grad_entropy[lo:hi].to(p.dtype)
                shifted.sub_(mean_x[lo:hi, None]).mul_(-ge[:, None]).sub_(g[:, None])
                d = p.mul_(shifted)
            else:
                d = p.mul_(-g[:, None])  # d logp / d x = onehot - softmax
            col, inside = _label_columns(labels[lo:hi], ctx.vocab_start, width)
            d.scatter_add_(-1, col[:, None], (g * inside)[:, None])
            d = d.to(weight.dtype)
            if ctx.temperature != 1.0:
                d = d / ctx.temperature
            grad_h[lo:hi] = d @ weight
            grad_w.add_((d.t() @ h[lo:hi]).to(grad_w.dtype))
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def chunked_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk: int,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(label) ``[N]`` with autograd to ``h`` and ``weight``, entropy ``[N]`` or None;
    the entropy too with ``entropy_grad``)."""
    logps, ents = ChunkedLogprobs.apply(
        h, weight, labels, chunk, temperature, entropy, entropy_grad
    )
    return logps, (ents if entropy else None)


# ------------------------------------------------------------------------------ the output
@dataclass
class LMOutput:
    """What the last pipeline stage hands the loss: full logits (unchunked) or the hidden states
    with the output weight (chunked)."""

    logits: Optional[torch.Tensor] = None
    """[R, S, V/tp]: the unchunked path."""
    hidden: Optional[torch.Tensor] = None
    """[R, S, H]: the final norm's output (gathered over sequence parallelism)."""
    weight: Optional[torch.Tensor] = None
    """[V/tp, H]: the output layer's weight (the word embedding when tied)."""
    chunk_tokens: int = 0

    @classmethod
    def from_hidden(cls, hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int) -> Any:
        return cls(hidden=hidden, weight=weight, chunk_tokens=chunk_tokens)

    @property
    def device(self) -> torch.device:
        tensor = self.logits if self.logits is not None else self.hidden
        assert tensor is not None
        return tensor.device

    def logprobs(
        self,
        mask: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        entropy_grad: bool = False,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log p_T(label) at the positions of ``mask`` ([R, S] bool), flat ``[N]`` in row-major
        order, differentiable; with ``entropy`` also the entropies there (differentiable with
        ``entropy_grad``: the entropy bonus). ``inplace``: the unchunked logits may be shifted in place (they are not read after)."""
        if self.logits is None:
            assert self.hidden is not None and self.weight is not None
            return chunked_logprobs(
                self.hidden[mask],
                self.weight,
                labels[mask],
                chunk=max(1, self.chunk_tokens),
                temperature=temperature,
                entropy=entropy,
                entropy_grad=entropy_grad,
            )
        ents = None
        if entropy:  # before the logprobs, which may shift the logits in place
            with torch.set_grad_enabled(entropy_grad):
                ents = token_entropy(self.logits[mask], temperature=temperature)
        logps = token_logprobs(self.logits, labels, temperature=temperature, inplace=inplace)
        return logps[mask], ents


# ------------------------------------------------------------------------ the output layer
@functools.cache
def _switchable_class(base: Any) -> Any:
    """A subclass of the output layer's class whose forward obeys ``self.output_mode``."""

    def forward(self: Any, input_: torch.Tensor, weight: Any = None, **kwargs: Any) -> Any:
        mode = getattr(self, "output_mode", "logits")
        if mode == "hidden":
            return _pass_hidden(self, input_), None
        if mode == "last":
            if self.sequence_parallel:
                raise RuntimeError("last-position logits need sequence parallelism off")
            input_ = input_[-1:]  # [1, B, H]: the next token's position only
        return base.forward(self, input_, weight, **kwargs)

    return type(f"Switchable{base.__name__}", (base,), {"forward": forward})


def _pass_hidden(layer: Any, input_: torch.Tensor) -> torch.Tensor:
    """The input as the linear sees it: gathered over sequence parallelism (the backward
    reduce-scatters), else as is with the per-shard gradients all-reduced over the
    tensor-parallel group in backward, exactly as ColumnParallelLinear treats its input."""
    from megatron.core.tensor_parallel import mappings

    if layer.sequence_parallel:
        return mappings.gather_from_sequence_parallel_region(
            input_, tensor_parallel_output_grad=True, group=layer.tp_group
        )
    size, _, group = _tp_group()
    return _AllReduceGrad.apply(input_, group) if size > 1 else input_


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group``. (Megatron's
    copy_to_tensor_model_parallel_region drops the reduction of a non-contiguous gradient, the
    case here: the model transposes its output.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def make_output_switchable(gpt: Any, chunk_tokens: int) -> None:
    """Give a last-stage GPTModel a switchable output layer and its ``logits_chunk_tokens``
    (no-op for other stages). Parameters and state-dict keys stay megatron's."""
    gpt.logits_chunk_tokens = chunk_tokens
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    if layer is None:
        return
    layer.__class__ = _switchable_class(layer.__class__)
    layer.output_mode = "logits"


def output_weight(gpt: Any) -> torch.Tensor:
    """The weight the output layer multiplies by: the word embedding when tied."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def logits_chunk_tokens(gpt: Any) -> int:
    return int(getattr(gpt, "logits_chunk_tokens", 0))


@contextlib.contextmanager
def output_layer_mode(gpts: Sequence[Any], mode: str) -> Iterator[None]:
    """Every switchable output layer of ``gpts`` (unwrapped chunks) in ``mode`` for the
    duration (see OUTPUT_MODES)."""
    assert mode in OUTPUT_MODES, mode
    layers = [
        g.output_layer for g in gpts if hasattr(getattr(g, "output_layer", None), "output_mode")
    ]
    before = [layer.output_mode for layer in layers]
    for layer in layers:
        layer.output_mode = mode
    try:
        yield
    finally:
        for layer, old in zip(layers, before, strict=True):
            layer.output_mode = old


def set_logits_chunk_tokens(model: Sequence[Any], chunk_tokens: int) -> None:
    """Change ``model.logits_chunk_tokens`` of built (possibly DDP-wrapped) chunks."""
    for chunk in model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        chunk.logits_chunk_tokens = chunk_tokens
