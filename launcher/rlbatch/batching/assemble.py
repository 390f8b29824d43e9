"""Shared steps of every mode: prepare lengths (oversize policy, rounding, sort order) and turn
bins into a global PassPlan (equal VPP-valid counts, balanced ranks, lockstep order, stats)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Any

from rlbatch.batching.cost import CostModel
from rlbatch.batching.packing import eliminate_bins
from rlbatch.batching.plan import MicroBatch, PassPlan, PlanStats, RankPlan, new_micro_batch
from rlbatch.batching.sharding import (
    BinShape,
    assign_balanced,
    order_for_lockstep,
    rebalance_samples,
    split_to_count,
)
from rlbatch.batching.stats import compute_stats, lower_bound
from rlbatch.batching.vpp import valid_count
from rlbatch.config.schema import BatchingPassConfig, OversizePolicy


@dataclass(frozen=True)
class Prepared:
    """Lengths of one pass after the oversize policy.

    lengths: per sample, the length used (truncated where the policy cut it).
    rounded: round_up(lengths, r).
    oversize: indices longer than the budget (isolated or truncated).
    """

    lengths: list[int]
    rounded: list[int]
    oversize: list[int]
    truncated_tokens: int
    cut: dict[int, int]
    """tokens cut from each truncated sample."""

    def is_isolated(self, i: int, budget: int) -> bool:
        return self.rounded[i] > budget


def check_budget(cfg: BatchingPassConfig, pass_name: str) -> tuple[int, int]:
    budget, r = cfg.max_tokens, cfg.sequence_length_round
    if r < 1:
        raise ValueError(f"batching.{pass_name}.sequence_length_round={r} must be >= 1")
    if budget < r:
        raise ValueError(
            f"batching.{pass_name}.max_tokens={budget} is smaller than "
            f"batching.{pass_name}.sequence_length_round={r}: raise max_tokens"
        )
    return budget, r


def prepare_lengths(
    lengths: Sequence[int], cfg: BatchingPassConfig, pass_name: str = "train"
) -> Prepared:
    """Validate lengths and apply the oversize policy (never silently)."""
    budget, r = check_budget(cfg, pass_name)
    lens = list(lengths)
    if lens and set(map(type, lens)) != {int}:
        bad = next(i for i, x in enumerate(lens) if type(x) is not int)
        raise ValueError(f"sample {bad}: length {lens[bad]!r} is not an int")
    if lens and min(lens) < 1:
        bad = next(i for i, x in enumerate(lens) if x < 1)
        raise ValueError(f"sample {bad}: length {lens[bad]} must be >= 1")
    rounded = [-(-n // r) * r for n in lens]
    oversize = (
        [i for i, x in enumerate(rounded) if x > budget]
        if rounded and max(rounded) > budget
        else []
    )
    cut: dict[int, int] = {}
    if oversize:
        policy = cfg.oversize
        if policy == OversizePolicy.error:
            i = oversize[0]
            raise ValueError(
                f"sample {i} has length {lens[i]} (rounded to {rounded[i]}), more than the "
                f"micro-batch budget batching.{pass_name}.max_tokens={budget}"
                f" ({len(oversize)} such samples): raise batching.{pass_name}.max_tokens, or set "
                f"batching.{pass_name}.oversize=isolate (own micro-batch) or truncate"
            )
        if policy == OversizePolicy.truncate:
            keep = budget // r * r
            for i in oversize:
                cut[i] = lens[i] - keep
                lens[i] = keep
                rounded[i] = keep
    return Prepared(lens, rounded, oversize, sum(cut.values()), cut)


def length_order(prep: Prepared, group_size: int, spread_siblings: bool) -> list[int]:
    """Sample indices by decreasing rounded length. Ties: with spread_siblings, sibling k of
    every group before sibling k+1 of any, so equal-length siblings land in different bins;
    otherwise by index. (A stable sort of that scan order: reverse=True keeps ties stable.)"""
    n = len(prep.rounded)
    g = max(group_size, 1)
    if spread_siblings and g > 1:
        scan: Sequence[int] = [grp + s for s in range(g) for grp in range(0, n - s, g)]
    else:
        scan = range(n)
    return sorted(scan, key=prep.rounded.__getitem__, reverse=True)


def _build_micro_batches(
    bins: list[list[int]], prep: Prepared, packed: bool, budget: int
) -> list[MicroBatch]:
    """One MicroBatch per bin. Bins hold samples by decreasing rounded length: the first sets
    a padded micro-batch's padded length and is the longest of a packed one. (One pass, one
    itemgetter per bin for its lengths and rounded lengths: this runs once per micro-batch.)"""
    lengths, rounded = prep.lengths, prep.rounded
    out: list[MicroBatch] = []
    append = out.append
    for b in bins:
        top = rounded[b[0]]
        if len(b) == 1:
            lens: tuple[int, ...] = (lengths[b[0]],)
            real = lens[0]
            computed = top
        else:
            get = itemgetter(*b)
            lens = get(lengths)
            real = sum(lens)
            computed = sum(get(rounded)) if packed else top * len(b)
        padded_len = computed if packed else top
        append(new_micro_batch(tuple(b), lens, padded_len, computed, real, packed, top > budget))
    return out


def filler_micro_batch(r: int, packed: bool) -> MicroBatch:
    """A zero-weight micro-batch: one row of r dummy tokens."""
    return MicroBatch(
        (), (), padded_len=r, computed_tokens=r, real_tokens=0, packed=packed, filler=True
    )


Repacker = Callable[[int], list[list[int]]]
"""capacity -> bins of the same samples, packed to that (smaller) capacity."""


def _even_out(
    bins: list[list[int]], slots: int, covered_tokens: int, budget: int, repack: Repacker
) -> list[list[int]]:
    """When the count leaves spare slots (dp*M > bins, by 1% or more), repack to a smaller
    capacity so the dp*M micro-batches are evenly filled instead of full ones plus split halves:
    micro-batch i then costs about the same on every rank (lockstep) and uses less memory.

    The capacity aims at 3/4 of the spare slots, assuming bins fill the same fraction of a
    smaller capacity as they did of the budget; if that needs more than ``slots`` bins, one
    try halfway to the budget; else the original bins stay."""
    spare = slots - len(bins)
    if not bins or spare * 100 < slots:
        return bins
    fill = covered_tokens / (len(bins) * budget)
    cap = math.ceil(covered_tokens / (fill * (slots - spare / 4)))
    for attempt in (cap, (cap + budget) // 2):
        if attempt >= budget:
            break
        candidate = repack(attempt)
        if len(candidate) <= slots:
            return candidate
    return bins


def _tighten(
    bins: list[list[int]],
    prep: Prepared,
    budget: int,
    covered_tokens: int,
    count: int,
    dp: int,
    pp: int,
    vpp: int,
    mb_group_size: int,
    min_count: int,
) -> tuple[list[list[int]], int]:
    """Packed bins just above a multiple of dp (BFD a few bins over the optimum) cost every rank
    one more micro-batch: try to empty the excess bins into the others' room instead."""
    lower = valid_count(max(count - 1, min_count, 1), pp, vpp, mb_group_size)
    if lower >= count or dp * lower * budget < covered_tokens or prep.oversize:
        return bins, count
    fewer = eliminate_bins(bins, prep.rounded, budget, len(bins) - dp * lower)
    if fewer is None:
        return bins, count
    return fewer, lower


