"""rlbatch's own model as a reference: log-probs of a full causal forward over one sequence."""

from __future__ import annotations

from typing import Any


def full_logps(model: Any, ids: list[int]) -> Any:
    """float64 log-softmax of a full causal forward of ``model`` over ``ids``: [S, V] (row t is
    the distribution of token t + 1)."""
    import torch

    t = torch.tensor([ids])
    s = t.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        model.eval()
        out = model(t, torch.arange(s)[None], mask)
    return torch.log_softmax(out[0].double(), dim=-1)
