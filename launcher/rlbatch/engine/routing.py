"""Expert routing of an MoE policy: recorded where it is computed, replayed where it is asked.

    attach(chunks)                          # once per model: a replay slot on every router
    set_routing(chunk, routing)             # before a chunk's forward: replay, or record
    natural = taken(chunk)                  # after it: what each router itself chose

Built on megatron-core's ``RouterReplay`` (moe/router_replay.py), whose hook in the top-k
routing (``topk_routing_with_score_function(router_replay=...)``) returns the replayed expert
ids and gathers their scores, so the routing weights still come from this forward's router
(and its gradient). Two things of megatron's class do not fit and are changed here:

- its instances register in one process-global list ordered by construction, and its
  ``set_replay_data`` hands them one tensor each in that order: the policy, the reference copy
  and a generation worker's snapshot are separate models in one process, and with pipeline
  parallelism a process holds some layers only. Each router's slot here is found from its own
  model chunk and its global layer number instead (:func:`attach`), never from the list;
- when it replays it does not compute what the router would have chosen, and a replayed tensor
  must cover every token. Here the router's own top-k is always computed too (kept for
  ``moe/routing_mismatch`` and for the old-logprob pass under r2), and a token whose replayed
  ids are unknown (-1: padding, and a sequence's last token, which the rollout never fed) keeps
  its own routing: no scored log-prob depends on those positions.

Layout. Per sample, routing is an integer array ``[length, num_moe_layers, k]`` (int8 when
expert ids fit, else int16; -1 = unknown), position t holding the experts token t was routed to
as an input (prompt tokens included), MoE layers in model order. A micro-batch's routing is
``[num_moe_layers, S * R, k]`` in megatron's token order inside a layer (hidden states are
``[S, R, H]``, flattened sequence-major: token (s, r) is row s * R + r), built from the samples'
arrays and the micro-batch's segments (:func:`micro_batch_routing`): padded rows, packed rows
(one row, consecutive blocks) and filler micro-batches alike. With sequence parallelism each
tensor-parallel rank's routers see its own slice of the sequence, and get that slice.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

UNKNOWN = -1


def moe_layer_indices(config: Any) -> list[int]:
    """0-based global indices of the MoE layers of a model with megatron's TransformerConfig
    (``moe_layer_freq``: an int k = every k-th layer, or one 0/1 per layer); [] if dense."""
    if not getattr(config, "num_moe_experts", None):
        return []
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(config.num_layers) if i % freq == 0]
    return [i for i, f in enumerate(freq) if f]


def routing_dtype(num_experts: int) -> np.dtype:
    """int8 while expert ids fit (<= 127 experts: Qwen3-30B-A3B's 128 ids 0..127 do), else
    int16."""
    return np.dtype(np.int8) if num_experts <= 128 else np.dtype(np.int16)


def _replay_class() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class LayerReplay(RouterReplay):
        """megatron's RouterReplay for one router, outside the process-global list; replay
        also computes the router's own choice, and tokens without replayed ids keep it."""

        def __init__(self, slot: int) -> None:  # no super().__init__: no global registration
            self.slot = slot
            self.capture = False
            """Keep the next forwards' router logits (with autograd) and routing map."""
            self.captured: Optional[tuple[torch.Tensor, torch.Tensor]] = None
            self.target_topk_idx: Optional[torch.Tensor] = None
            self.recorded_topk_idx: Optional[torch.Tensor] = None
            self.router_replay_action: Optional[RouterReplayAction] = None
            self.replay_backward_list: list[torch.Tensor] = []
            self.leaf: Optional[torch.Tensor] = None
            """The captured logits of a forward without autograd, as a leaf that requires grad
            (:func:`captured`), until :func:`recompute_handoff` takes it."""
            self.deferred: Optional[torch.Tensor] = None
            """``[N, E]``: the loss's gradient with respect to this router's logits, added to
            them by the router's next forward with autograd (its recomputed forward)."""

        def get_replay_topk(
            self,
            scores: torch.Tensor,
            topk: int,
            num_groups: Optional[int] = None,
            group_topk: Optional[int] = None,
            default_compute_topk: Any = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(
                    scores, topk, num_groups, group_topk, default_compute_topk
                )
            with torch.no_grad():
                _, natural = default_compute_topk(
                    scores.detach(), topk, num_groups=num_groups, group_topk=group_topk
                )
            self.recorded_topk_idx = natural
            assert self.target_topk_idx is not None, "replay without routing"
            target = self.target_topk_idx.to(scores.device)
            if target.shape != natural.shape:
                raise ValueError(
                    f"replayed routing of MoE layer slot {self.slot} has shape "
                    f"{tuple(target.shape)}, the router computes {tuple(natural.shape)}"
                )
            chosen = torch.where(target[:, :1] >= 0, target, natural)
            return scores.gather(1, chosen), chosen

    return LayerReplay


_CLASS: Optional[type] = None


def _layer_replay(slot: int) -> Any:
    global _CLASS
    if _CLASS is None:
        _CLASS = _replay_class()
    return _CLASS(slot)


def _unwrap(chunk: Any) -> Any:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def chunk_replays(chunk: Any) -> list[Any]:
    """The replay slots of one model chunk's routers (empty for a dense model or before
    :func:`attach`)."""
    return list(getattr(_unwrap(chunk), "_rlbatch_replays", []))


def attach(chunks: Sequence[Any]) -> int:
    """Give every router of these chunks a replay slot (its MoE layer's place among the
    model's MoE layers); idempotent. Returns the number of MoE layers of the whole model."""
    count = 0
    for chunk in chunks:
        gpt = _unwrap(chunk)
        slots = {layer: s for s, layer in enumerate(moe_layer_indices(gpt.config))}
        count = len(slots)
        if hasattr(gpt, "_rlbatch_replays"):
            continue
        replays = []
        for layer in gpt.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            replay = _layer_replay(slots[layer.layer_number - 1])
            router.router_replay = replay
            router.routing = _capturing(router.routing, replay)
            replays.append(replay)
        gpt._rlbatch_replays = replays
    return count


def _capturing(routing_fn: Any, replay: Any) -> Any:
    """The router's ``routing(logits, padding_mask)`` that also keeps its logits ``[N, E]``
    (autograd intact) and routing map ``[N, E]`` bool while ``replay.capture`` is on. A forward
    with autograd while a gradient is deferred to it (the recomputed forward of full activation
    recompute, :func:`recompute_handoff`) adds that gradient to its logits' instead, and keeps
    nothing: the first forward's capture is the one the loss used."""

    def routing(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> Any:
        deferred = replay.deferred
        if deferred is not None and torch.is_grad_enabled():
            replay.deferred = None
            if deferred.numel() != logits.numel():
                raise RuntimeError(
                    f"MoE layer slot {replay.slot}: the recomputed forward routes "
                    f"{logits.numel() // logits.shape[-1]} tokens, the first forward "
                    f"{deferred.shape[0]}"
                )
            return routing_fn(_AddGradient.apply(logits, deferred), padding_mask)
        probs, routing_map = routing_fn(logits, padding_mask)
        if replay.capture:
            replay.captured = (logits.view(-1, logits.shape[-1]), routing_map)
        return probs, routing_map

    return routing


class _AddGradient(torch.autograd.Function):
    """Identity on a router's logits; backward adds ``extra`` (``[N, E]``) to their gradient
    (megatron's MoEAuxLossAutoScaler attaches its aux loss to the router's output the same
    way, inside the recomputed forward)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra = extra
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad + ctx.extra.view_as(grad).to(grad.dtype), None


def capturing(chunks: Sequence[Any], on: bool) -> None:
    """Start (or stop and drop) keeping every router's logits and routing map."""
    for chunk in chunks:
        for r in chunk_replays(chunk):
            r.capture, r.captured = on, None


def captured(chunk: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{slot: (logits [N, E] with autograd, routing map [N, E] bool)}`` of the chunk's last
    forward (while :func:`capturing` is on).

    Under full activation recompute (``model.recompute=full``) that forward ran without
    autograd: while gradients are on, such logits are handed out as a leaf that requires grad
    (the same one on every call until the next forward), and :func:`recompute_handoff` gives
    what the loss back-propagates into it to the router's recomputed forward. Without recompute
    logits without autograd stay as they are (a router nothing trainable feeds): there is no
    second forward to take a gradient."""
    out = {}
    recomputes = _recomputes(chunk)
    for r in chunk_replays(chunk):
        if r.captured is None:
            continue
        logits, routing_map = r.captured
        if recomputes and torch.is_grad_enabled() and not logits.requires_grad:
            r.leaf = logits.detach().requires_grad_()
            r.captured = (r.leaf, routing_map)
        out[r.slot] = r.captured
    return out


def _recomputes(chunk: Any) -> bool:
    """Whether megatron recomputes the chunk's layers in backward (full activation recompute):
    only then does a router run a second forward that can take a deferred gradient."""
    return getattr(_unwrap(chunk).config, "recompute_granularity", None) == "full"


def recompute_handoff(
    chunk: Any, term: Optional[torch.Tensor] = None
) -> Optional[Callable[[Optional[torch.Tensor]], None]]:
    """After a forward of ``chunk`` that megatron recomputes in backward (full activation
    recompute): a function to call at the very start of that micro-batch's backward of the
    chunk, before megatron recomputes any of its layers, with the gradient of ``term`` (a
    scalar, the chunk's loss or a share of it computed from :func:`captured` leaves; None when
    the chunk has no such term). None when the chunk does not recompute, has no routers, or
    gradients are off.

    It does two things for the recomputed forward, which runs its routers again:

    - **Routing.** Each router's replay state of this forward (the micro-batch's routing to
      replay, or free routing) is set back, because with pipelining later micro-batches' forwards
      have set their own since: the recomputed forward routes the micro-batch as its first
      forward did (megatron's REPLAY_BACKWARD does this with one process-global queue in
      forward order; here each micro-batch's targets travel with its own backward).
    - **Load-balancing gradient.** It computes the gradient of ``term`` with respect to each
      leaf (the same numbers autograd gives the router's logits without recompute, the loss's
      weights and megatron's scaling included, as the gradient of ``term`` carries them) and
      defers it to that router: its recomputed forward adds it to its logits' gradient
      (:func:`_capturing`), from where it reaches the router's weight and the layer's input as
      without recompute.

    The leaves are taken: the next micro-batch's forward makes its own."""
    replays = chunk_replays(chunk)
    if not replays or not _recomputes(chunk) or not torch.is_grad_enabled():
        return None
    pending = [(r, r.leaf) for r in replays if r.leaf is not None]
    for r, _ in pending:
        r.leaf = None
    if term is None or not term.requires_grad:
        pending = []
    armed = [(r, r.router_replay_action, r.target_topk_idx) for r in replays]

    def hand_off(grad: Optional[torch.Tensor]) -> None:
        for r, action, target in armed:
            r.router_replay_action, r.target_topk_idx = action, target
        if not pending:
            return
        assert term is not None and grad is not None
        leaves = [leaf for _, leaf in pending]
        grads = torch.autograd.grad(
            term, leaves, grad_outputs=grad, retain_graph=True, allow_unused=True
        )
        for (r, _), g in zip(pending, grads, strict=True):
            r.deferred = g

    return hand_off


def load_balance(
    captured_layers: dict[int, tuple[torch.Tensor, torch.Tensor]],
    segments: Sequence[Any],
    rows: int,
    width: int,
    topk: int,
    num_layers: Optional[int] = None,
    device: Optional[torch.device] = None,
    sequence_part: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """``[num samples]`` with autograd: each sample's load-balancing loss, the mean over MoE
    layers of E * sum_e f_e * P_e over the sample's own tokens (padding excluded), f_e = the
    share of the router's own top-k choices that went to expert e (sum_e f_e = 1), P_e = the
    mean router probability (softmax over every expert) of expert e over its tokens: 1.0 when
    the sample's routing is perfectly balanced, up to E / k when all its tokens go to the same
    k experts with all the probability there (the Switch / GShard balance loss taken per
    sequence, as DeepSeek-V3's sequence-wise one). f_e counts the top-k of the router's logits,
    as megatron-core's own balance loss does: before a capacity factor drops any assignment
    (dropping would hide exactly the overflowing experts' load) and whatever routing replay
    dispatches (the loss is about the router's preference, which replay does not change).

    ``num_layers``: the model's MoE layers, when ``captured_layers`` are one pipeline chunk's
    share of them: its terms are then divided by the whole count, so the chunks' shares add up
    to the model's mean (default: the captured layers are all of them). ``device``: where the
    zeros of a chunk without MoE layers live (the logits' device, where the loss indexes them;
    default the CPU).

    ``sequence_part``: (this rank's index, parts) of the sequence under sequence parallelism
    (:func:`sequence_part`): the routers saw positions [index * width / parts, (index + 1) *
    width / parts) only. Each sample's expert counts and probability sums over its local
    tokens are then summed over the tensor-parallel group (one all-reduce, whose backward is
    the identity: every rank back-propagates the same replicated loss into its own tokens, and
    megatron sums the router weight's gradient over the group), so every rank gets the whole
    sample's f and P: the loss and its gradient are those of one rank holding every token."""
    index, parts = sequence_part
    local = width // parts
    lo = index * local
    owner = torch.full((local, rows), -1, dtype=torch.long)  # the sample of each local token
    for i, seg in enumerate(segments):
        a, b = max(seg.start, lo), min(seg.start + seg.length, lo + local)
        if a < b:
            owner[a - lo : b - lo, seg.row] = i
    owner = owner.view(-1)  # sequence-major, as the router flattens [S, R]
    tokens = (owner >= 0).nonzero()[:, 0]
    sums = []  # per layer [samples, 2E]: probability sums, then top-k counts
    for logits, _ in captured_layers.values():
        experts = logits.shape[-1]
        probs = torch.softmax(logits.float(), dim=-1).view(local * rows, experts)
        own = logits.detach().view(local * rows, experts).topk(topk, dim=-1).indices
        chosen = torch.zeros_like(probs).scatter_(-1, own, 1.0)
        both = torch.cat([probs, chosen], dim=-1)[tokens.to(probs.device)]  # [tokens, 2E]
        zeros = both.new_zeros(len(segments), 2 * experts)
        sums.append(zeros.index_add(0, owner[tokens].to(both.device), both))
    if not sums:  # a pipeline chunk of dense layers only
        return torch.zeros(len(segments), device=device)
    total = torch.stack(sums)  # [layers, samples, 2E]
    if parts > 1:
        total = _sum_over_sequence_parts(total)
    n = torch.tensor([float(seg.length) for seg in segments], device=total.device)[:, None]
    experts = total.shape[-1] // 2
    p_mean, f = total[..., :experts] / n, total[..., experts:] / (n * topk)
    per_layer = experts * (f * p_mean).sum(-1)  # [layers, samples]
    return per_layer.sum(0) / (num_layers or len(captured_layers))


def _sum_over_sequence_parts(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the tensor-parallel group (forward all-reduce, backward identity:
    megatron's reduce_from_tensor_model_parallel_region, as the vocab-parallel log-softmax's
    sums are reduced)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t)


def sequence_part(chunk: Any) -> tuple[int, int]:
    """(index, parts): which slice of each micro-batch's sequence this chunk's routers see:
    (tensor-parallel rank, tp) under sequence parallelism, else (0, 1)."""
    config = _unwrap(chunk).config
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if not getattr(config, "sequence_parallel", False) or tp == 1:
        return 0, 1
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), tp


def set_routing(chunk: Any, routing: Optional[torch.Tensor]) -> None:
    """Before a forward of ``chunk``: replay ``routing`` (``[num_moe_layers, S * R, k]``, -1 =
    the router's own choice) or, with None, route freely and record."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = chunk_replays(chunk)
    if not replays:
        return
    if routing is None:
        for r in replays:
            r.target_topk_idx = None
            r.router_replay_action = RouterReplayAction.RECORD
        return
    part = _sequence_slice(_unwrap(chunk).config, routing)
    for r in replays:
        r.target_topk_idx = part[r.slot].long()
        r.router_replay_action = RouterReplayAction.REPLAY_FORWARD


def clear(chunks: Sequence[Any]) -> None:
    """Routers back to megatron's plain top-k, nothing held. A load-balancing gradient still
    queued for a recomputed router forward that never ran (:func:`recompute_handoff`: the term
    would have trained nothing) raises, unless the pass is already failing."""
    unused = 0
    for chunk in chunks:
        for r in chunk_replays(chunk):
            unused += r.deferred is not None
            r.target_topk_idx = r.recorded_topk_idx = None
            r.router_replay_action = None
            r.replay_backward_list = []
            r.capture, r.captured = False, None
            r.leaf = r.deferred = None
    if unused and sys.exc_info()[0] is None:
        raise RuntimeError(
            f"{unused} router(s) kept the load-balancing gradient queued for their recomputed "
            "forward, which never ran with autograd: the balance term trained nothing"
        )


def taken(chunk: Any) -> dict[int, torch.Tensor]:
    """After a forward of ``chunk``: each of its MoE layers' own choice ``{slot: [N, k]}`` (what
    it recorded, or what it would have chosen while replaying), N = the tokens it routed."""
    return {
        r.slot: r.recorded_topk_idx.detach()
        for r in chunk_replays(chunk)
        if r.recorded_topk_idx is not None
    }


def whole_sequence(chunk: Any, natural: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """What the chunk's routers chose (:func:`taken`, ``{slot: [N, k]}``) for every token of
    the micro-batch: under sequence parallelism each tensor-parallel rank's routers routed one
    contiguous block of the sequence-major tokens, and the blocks are gathered over the group in
    rank order (a collective: every tensor-parallel rank calls); else as it is."""
    _, parts = sequence_part(chunk)
    if parts == 1:
        return natural
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out = {}
    for slot in sorted(natural):
        ids = natural[slot].contiguous()
        blocks = [torch.empty_like(ids) for _ in range(parts)]
        dist.all_gather(blocks, ids, group=group)
        out[slot] = torch.cat(blocks)
    return out


def _sequence_slice(config: Any, routing: torch.Tensor) -> torch.Tensor:
    """With sequence parallelism the routers of tp rank i see rows [i * S / tp, (i + 1) * S /
    tp) of the sequence-major tokens: that slice."""
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if not getattr(config, "sequence_parallel", False) or tp == 1:
        return routing
    from megatron.core import parallel_state as ps

    rank, n = ps.get_tensor_model_parallel_rank(), routing.shape[1]
    return routing[:, rank * n // tp : (rank + 1) * n // tp]


# ------------------------------------------------------------------------------ layouts
def micro_batch_routing(
    arrays: Sequence[Optional[np.ndarray]],
    segments: Sequence[Any],
    rows: int,
    width: int,
    num_layers: int,
    k: int,
) -> torch.Tensor:
    """``[num_layers, width * rows, k]`` long: sample j's array (``[length, num_layers, k]``)
    at its segment (row, start), sequence-major; -1 wherever no sample has routing."""
    grid = np.full((width, rows, num_layers, k), UNKNOWN, dtype=np.int64)
    for seg, arr in zip(segments, arrays, strict=True):
        if arr is None:
            continue
        n = min(seg.length, len(arr))
        grid[seg.start : seg.start + n, seg.row] = arr[:n]
    return torch.from_numpy(grid.reshape(width * rows, num_layers, k).transpose(1, 0, 2).copy())


def sample_routing(
    natural: dict[int, torch.Tensor],
    segments: Sequence[Any],
    rows: int,
    width: int,
    num_layers: int,
    k: int,
    dtype: np.dtype,
) -> list[np.ndarray]:
    """The inverse of :func:`micro_batch_routing` for what a forward's routers chose
    (``{slot: [width * rows, k]}``, this rank's layers): one ``[length, num_layers, k]`` array
    per segment, -1 in the layers this rank does not hold."""
    out = [np.full((seg.length, num_layers, k), UNKNOWN, dtype=dtype) for seg in segments]
    for slot, ids in natural.items():
        grid = ids.view(width, rows, k).cpu().numpy()
        for arr, seg in zip(out, segments, strict=True):
            arr[:, slot] = grid[seg.start : seg.start + seg.length, seg.row]
    return out


def merge(parts: Sequence[Optional[np.ndarray]]) -> Optional[np.ndarray]:
    """One array from the parts pipeline stages recorded (each knows its own layers: -1
    elsewhere); None if none has any."""
    known = [p for p in parts if p is not None]
    if not known:
        return None
    out = known[0].copy()
    for p in known[1:]:
        out = np.where(out >= 0, out, p)
    return out


def mismatch_counts(
    natural: dict[int, torch.Tensor], replayed: torch.Tensor, num_layers: int
) -> torch.Tensor:
    """``[2, num_layers]`` float64: per MoE layer, tokens with known rollout routing and, of
    them, those whose expert set (order ignored) differs from the router's own choice."""
    out = torch.zeros(2, num_layers, dtype=torch.float64)
    for slot, ids in natural.items():
        ref = replayed[slot].to(ids.device)
        known = ref[:, 0] >= 0
        same = (ids.sort(dim=1).values == ref.sort(dim=1).values).all(dim=1)
        out[0, slot] = float(known.sum())
        out[1, slot] = float((known & ~same).sum())
    return out


def local_routing(chunk: Any, routing: torch.Tensor) -> torch.Tensor:
    """The part of a micro-batch's routing this chunk's routers see (all of it, or this tensor-
    parallel rank's slice under sequence parallelism)."""
    return _sequence_slice(_unwrap(chunk).config, routing)


def mismatch_metrics(counts: torch.Tensor) -> dict[str, float]:
    """``moe/routing_mismatch`` (mismatched / known over every (token, MoE layer) pair: the
    fraction of tokens whose expert set moved, averaged over the layers by their tokens) and
    ``moe/routing_mismatch_layer_<slot>`` from :func:`mismatch_counts` summed over ranks."""
    known, moved = counts[0], counts[1]
    out: dict[str, float] = {}
    if float(known.sum()) <= 0:
        return out
    out["moe/routing_mismatch"] = float(moved.sum() / known.sum())
    for slot in range(counts.shape[1]):
        if known[slot] > 0:
            out[f"moe/routing_mismatch_layer_{slot}"] = float(moved[slot] / known[slot])
    return out


def num_experts(chunks: Sequence[Any]) -> int:
    return int(_unwrap(chunks[0]).config.num_moe_experts)


def drop_counts(chunk: Any, inputs: Any, topk: int) -> torch.Tensor:
    """``[2]`` float64 over the chunk's MoE layers in its last forward (while
    :func:`capturing`): the real tokens' token-to-expert assignments (k each) and those a
    capacity factor dropped (k minus the experts left in the routing map). Padding and filler
    rows are not counted."""
    mb = inputs.micro_batch
    rows, width = max(1, mb.num_rows), mb.padded_len
    real = torch.zeros(width, rows, dtype=torch.bool)
    for seg in inputs.segments:  # none for a filler
        real[seg.start : seg.start + seg.length, seg.row] = True
    real_flat = _sequence_slice(_unwrap(chunk).config, real.reshape(1, -1))[0]
    out = torch.zeros(2, dtype=torch.float64)
    for _, routing_map in captured(chunk).values():
        kept = routing_map.sum(-1).cpu()[real_flat]  # [real tokens]
        out[0] += float(kept.numel() * topk)
        out[1] += float((topk - kept).sum())
    return out
