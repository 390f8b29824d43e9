"""Expert load of an MoE policy: how many tokens each router sends to each expert.

    load = ExpertLoad(model)          # hooks every MoE layer's router on this rank
    with load.recording():
        ...training forwards...
    counts = load.take()              # {global layer index (0-based): tokens per expert}

Counted on the tokens the router computes (padding of padded micro-batches included); each
rank counts its own micro-batches and its own pipeline stage's layers, so callers sum the
counts over the world (rlbatch.train.build). Imbalance is max / mean over a layer's experts:
1.0 = perfectly balanced, num_moe_experts = every token on one expert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class ExpertLoad:
    def __init__(self, model: list[Any]) -> None:
        from rlbatch.engine.adapter import unwrap

        self.counts: dict[int, torch.Tensor] = {}
        self._recording = False
        for chunk in model:
            for layer in unwrap(chunk).decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, index: int) -> Any:
        def count(module: Any, args: Any, output: Any) -> None:
            if not self._recording:
                return
            routing_map = output[1]  # [tokens, experts] bool
            tokens = routing_map.detach().sum(dim=0).to(torch.float64).cpu()
            self.counts[index] = self.counts.get(index, 0) + tokens

        return count

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def take(self) -> dict[int, torch.Tensor]:
        counts, self.counts = self.counts, {}
        return counts


def imbalance_metrics(counts: torch.Tensor) -> dict[str, float]:
    """``counts``: [layers, experts] tokens per expert (rows of dense layers all zero).
    moe/load_imbalance_layer_<i> (max / mean of layer i's experts), their mean
    moe/load_imbalance and maximum moe/load_imbalance_max."""
    out: dict[str, float] = {}
    for index, row in enumerate(counts):
        total = float(row.sum())
        if total > 0:
            out[f"moe/load_imbalance_layer_{index}"] = float(row.max()) * len(row) / total
    if out:
        values = list(out.values())
        out["moe/load_imbalance"] = sum(values) / len(values)
        out["moe/load_imbalance_max"] = max(values)
    return out
