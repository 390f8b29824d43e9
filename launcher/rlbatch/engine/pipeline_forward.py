"""PipelineForward (any tp / pp / vpp), the lockstep runner rollout decodes with beside
rlbatch.engine.generation's LeanDecoder: megatron's forward through this rank's chunks with
``StaticInferenceContext`` (KV cache) or full recompute; hidden states go between pipeline
stages by point-to-point send, the sampled tokens come back by broadcast."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from rlbatch import distributed
from rlbatch.engine import lm_head
from rlbatch.engine.adapter import unwrap


def _causal_mask(batch: int, q_len: int, k_len: int) -> torch.Tensor:
    """Megatron's boolean mask [B, 1, q, k], True = masked; queries are the last q positions."""
    q = torch.arange(k_len - q_len, k_len)[:, None]
    k = torch.arange(k_len)[None, :]
    return (k > q)[None, None].expand(batch, 1, q_len, k_len)


class PipelineForward:
    """Logits at position end - 1 of tokens[:, :end], through this rank's model chunks.

    pp = 1: one chunk, logits returned. pp > 1: virtual stage v * pp + r runs chunk v on
    pipeline rank r; hidden states [S, B, H] go to the next stage by point-to-point send
    (one forward-only pass through the pipeline per decoding step); only the last stage
    returns logits, the others None. One StaticInferenceContext per chunk with kv_cache.
    """

    def __init__(
        self,
        chunks: list[Any],
        batch: int,
        max_len: int,
        kv_cache: bool,
        record_routing: bool = False,
    ) -> None:
        self.chunks = chunks
        self.pp = distributed.pp_size()
        self.device = next(chunks[0].parameters()).device
        self.contexts: list[Any] = [None] * len(chunks)
        if kv_cache:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.contexts = [StaticInferenceContext(batch, max_len) for _ in chunks]
        self.routing: Optional[torch.Tensor] = None
        """MoE (``record_routing``): ``[max_len, batch, num_moe_layers, k]`` the experts every
        fed position was routed to by this rank's layers (-1 = not fed / another stage's)."""
        if record_routing:
            from rlbatch.engine import routing

            layers = routing.attach(chunks)
            config = unwrap(chunks[0]).config
            self.routing = torch.full(
                (max_len, batch, layers, config.moe_router_topk), -1, dtype=torch.int16
            )

    def __call__(self, tokens: torch.Tensor, start: int, end: int) -> Optional[torch.Tensor]:
        batch = tokens.shape[0]
        fed = start  # the positions this call feeds for the first time: [fed, end)
        if self.contexts[0] is None:
            start = 0  # recompute the whole prefix
        positions = torch.arange(start, end, device=self.device)[None].expand(batch, end - start)
        mask = _causal_mask(batch, end - start, end).to(self.device)
        inputs = tokens[:, start:end].to(self.device)
        logits = None
        for v, (chunk, ctx) in enumerate(zip(self.chunks, self.contexts, strict=True)):
            stage, last_stage = _stage_of(v, self.pp), len(self.chunks) * self.pp - 1
            if stage > 0:
                _set_input_tensor(chunk, _recv_hidden(chunk, end - start, batch, self.device))
            if ctx is not None:
                assert start == ctx.sequence_len_offset, "KV cache steps must be consecutive"
                if start > 0:
                    ctx.enable_decode_mode()
            if self.routing is not None:
                from rlbatch.engine import routing

                routing.set_routing(chunk, None)
            with lm_head.output_layer_mode([unwrap(chunk)], "last"):  # project one position
                out = chunk(
                    inputs,
                    positions,
                    mask,
                    inference_context=ctx,
                    runtime_gather_output=True,
                )  # last stage: logits [B, 1, V]; other stages: hidden [S, B, H]
            if self.routing is not None:
                self._record(chunk, end - start, batch, fed, end)
            if ctx is not None:
                ctx.sequence_len_offset = end
            if stage == last_stage:
                logits = out[:, -1, :].float()
            else:
                _send_hidden(out)
        return logits

    def _record(self, chunk: Any, fed_len: int, batch: int, fed: int, end: int) -> None:
        """The routers' choice for the positions [fed, end) (tokens are sequence-major:
        ``[fed_len * batch, k]`` per layer, the last ``end - fed`` positions new)."""
        from rlbatch.engine import routing

        assert self.routing is not None
        for slot, ids in routing.taken(chunk).items():
            grid = ids.view(fed_len, batch, -1)[fed_len - (end - fed) :]
            self.routing[fed:end, :, slot] = grid.to(torch.int16).cpu()

    def row_routing(self, lengths: Sequence[int]) -> list[Any]:
        """Each row's ``[length, num_moe_layers, k]`` routing (int8, or int16 past 128 experts:
        rlbatch.engine.routing.routing_dtype), every pipeline stage's layers merged; a row's last position is left -1: the rollout never feeds a
        row's last token as an input (when other rows go on it does, but then what it would
        replay would depend on the batch), and nothing scored depends on its routing."""
        from rlbatch.engine import routing

        assert self.routing is not None
        dtype = routing.routing_dtype(unwrap(self.chunks[0]).config.num_moe_experts)
        rows: list[Any] = []
        for b, n in enumerate(lengths):
            arr = self.routing[:n, b].numpy().astype(dtype)
            arr[n - 1 :] = -1
            rows.append(arr)
        if self.pp > 1:
            _, _, group = distributed.pipeline_stage()
            parts = distributed.all_gather_object(rows, group)
            rows = [routing.merge(list(p)) for p in zip(*parts, strict=True)]
        for c in self.chunks:
            routing.clear([c])
        return rows

    def idle(self) -> None:
        """A forward whose output nobody reads, for the MoE layers' all-to-all when this
        rank's rows have all ended and an expert-parallel peer's have not: one token of
        padding through each of this rank's chunks in order, no KV cache. With pp > 1 every
        stage of the idle replica runs it on its own (a stage after the first takes a zero
        hidden state instead of receiving one): a peer's expert-parallel group lies within one
        pipeline stage, and its chunks run their MoE layers in the same order, so each
        all-to-all meets its counterpart whatever the peers' point-to-point traffic."""
        for v, chunk in enumerate(self.chunks):
            if _stage_of(v, self.pp) > 0:
                config = _config_of(chunk)
                dtype = config.pipeline_dtype or config.params_dtype
                hidden = torch.zeros(1, 1, config.hidden_size, dtype=dtype, device=self.device)
                _set_input_tensor(chunk, hidden)
            with torch.no_grad(), lm_head.output_layer_mode([unwrap(chunk)], "last"):
                chunk(
                    torch.zeros((1, 1), dtype=torch.long, device=self.device),
                    torch.zeros((1, 1), dtype=torch.long, device=self.device),
                    _causal_mask(1, 1, 1).to(self.device),
                    runtime_gather_output=True,
                )


# Point-to-point hidden states between pipeline stages for generation (the sampled tokens go
# back to every stage by rlbatch.distributed.broadcast_from_last_stage).
def _stage_of(chunk_index: int, pp: int) -> int:
    if pp == 1:
        return chunk_index
    from megatron.core import parallel_state as ps

    return chunk_index * pp + ps.get_pipeline_model_parallel_rank()


def _set_input_tensor(chunk: Any, hidden: torch.Tensor) -> None:
    from megatron.core.utils import get_attr_wrapped_model

    get_attr_wrapped_model(chunk, "set_input_tensor")(hidden)


def _config_of(chunk: Any) -> Any:
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(chunk, "config")


def _recv_hidden(chunk: Any, seq: int, batch: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    config = _config_of(chunk)
    dtype = config.pipeline_dtype or config.params_dtype
    hidden = torch.empty(seq, batch, config.hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
    return hidden


def _send_hidden(hidden: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