def _rank_plans(
    assignment: list[list[int]],
    bins: list[list[int]],
    costs: list[float],
    prep: Prepared,
    packed: bool,
    budget: int,
    r: int,
) -> tuple[list[RankPlan], list[list[float]]]:
    """Each rank's micro-batches in lockstep order (items >= len(bins) are fillers), and their
    costs in the same order."""
    nbins = len(bins)
    built = _build_micro_batches(bins, prep, packed, budget)
    filler = filler_micro_batch(r, packed)
    plans, plan_costs = [], []
    for rank, items in enumerate(assignment):
        ordered = order_for_lockstep(items, costs.__getitem__)
        plan_costs.append([costs[i] for i in ordered])
        plans.append(RankPlan(rank, tuple(built[i] if i < nbins else filler for i in ordered)))
    return plans, plan_costs


def assemble_plan(
    bins: list[list[int]],
    prep: Prepared,
    cfg: BatchingPassConfig,
    *,
    mode: str,
    packed: bool,
    dp: int,
    pp: int,
    vpp: int,
    mb_group_size: int,
    cost: CostModel,
    started: float,
    min_count: int = 0,
    samples: Sequence[int] | None = None,
    repack: Repacker | None = None,
    extra: dict[str, Any] | None = None,
) -> PassPlan:
    """Bins -> PassPlan: count M = smallest VPP-valid count >= ceil(bins / dp) (and min_count);
    even out the bins over dp*M slots (``repack``), split the costliest bins (>= 2 samples) up
    to dp*M, fill the rest with zero-weight fillers; assign exactly M per rank balancing cost;
    order each rank costliest first.

    samples: the sample indices the bins cover (default: all of prep)."""
    budget, r = cfg.max_tokens, cfg.sequence_length_round
    per_length = {x: cost.a * x + cost.b * x * x for x in set(prep.rounded)}  # few distinct
    sample_cost = list(map(per_length.__getitem__, prep.rounded))
    shape = BinShape(prep.rounded, sample_cost, cost, packed)
    natural_bins = len(bins)
    count = valid_count(max(-(-natural_bins // dp), min_count), pp, vpp, mb_group_size)
    covered = prep.rounded if samples is None else [prep.rounded[i] for i in samples]
    covered_tokens = sum(covered)
    if packed and repack is not None:
        bins, count = _tighten(
            bins, prep, budget, covered_tokens, count, dp, pp, vpp, mb_group_size, min_count
        )
    if repack is not None:
        bins = _even_out(bins, dp * count, covered_tokens, budget, repack)
    if packed:
        costs = [sum(map(sample_cost.__getitem__, b)) for b in bins]
    else:
        costs = [len(b) * sample_cost[b[0]] for b in bins]
    splits = split_to_count(bins, costs, dp * count, shape)
    costs += [cost.padded(1, r)] * (dp * count - len(bins))
    assignment = assign_balanced(costs, dp, count)
    moves = rebalance_samples(bins, assignment, costs, shape, budget)
    rank_plans, rank_costs = _rank_plans(assignment, bins, costs, prep, packed, budget, r)
    lb = lower_bound(covered, dp, budget)
    info: dict[str, Any] = {
        "natural_micro_batches": natural_bins,
        "splits": splits,
        "sample_moves": moves,
        "k_over_lb": count / lb if lb else 1.0,
    }
    info.update(extra or {})
    stats = _plan_stats(rank_plans, rank_costs, prep, samples, cfg, cost, lb, started)
    return PassPlan(
        mode=mode,
        dp=dp,
        num_micro_batches=count,
        microbatch_group_size=mb_group_size,
        ranks=tuple(rank_plans),
        stats=stats,
        max_tokens=budget,
        extra=info,
    )


def _plan_stats(
    rank_plans: list[RankPlan],
    rank_costs: list[list[float]],
    prep: Prepared,
    samples: Sequence[int] | None,
    cfg: BatchingPassConfig,
    cost: CostModel,
    bound: int,
    started: float,
) -> PlanStats:
    """The plan's statistics; planner_seconds runs from ``started`` to now."""
    if samples is None:
        oversize, truncated = len(prep.oversize), prep.truncated_tokens
    else:  # a tiny looping dataset can serve a sample twice in one step: count occurrences
        over = set(prep.oversize)
        oversize = sum(1 for i in samples if i in over) if over else 0
        truncated = sum(prep.cut.get(i, 0) for i in samples) if prep.cut else 0
    stats = compute_stats(
        [rp.micro_batches for rp in rank_plans],
        max_tokens=cfg.max_tokens,
        sequence_length_round=cfg.sequence_length_round,
        cost=cost,
        lower_bound=bound,
        planner_seconds=0.0,
        oversize=oversize,
        truncated_tokens=truncated,
        micro_batch_costs=rank_costs,
    )
    return replace(stats, planner_seconds=time.perf_counter() - started)


def sibling_spread(plan: PassPlan, group_size: int) -> int:
    """Most siblings of one prompt (contiguous runs of group_size samples) on a single rank."""
    worst = 0
    for rp in plan.ranks:
        counts: dict[int, int] = {}
        for mb in rp.micro_batches:
            for s in mb.samples:
                g = s // group_size
                counts[g] = counts.get(g, 0) + 1
        if counts:
            worst = max(worst, max(counts.values()))
    return worst
