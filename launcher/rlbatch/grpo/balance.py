"""An MoE policy's load-balancing loss in the train pass, at every pipeline layout.

The loss (rlbatch.engine.routing.load_balance; docs/engine.md, "Load-balancing loss") is, for
sample i, b_i = the mean over the model's L MoE layers of a per-layer term b_(i,l) computed from
that layer's router logits over the sample's own tokens; coeff x b_i is added to each of the
sample's loss tokens, so the policy loss's aggregation (grpo.loss_agg_mode) and normalization
weight it. Everything after b_i is linear, so the term splits exactly by layer: a model chunk
holding some MoE layers adds coeff x (1/L) x sum of its layers' b_(i,l), weighted the same way.

- The chunk that computes the loss (the last stage's last virtual chunk, or the whole model at
  pp = 1) adds its share inside the loss (:meth:`LoadBalance.for_loss`).
- Every other chunk aggregates its share with the same function and the same per-micro-batch
  scale the loss gets (the GRPO batch, with its loss mask and the normalizer's loss_scale, is
  prepared on every stage), and back-propagates it from its own output
  (:meth:`LoadBalance.for_stage`, rlbatch.engine.schedule.attach_loss). Its metric sum joins
  the step's bundle, which is summed over the stages: ``moe/aux_loss`` covers every layer.

The sum over chunks is pp = 1's loss and gradient (tests/dist/test_moe_balance_pipeline.py
compares them at pp 2 and pp 2 x vpp 2 with pp 1, router gradients included). Under sequence
parallelism (tp > 1) a chunk's routers see a slice of each sample's tokens, and the per-sample
statistics are summed over the tensor-parallel ranks inside b_(i,l) (routing.load_balance), so
every rank computes the whole sample's term (compared at tp 2 with tp 1 in the same test).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from rlbatch.config.moe import num_moe_layers
from rlbatch.config.schema import RunConfig
from rlbatch.grpo.loss import GRPOBatch, LossSettings, aggregate
from rlbatch.grpo.normalization import Normalizer


class LoadBalance:
    """Each micro-batch's per-sample load-balancing loss of one model chunk's MoE layers (its
    share of the model's mean over layers), from the routers' logits the chunk's last forward
    captured (rlbatch.engine.routing.capturing)."""

    def __init__(self, cfg: RunConfig, model: Sequence[Any]) -> None:
        self.model = list(model)
        self.round_to = cfg.batching.train.sequence_length_round
        self.topk = cfg.model.moe_router_topk
        self.num_layers = num_moe_layers(cfg.model)

    @classmethod
    def build(cls, cfg: RunConfig, model: Sequence[Any]) -> Optional[LoadBalance]:
        """None for a dense model."""
        if cfg.model.num_moe_experts is None:
            return None
        return cls(cfg, model)

    def per_sample(self, chunk: Any, batch: GRPOBatch) -> torch.Tensor:
        """``[num samples]`` with autograd: the chunk's share of each sample's b_i (zeros on
        the batch's device for a chunk without MoE layers)."""
        from rlbatch.engine import routing, schedule

        mb = batch.micro_batch
        assert mb is not None
        segs = schedule.segments(mb, self.round_to)
        return routing.load_balance(
            routing.captured(chunk),
            segs,
            max(1, mb.num_rows),
            mb.padded_len,
            self.topk,
            num_layers=self.num_layers,
            device=batch.seq_index.device,
            sequence_part=routing.sequence_part(chunk),
        )

    def for_loss(self, batch: GRPOBatch) -> Optional[torch.Tensor]:
        """The loss chunk's share (rlbatch.grpo.loss.grpo_loss's ``aux``); None when the loss
        chunk holds no MoE layer (a last pipeline chunk of dense layers: the earlier chunks
        carry the whole term)."""
        from rlbatch.engine import routing

        if not routing.captured(self.model[-1]):
            return None
        return self.per_sample(self.model[-1], batch)

    def for_stage(
        self, settings: LossSettings, normalizer: Normalizer
    ) -> Any:  # Callable[[chunk, GRPOBatch], Optional[torch.Tensor]]
        """The ``stage_loss`` of rlbatch.engine.schedule.run_grpo_pass: a chunk that computes
        no loss back-propagates coeff x its share, aggregated and scaled as the loss is; its
        metric sum (before the coefficient) goes to the step's bundle."""

        def stage_loss(chunk: Any, batch: GRPOBatch) -> Optional[torch.Tensor]:
            from rlbatch.engine import routing

            mb = batch.micro_batch
            if mb is None or mb.filler or not routing.captured(chunk):  # no MoE layer here
                return None
            aux = self.per_sample(chunk, batch)
            seq = batch.seq_index[batch.loss_mask]  # [N]
            aux_token = aux[seq.to(aux.device)]
            with torch.no_grad():
                metric = aggregate(aux_token.detach(), seq, batch.num_seqs, settings)[0]
            numerator = aggregate(settings.aux_coeff * aux_token, seq, batch.num_seqs, settings)[0]
            loss = normalizer.stage_loss_for_backward(numerator, batch, {"aux": metric})
            return loss if settings.aux_coeff != 0.0 else None

        return stage_loss
