"""Independent checks of the planner's rules (docs/batching.md), shared by the tests.

Everything here recomputes from the plan's raw fields and the input lengths; it does not call
the planner's own stats code.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlbatch.batching import CostModel, PassPlan, is_valid_count
from rlbatch.config.schema import BatchingPassConfig, OversizePolicy


def round_up(n: int, r: int) -> int:
    return -(-n // r) * r


def mb_cost(mb, cost: CostModel, r: int) -> float:  # type: ignore[no-untyped-def]
    if mb.filler:
        return cost(mb.padded_len)
    if mb.packed:
        return sum(cost(round_up(n, r)) for n in mb.lengths)
    return len(mb.samples) * cost(mb.padded_len)


def check_plan(
    plan: PassPlan,
    lengths: Sequence[int],
    cfg: BatchingPassConfig,
    *,
    dp: int,
    pp: int = 1,
    vpp: int = 1,
    group: int | None = None,
    cost: CostModel | None = None,
    samples: Sequence[int] | None = None,
) -> None:
    """Assert every rule. samples: the indices the plan must cover (default: all)."""
    B, r = cfg.max_tokens, cfg.sequence_length_round
    cost = cost or CostModel(1.0, 0.0)
    expected = sorted(range(len(lengths)) if samples is None else samples)
    # Rule 1: every sample exactly once.
    seen = [s for rp in plan.ranks for mb in rp.micro_batches for s in mb.samples]
    assert sorted(seen) == expected
    # Rule 4: equal counts, by construction; ranks numbered.
    assert plan.dp == dp and len(plan.ranks) == dp
    assert [rp.rank for rp in plan.ranks] == list(range(dp))
    for rp in plan.ranks:
        assert len(rp.micro_batches) == plan.num_micro_batches
    # Rule 5: VPP-valid count, N reported.
    n_group = (group if group is not None else pp) if vpp > 1 else pp
    assert plan.microbatch_group_size == n_group
    assert is_valid_count(plan.num_micro_batches, pp, vpp, n_group)
    if vpp > 1 and plan.num_micro_batches:
        m = plan.num_micro_batches
        assert pp <= n_group <= m and (m % n_group == 0 or m % n_group >= pp)
    # Rule 2: budget, oversize policy, micro-batch fields consistent.
    oversize = [i for i in expected if round_up(lengths[i], r) > B]
    fillers = 0
    real = computed = 0
    cut = 0
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            computed += mb.computed_tokens
            real += mb.real_tokens
            if mb.filler:
                fillers += 1
                assert mb.samples == () and mb.real_tokens == 0
                continue
            assert mb.samples and len(mb.lengths) == len(mb.samples)
            for s, n in zip(mb.samples, mb.lengths, strict=True):
                if cfg.oversize == OversizePolicy.truncate and round_up(lengths[s], r) > B:
                    assert n == B // r * r
                    cut += lengths[s] - n
                else:
                    assert n == lengths[s]
            rounded = [round_up(n, r) for n in mb.lengths]
            if mb.packed:
                assert mb.computed_tokens == mb.padded_len == sum(rounded)
            else:
                assert mb.padded_len == max(rounded)
                assert mb.computed_tokens == len(mb.samples) * mb.padded_len
            assert mb.real_tokens == sum(mb.lengths)
            if mb.computed_tokens > B:
                assert cfg.oversize == OversizePolicy.isolate
                assert mb.oversize and len(mb.samples) == 1
    assert plan.stats.oversize == len(oversize)
    assert plan.stats.fillers == fillers
    assert plan.stats.truncated_tokens == cut
    # Rule 8: the lower bound really is one.
    cap = B // r * r if cfg.oversize == OversizePolicy.truncate else B  # isolated: one full MB
    rl = [min(round_up(lengths[i], r), cap) for i in expected]
    if rl:
        lb = max(-(-sum(rl) // (dp * B)), -(-sum(1 for x in rl if 2 * x > B) // dp))
        assert plan.stats.lower_bound == lb
        assert plan.num_micro_batches >= lb
    # Stats recomputed independently.
    if computed:
        assert abs(plan.stats.padding_efficiency - real / computed) < 1e-9
    costs = [[mb_cost(mb, cost, r) for mb in rp.micro_batches] for rp in plan.ranks]
    totals = [sum(c) for c in costs]
    mean = sum(totals) / dp
    if mean > 0:
        assert abs(plan.stats.cost_imbalance - max(totals) / mean) < 1e-6
        slowest = sum(max(c[i] for c in costs) for i in range(plan.num_micro_batches))
        assert abs(plan.stats.lockstep_efficiency - mean / slowest) < 1e-6
    # Lockstep order: costliest first on every rank.
    for c in costs:
        assert all(c[i] >= c[i + 1] - 1e-6 * max(c[i], 1.0) for i in range(len(c) - 1))


def plan_key(plan: PassPlan) -> object:
    """The plan minus its timing, for determinism checks."""
    doc = plan.to_json()
    doc["stats"].pop("planner_seconds")
    return doc
