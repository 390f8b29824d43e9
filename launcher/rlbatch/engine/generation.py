"""Generation plumbing on megatron-core GPTModel chunks: the forwards that rollout decodes with.

Two runners, both returning logits only for the positions that are sampled next:

- :class:`LeanDecoder` (tp = 1, pp = 1, one chunk): the policy's own weights (the megatron
  modules' parameters, not copies) driven by a handful of torch ops per layer, with a per-slot
  KV cache; an MoE layer's MLP is megatron's own MoE layer (router, token dispatcher, experts),
  called on the decoder's tokens. Each slot holds one sequence at its own length, so a
  finished row's slot takes a new prompt while the others keep decoding (continuous batching). Prefill is packed: every new
  prompt in full, each distinct prompt once (a GRPO group shares one prompt), attention per
  prompt, and logits only at each prompt's last position. The math is the layer's own (RMSNorm,
  Qwen3's per-head QK norm, rotary embedding with linear position interpolation or llama3
  frequencies, grouped-query attention with softmax scale 1/sqrt(head dim), SwiGLU), so it
  is the same model as megatron's forward up to float rounding; tests compare both, and with
  transformers' Qwen2.
- :class:`rlbatch.engine.pipeline_forward.PipelineForward` (any tp / pp / vpp): megatron's
  forward through this rank's chunks (its own module).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from rlbatch import distributed
from rlbatch.engine.adapter import unwrap


@contextmanager
def inference_mode(chunks: list[Any]) -> Iterator[None]:
    """Chunks in eval mode (megatron reads its inference context only then), no autograd;
    training modes restored afterwards."""
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for c, mode in zip(chunks, was_training, strict=True):
            c.train(mode)


# ------------------------------------------------------------------------------ lean path
@dataclass(frozen=True)
class _Linear:
    """One linear of a layer: its weight (and bias), and its LoRA adapters when they are on
    (applied unmerged, as the training forward applies them)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    lora: Any = None
    """rlbatch.engine.lora.LoraBranch, or None."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]: W x + b, plus scale * B A x in the activations' dtype (never
        merged into W: a merge rounded to a bf16 weight would drop every adapter update smaller
        than the weight's rounding step, so decoding would sample a policy behind the trained
        one)."""
        out = F.linear(x, self.weight, self.bias)
        if self.lora is None:
            return out
        return out + self.lora(x, False).to(out.dtype)


@dataclass(frozen=True)
class _Layer:
    norm1: torch.Tensor
    qkv: _Linear
    proj: _Linear
    norm2: torch.Tensor
    fc1: Optional[_Linear]
    fc2: Optional[_Linear]
    """The dense SwiGLU MLP (None in an MoE layer)."""
    q_norm: Optional[torch.Tensor] = None
    """Per-head RMSNorm weights of queries and keys before the rotary embedding (Qwen3)."""
    k_norm: Optional[torch.Tensor] = None
    moe: Any = None
    """An MoE layer's megatron MoELayer (megatron.core.transformer.moe.moe_layer): the
    trainer's own router (fp32 top-k, norm_topk_prob), token dispatcher and experts, so a token
    is routed and computed as the training forward routes and computes it. At expert
    parallelism > 1 each call is an all-to-all over the expert-parallel group."""


def lean_decoding_supported(chunks: list[Any]) -> bool:
    """True when the single-turn rollout decodes this model on :class:`LeanDecoder`'s
    continuous batch: a model it computes, dense. A single-turn MoE policy decodes in lockstep
    through megatron's forward (:class:`~rlbatch.engine.pipeline_forward.PipelineForward`), which records each token's routing
    for grpo.routing_replay=r3 and keeps expert-parallel peers in step per decoding step."""
    return not lean_decoding_refusal(chunks) and not is_moe(chunks[0])


def is_moe(chunk: Any) -> bool:
    """Whether this model has MoE layers."""
    return bool(getattr(unwrap(chunk).config, "num_moe_experts", None))


