"""Pool mode: one pass over a mini-batch through per-rank pools, every rule of every mode,
a global stream reshuffled per step, pool_micro_batches_per_step as the least count."""

from __future__ import annotations

import pytest
from batching_checks import check_plan, plan_key
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbatch.batching import CostModel, make_workload, plan_pass
from rlbatch.batching.pool import step_permutation
from rlbatch.config.schema import BatchingMode, BatchingPassConfig, OversizePolicy, PoolStrategy

LENGTHS = make_workload("grpo_math", 600, seed=3)


def config(**kw) -> BatchingPassConfig:  # type: ignore[no-untyped-def]
    base = dict(mode=BatchingMode.pool, max_tokens=16384, pool_size=32)
    base.update(kw)
    return BatchingPassConfig(**base)


@pytest.mark.parametrize(
    "kw",
    [
        {"pool_strategy": PoolStrategy.prefer_closest},
        {"pool_strategy": PoolStrategy.prefer_first},
        {"pool_packing": True},
    ],
)
def test_pass_follows_the_rules_and_covers_every_sample_once(kw: dict) -> None:
    cfg = config(**kw)
    plan = plan_pass(LENGTHS, cfg, dp=4, pp=2, vpp=2)
    check_plan(plan, LENGTHS, cfg, dp=4, pp=2, vpp=2)


def test_stream_is_a_global_shuffle_per_step() -> None:
    n = len(LENGTHS)
    p1, p2 = step_permutation(n, 7, 1), step_permutation(n, 7, 2)
    assert sorted(p1) == sorted(p2) == list(range(n)) and p1 != p2
    same = [plan_key(plan_pass(LENGTHS, config(), dp=2, seed=7, step=s)) for s in (1, 1, 2)]
    assert same[0] == same[1] != same[2]  # deterministic per (seed, step), reshuffled per step


def test_prefer_closest_pads_less_than_prefer_first() -> None:
    def efficiency(cfg: BatchingPassConfig) -> float:
        return plan_pass(LENGTHS, cfg, dp=2).stats.padding_efficiency

    first = config(pool_strategy=PoolStrategy.prefer_first)
    assert efficiency(config()) > efficiency(first)


def test_micro_batches_per_step_is_the_least_count() -> None:
    natural = plan_pass(LENGTHS, config(), dp=2).num_micro_batches
    more = plan_pass(LENGTHS, config(pool_micro_batches_per_step=natural + 3), dp=2)
    assert more.num_micro_batches == natural + 3
    check_plan(more, LENGTHS, config(), dp=2)
    vpp = plan_pass(LENGTHS, config(pool_micro_batches_per_step=natural + 3), dp=2, pp=2, vpp=2)
    assert vpp.num_micro_batches == natural + 3 + (natural + 3) % 2  # VPP-valid (N = pp = 2)
    with pytest.raises(ValueError, match="pool_micro_batches_per_step=0"):
        plan_pass(LENGTHS, config(pool_micro_batches_per_step=0), dp=2)
    with pytest.raises(ValueError, match="step=0: optimizer steps are numbered from 1"):
        plan_pass(LENGTHS, config(), dp=2, step=0)


def test_oversize_in_the_stream() -> None:
    lengths = [100] * 30 + [10000] + [100] * 30
    plan = plan_pass(lengths, config(max_tokens=1024, oversize=OversizePolicy.isolate), dp=2)
    giant = [mb for rp in plan.ranks for mb in rp.micro_batches if 30 in mb.samples]
    assert len(giant) == 1 and giant[0].samples == (30,) and giant[0].oversize
    with pytest.raises(ValueError, match="sample 30"):
        plan_pass(lengths, config(max_tokens=1024), dp=2)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 3000), max_size=150),
    st.integers(1, 16),
    st.sampled_from([(1, 1, None), (2, 2, None), (2, 2, 3), (4, 2, None)]),
    st.integers(1, 40),
    st.sampled_from(list(PoolStrategy)),
    st.booleans(),
    st.integers(1, 5),
    st.integers(1, 11),
    st.sampled_from([OversizePolicy.isolate, OversizePolicy.truncate]),
)
def test_pool_pass_property(
    lengths: list[int],
    dp: int,
    pipe: tuple[int, int, int | None],
    pool_size: int,
    strategy: PoolStrategy,
    packing: bool,
    per_step: int,
    step: int,
    oversize: OversizePolicy,
) -> None:
    """Every rule holds, at least per_step micro-batches per rank, deterministic per step."""
    pp, vpp, group = pipe
    cfg = config(
        max_tokens=2048, sequence_length_round=8, pool_size=pool_size, pool_strategy=strategy,
        pool_packing=packing, pool_micro_batches_per_step=per_step, oversize=oversize,
    )  # fmt: skip
    cost = CostModel(1.0, 1e-4)

    def plan():  # type: ignore[no-untyped-def]
        return plan_pass(
            lengths, cfg, dp=dp, pp=pp, vpp=vpp, microbatch_group_size=group, cost=cost,
            seed=3, step=step,
        )  # fmt: skip

    first = plan()
    check_plan(first, lengths, cfg, dp=dp, pp=pp, vpp=vpp, group=group, cost=cost)
    assert first.num_micro_batches >= (per_step if lengths else 0)
    assert plan_key(plan()) == plan_key(first)
