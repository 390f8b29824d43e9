"""Quality figures of a plan (docs/batching.md): lower bound, padding, balance, lockstep."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, mul

from rlbatch.batching.cost import CostModel
from rlbatch.batching.plan import MicroBatch, PlanStats

_COMPUTED = attrgetter("computed_tokens")
_REAL = attrgetter("real_tokens")
_FILLER = attrgetter("filler")


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def lower_bound(rounded: Sequence[int], dp: int, max_tokens: int) -> int:
    """max(ceil(T / (D*B)), ceil(#(L > B/2) / D)) on rounded lengths: no plan can give every
    rank fewer micro-batches (two samples longer than B/2 never share one). An isolated sample
    longer than B counts as B tokens: it fills exactly one micro-batch."""
    if not rounded:
        return 0
    if max(rounded) <= max_tokens:
        total = sum(rounded)
    else:
        total = sum(x if x <= max_tokens else max_tokens for x in rounded)
    big = sum(map((max_tokens // 2).__lt__, rounded))  # 2x > B  <=>  x > B // 2
    return max(-(-total // (dp * max_tokens)), -(-big // dp))


def micro_batch_cost(mb: MicroBatch, cost: CostModel, sequence_length_round: int) -> float:
    """What a micro-batch costs to compute: padded rows x cost(padded_len), or the sum of the
    rounded sequences' costs when packed (block-diagonal / varlen attention)."""
    if mb.filler or not mb.packed:
        return cost.padded(mb.num_rows, mb.padded_len)
    return sum(cost(round_up(n, sequence_length_round)) for n in mb.lengths)


def compute_stats(
    ranks: Sequence[Sequence[MicroBatch]],
    *,
    max_tokens: int,
    sequence_length_round: int,
    cost: CostModel,
    lower_bound: int,
    planner_seconds: float,
    oversize: int,
    truncated_tokens: int,
    micro_batch_costs: Sequence[Sequence[float]] | None = None,
) -> PlanStats:
    """Figures of a plan given per rank its ordered micro-batches (and, optionally, their
    precomputed costs, aligned; otherwise computed with micro_batch_cost)."""
    dp = max(len(ranks), 1)
    if micro_batch_costs is None:
        micro_batch_costs = [
            [micro_batch_cost(mb, cost, sequence_length_round) for mb in mbs] for mbs in ranks
        ]
    rank_tokens = [sum(map(_COMPUTED, mbs)) for mbs in ranks]
    computed = sum(rank_tokens)
    real = sum(sum(map(_REAL, mbs)) for mbs in ranks)
    max_computed = max((max(map(_COMPUTED, mbs), default=0) for mbs in ranks), default=0)
    fillers = sum(sum(map(_FILLER, mbs)) for mbs in ranks)
    filler_tokens = sum(sum(map(mul, map(_FILLER, mbs), map(_COMPUTED, mbs))) for mbs in ranks)
    used = sum(len(mbs) for mbs in ranks) - fillers  # non-filler micro-batches
    rank_costs = [sum(c) for c in micro_batch_costs]
    # the slowest rank at each micro-batch index (ranks may differ in length: pad with 0)
    width = max((len(c) for c in micro_batch_costs), default=0)
    padded_costs = [list(c) + [0.0] * (width - len(c)) for c in micro_batch_costs]
    slowest = sum(map(max, zip(*padded_costs, strict=True))) if padded_costs and width else 0.0
    mean_tokens = computed / dp
    mean_cost = sum(rank_costs) / dp
    return PlanStats(
        lower_bound=lower_bound,
        padding_efficiency=real / computed if computed else 1.0,
        token_imbalance=max(rank_tokens) / mean_tokens if mean_tokens else 1.0,
        cost_imbalance=max(rank_costs) / mean_cost if mean_cost else 1.0,
        lockstep_efficiency=mean_cost / slowest if slowest else 1.0,
        max_computed_tokens=max_computed,
        planner_seconds=planner_seconds,
        oversize=oversize,
        fillers=fillers,
        truncated_tokens=truncated_tokens,
        budget_utilization=(computed - filler_tokens) / (used * max_tokens) if used else 0.0,
    )