def lean_decoding_refusal(chunks: list[Any]) -> str:
    """Why :class:`LeanDecoder` cannot compute this model ('' when it can): it needs one chunk,
    tp = pp = 1, and the Qwen2 / Qwen3 / Llama / Qwen3-MoE block (RMSNorm, SwiGLU or megatron's
    MoE layer, no linear biases besides QKV, rotary embedding of non-interleaved halves,
    optional QK norm)."""
    if len(chunks) != 1 or distributed.pp_size() > 1:
        return "it runs one pipeline stage (parallel.pp=1, no vpp)"
    model = unwrap(chunks[0])
    c = model.config
    checks = {
        "parallel.tp=1": c.tensor_model_parallel_size == 1,
        "RMSNorm": c.normalization == "RMSNorm" and not c.layernorm_zero_centered_gamma,
        "a SwiGLU MLP": bool(c.gated_linear_unit) and c.activation_func is F.silu,
        "no linear biases besides QKV": not c.add_bias_linear,
        "rotary positions (not yarn)": getattr(model, "position_embedding_type", "rope") == "rope",
        "non-interleaved rotary halves": getattr(model.rotary_pos_emb, "rotary_interleaved", False)
        is False,
        "the whole model on this rank": bool(model.pre_process and model.post_process),
    }
    missing = [need for need, ok in checks.items() if not ok]
    return f"it needs {', '.join(missing)}" if missing else ""


def _norm_weight(linear: Any, norm: Any) -> torch.Tensor:
    """Norm weight: fused into the next linear (Transformer Engine spec) or its own module."""
    fused = getattr(linear, "layer_norm_weight", None)
    return fused if fused is not None else norm.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (non-interleaved halves), x [..., hn]: x cos + rotate_half(x) sin, with
    rotate_half(x) = (-x2, x1) written as roll(x, hn / 2) * (-1, +1) (signs folded into
    ``signed_sin``); cos / signed_sin broadcastable."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def attention_parts(lens: Sequence[int], min_saving: float = 0.25) -> list[tuple[int, int, int]]:
    """Slot ranges (start, stop, width) that decode attends over separately: one range over
    every slot up to the longest cache, or two contiguous ranges, each up to its own longest,
    when that reads at least ``min_saving`` less of the cache (a few long rows, e.g. long
    prompts, next to many short ones). Exact either way: a slot attends over its own length."""
    n = len(lens)
    prefix, suffix = list(lens), list(lens)
    for i in range(1, n):
        prefix[i] = max(prefix[i - 1], lens[i])
        suffix[n - 1 - i] = max(suffix[n - i], lens[n - 1 - i])
    whole = n * prefix[-1]
    best, k = min(
        ((i * prefix[i - 1] + (n - i) * suffix[i], i) for i in range(1, n)), default=(whole, 0)
    )
    if best > (1.0 - min_saving) * whole:
        return [(0, n, prefix[-1])]
    return [(0, k, prefix[k - 1]), (k, n, suffix[k])]


