"""moe/load_imbalance: max / mean of each MoE layer's tokens per expert (dense layers, whose
rows are all zero, have none), their mean and maximum."""

from __future__ import annotations

import pytest
import torch

from rlbatch.engine.moe_stats import imbalance_metrics


def test_imbalance_is_max_over_mean_per_layer():
    counts = torch.tensor(
        [[10.0, 10.0, 10.0, 10.0], [0.0, 0.0, 0.0, 0.0], [40.0, 0.0, 0.0, 0.0], [3, 1, 0, 0]],
        dtype=torch.float64,
    )
    got = imbalance_metrics(counts)
    # layer 0 balanced; layer 1 dense (no entry); layer 2 all on one expert: 4 / 1;
    # layer 3: max 3, mean 1
    assert got == {
        "moe/load_imbalance_layer_0": 1.0,
        "moe/load_imbalance_layer_2": 4.0,
        "moe/load_imbalance_layer_3": 3.0,
        "moe/load_imbalance": pytest.approx(8.0 / 3.0),
        "moe/load_imbalance_max": 4.0,
    }