class LeanDecoder:
    """Per-slot KV-cached forward of a tp = pp = 1 GPTModel (see the module docstring).

    ``prefill(slots, prompts) -> logits [n, V]`` writes each prompt's keys/values into its slot
    and returns the logits at its last token; ``decode(tokens [S]) -> logits [S, V]`` appends one
    token to every slot (or to a subset: ``decode(tokens, slots)``); ``extend(slots, tokens)``
    appends several tokens to each of some slots on top of their caches (multi-turn: a row's
    observation, prefilled without recomputing what came before); ``keep(slots)`` drops the
    other slots (rows that left the batch).
    """

    def __init__(
        self, chunk: Any, num_slots: int, max_len: int, record_routing: bool = False
    ) -> None:
        refusal = lean_decoding_refusal([chunk])
        if refusal:  # never a decoder of some other model than the one trained
            raise ValueError(f"the built-in engine's per-row KV-cache decoder: {refusal}")
        model = unwrap(chunk)
        c = model.config
        self.heads, self.groups = c.num_attention_heads, c.num_query_groups or c.num_attention_heads
        self.head_dim, self.eps = c.kv_channels, c.layernorm_epsilon
        self.embed = model.embedding.word_embeddings.weight
        self.final_norm = model.decoder.final_layernorm.weight
        self.out_w = (
            model.shared_embedding_or_output_weight()
            if model.share_embeddings_and_output_weights
            else model.output_layer.weight
        )
        self.layers = [self._layer(layer) for layer in model.decoder.layers]
        self.expert_parallel = is_moe(chunk) and distributed.expert_group()[0] > 1
        """MoE at parallel.ep > 1: every forward (prefill, decode, extend, :meth:`idle`) is an
        all-to-all over the expert-parallel group, so the group's ranks call as many of them in
        the same order (rlbatch.rollout.multiturn and rlbatch.rollout.expert_step keep them in
        step)."""
        self.chunk = chunk
        self.routing: Optional[torch.Tensor] = None
        """MoE with ``record_routing``: ``[num_slots, max_len, num_moe_layers, k]`` the experts
        each fed position of each slot was routed to (-1 = not fed): what r3 replays. On the
        host, int8 while expert ids fit (Qwen3-30B-A3B: 48 x 8 bytes a position)."""
        if is_moe(chunk):  # megatron's own top-k: no replay or record left from a pass
            from rlbatch.engine import routing

            routing.clear([chunk])
            if record_routing:
                layers = routing.attach([chunk])
                routing.set_routing(chunk, None)  # each router keeps its own top-k
                config = unwrap(chunk).config
                small = routing.routing_dtype(config.num_moe_experts).itemsize == 1
                shape = (num_slots, max_len, layers, config.moe_router_topk)
                self.routing = torch.full(shape, -1, dtype=torch.int8 if small else torch.int16)
        device, dtype = self.embed.device, self.embed.dtype
        rotary = model.rotary_pos_emb
        inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
        positions = torch.arange(max_len, device=device, dtype=torch.float32)
        if rotary.seq_len_interpolation_factor is not None:  # linear RoPE scaling, as megatron
            positions *= 1 / rotary.seq_len_interpolation_factor
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hn]
        half = emb.shape[-1] // 2
        sign = torch.cat((-torch.ones(half), torch.ones(half))).to(device)
        self.cos, self.sin = emb.cos().to(dtype), (emb.sin() * sign).to(dtype)  # signed sin
        shape = (num_slots, self.groups, max_len, self.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers]
        self.lens = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.device = device

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        """The layer's weights and, for a LoRA-adapted linear, its adapters if they are on when
        the decoder is built: decoding samples the trained policy exactly as the training
        forward computes it (or the base model inside rlbatch.engine.lora.adapters_disabled)."""
        from rlbatch.engine.lora import active_branch

        attn, mlp = layer.self_attention, layer.mlp

        def linear(module: Any, bias: Optional[torch.Tensor] = None) -> _Linear:
            return _Linear(module.weight, bias, active_branch(module))

        q_norm, k_norm = (getattr(attn, f"{n}_layernorm", None) for n in ("q", "k"))
        sparse = getattr(mlp, "router", None) is not None  # megatron's MoELayer
        return _Layer(
            norm1=_norm_weight(attn.linear_qkv, layer.input_layernorm),
            qkv=linear(attn.linear_qkv, attn.linear_qkv.bias),
            proj=linear(attn.linear_proj),
            norm2=(
                layer.pre_mlp_layernorm.weight
                if sparse
                else _norm_weight(mlp.linear_fc1, layer.pre_mlp_layernorm)
            ),
            fc1=None if sparse else linear(mlp.linear_fc1),
            fc2=None if sparse else linear(mlp.linear_fc2),
            q_norm=getattr(q_norm, "weight", None),
            k_norm=getattr(k_norm, "weight", None),
            moe=mlp if sparse else None,
        )

    def _qkv(
        self, h: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """h [N, H] -> q [N, nh, hn], k / v [N, ng, hn]: the fused projection (per query group:
        its query heads, then key, then value), the rotary embedding on queries and keys at once
        (cos / sin [N, 1, 1, hn])."""
        qkv = layer.qkv(F.rms_norm(h, h.shape[-1:], layer.norm1, self.eps))
        per_group = self.heads // self.groups
        qkv = qkv.view(-1, self.groups, per_group + 2, self.head_dim)
        qk = qkv[:, :, : per_group + 1]  # [N, ng, per_group + 1, hn]
        if layer.q_norm is not None and layer.k_norm is not None:  # per head, before RoPE
            shape = (self.head_dim,)
            q_part = F.rms_norm(qk[:, :, :per_group], shape, layer.q_norm, self.eps)
            qk = torch.cat(
                (q_part, F.rms_norm(qk[:, :, per_group:], shape, layer.k_norm, self.eps)), 2
            )
        qk = _rotate(qk, cos, sin)
        q = qk[:, :, :per_group].reshape(-1, self.heads, self.head_dim)
        return q, qk[:, :, per_group], qkv[:, :, per_group + 1]

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        h = F.rms_norm(x, x.shape[-1:], layer.norm2, self.eps)
        if layer.moe is not None:  # megatron's MoE layer on [N, 1, H] (its [S, B, H])
            out, _ = layer.moe(h[:, None])
            return x + out[:, 0]
        assert layer.fc1 is not None and layer.fc2 is not None
        gate, up = layer.fc1(h).chunk(2, dim=-1)
        return x + layer.fc2(F.silu(gate) * up)

    def idle(self) -> None:
        """A forward of nobody's tokens for the expert-parallel peers (MoE at parallel.ep > 1):
        each MoE layer once, in order, on one zero token, so a peer's forward of the same
        step finds this rank in its all-to-alls. Attention and the dense layers are local and
        skipped; no cache or length changes."""
        h = torch.zeros(1, 1, self.embed.shape[1], dtype=self.embed.dtype, device=self.device)
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe(h)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps), self.out_w)

    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Full forward of each distinct prompt once; its keys/values go to every slot that holds
        it. Returns logits [len(slots), V] at each prompt's last token."""
        unique: dict[tuple[int, ...], int] = {}
        owner = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        seqs = list(unique)
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [N, 1, 1, hn]
        slot_t = torch.tensor(list(slots), device=self.device)
        src = torch.tensor(owner, device=self.device)
        x = self.embed[ids]  # [N, H]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            outs, start = [], 0
            for j, n in enumerate(lens):
                qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
                outs.append(
                    F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    .transpose(0, 1)
                    .reshape(n, -1)
                )
                for slot in slot_t[src == j].tolist():
                    self.k[li][slot, :, :n] = ks
                    self.v[li][slot, :, :n] = vs
                start += n
            x = x + layer.proj(torch.cat(outs))
            x = self._mlp(x, layer)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        self.lens[slot_t] = torch.tensor(lens, device=self.device)[src]
        if self.routing is not None:  # every slot of a prompt gets its tokens' routing
            starts = [0, *itertools.accumulate(lens)]
            fed = [(slot, starts[j] + t, t) for slot, j in zip(slots, owner, strict=True)
                   for t in range(lens[j])]  # fmt: skip
            self._record(fed)
        return self._logits(x[last][src])

    def decode(self, tokens: torch.Tensor, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append tokens [S] (one per slot) at each slot's length: logits [S, V]. ``slots``
        (a subset, in order): only those slots advance (rows waiting on something else keep
        their cache untouched); None = every slot."""
        subset = slots is not None
        if slots is None:
            slots = torch.arange(len(tokens), device=self.device)
        pos = self.lens[slots]
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [S, 1, 1, hn]
        lens = (pos + 1).tolist()
        parts = attention_parts(lens)
        width = max(w for _, _, w in parts)
        masks = self._decode_masks(pos, lens, parts, width)
        x = self.embed[tokens.to(self.device)]  # [S, H]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            self.k[li][slots, :, pos] = k
            self.v[li][slots, :, pos] = v
            keys = self.k[li][slots, :, :width] if subset else self.k[li]
            values = self.v[li][slots, :, :width] if subset else self.v[li]
            outs = [
                F.scaled_dot_product_attention(
                    q[a:b, :, None],  # [s, nh, 1, hn]
                    keys[a:b, :, :w],
                    values[a:b, :, :w],
                    attn_mask=part_mask,
                    enable_gqa=True,
                )
                for (a, b, w), part_mask in zip(parts, masks, strict=True)
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + layer.proj(out.reshape(len(tokens), -1))
            x = self._mlp(x, layer)
        self.lens[slots] = pos + 1
        if self.routing is not None:
            self._record(list(zip(slots.tolist(), range(len(tokens)), pos.tolist(), strict=True)))
        return self._logits(x)

    def _decode_masks(
        self, pos: torch.Tensor, lens: list[int], parts: list[tuple[int, int, int]], width: int
    ) -> list[Optional[torch.Tensor]]:
        """Per attention part, the additive mask [s, 1, 1, w] (0 where a slot's cache holds a
        position, -inf past its length: what SDPA makes of a boolean mask at every call, made
        once for all layers), or None where every slot of the part fills the width."""
        if all(n == w for a, b, w in parts for n in lens[a:b]):
            return [None] * len(parts)
        past = torch.arange(width, device=self.device)[None] > pos[:, None]  # [S, width]
        mask = torch.zeros(past.shape, dtype=self.embed.dtype, device=self.device)
        mask = mask.masked_fill_(past, float("-inf"))[:, None, None]
        return [None if all(n == w for n in lens[a:b]) else mask[a:b, ..., :w] for a, b, w in parts]

    def extend(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append several tokens to each of ``slots`` on top of its cache (a row that comes back
        with an observation: prefill of the new tokens only). Returns logits [len(slots), V] at
        each slot's last new token."""
        lens = [len(t) for t in tokens]
        starts = self.lens[torch.tensor(list(slots), device=self.device)].tolist()
        ids = torch.tensor([t for seq in tokens for t in seq], device=self.device)
        pos = torch.cat(
            [torch.arange(s, s + n, device=self.device) for s, n in zip(starts, lens, strict=True)]
        )
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # [N, 1, 1, hn]
        x = self.embed[ids]  # [N, H]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            outs, offset = [], 0
            for slot, start, n in zip(slots, starts, lens, strict=True):
                end = start + n
                self.k[li][slot, :, start:end] = k[offset : offset + n].transpose(0, 1)
                self.v[li][slot, :, start:end] = v[offset : offset + n].transpose(0, 1)
                query = torch.arange(start, end, device=self.device)[:, None]
                allowed = torch.arange(end, device=self.device)[None] <= query  # [n, end]
                outs.append(
                    F.scaled_dot_product_attention(
                        q[offset : offset + n].transpose(0, 1),  # [nh, n, hn]
                        self.k[li][slot, :, :end],
                        self.v[li][slot, :, :end],
                        attn_mask=allowed,
                        enable_gqa=True,
                    )
                    .transpose(0, 1)
                    .reshape(n, -1)
                )
                offset += n
            x = x + layer.proj(torch.cat(outs))
            x = self._mlp(x, layer)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        for slot, start, n in zip(slots, starts, lens, strict=True):
            self.lens[slot] = start + n
        if self.routing is not None:
            offsets = [0, *itertools.accumulate(lens)]
            fed = [(slot, offsets[i] + t, start + t)
                   for i, (slot, start, n) in enumerate(zip(slots, starts, lens, strict=True))
                   for t in range(n)]  # fmt: skip
            self._record(fed)
        return self._logits(x[last])

    def _record(self, fed: list[tuple[int, int, int]]) -> None:
        """The routers' own choice in the forward that just ran, ``(slot, token index in the
        forward, position)`` per fed token, into :attr:`routing`."""
        from rlbatch.engine import routing

        assert self.routing is not None
        slot_t, index, pos = (torch.tensor(c, dtype=torch.long) for c in zip(*fed, strict=True))
        for layer, ids in routing.taken(self.chunk).items():
            self.routing[slot_t, pos, layer] = (
                ids[index.to(ids.device)].to(self.routing.dtype).cpu()
            )

    def routing_of(self, slot: int, length: int) -> Any:
        """Slot ``slot``'s first ``length`` positions' routing as a sample carries it
        (``[length, num_moe_layers, k]``, rlbatch.engine.routing.routing_dtype), the last
        position -1: a row's last token is never fed (nothing scored depends on its routing)."""
        from rlbatch.engine import routing

        assert self.routing is not None
        dtype = routing.routing_dtype(unwrap(self.chunk).config.num_moe_experts)
        arr = self.routing[slot, :length].numpy().astype(dtype)
        arr[length - 1 :] = -1
        return arr

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only these slots (in this order): rows that left the batch free their cache."""
        self.k = [k[slots] for k in self.k]
        self.v = [v[slots] for v in self.v]
        self.lens = self.lens[slots]
        if self.routing is not None:
            self.routing = self.routing[slots.cpu()]


# -------------------------------------------------------------------------- megatron path
