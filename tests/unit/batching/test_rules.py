"""Hypothesis properties: every rule of docs/batching.md in every mode, dp 1..64, pp/vpp."""

from __future__ import annotations

from batching_checks import check_plan, plan_key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbatch.batching import CostModel, plan_pass
from rlbatch.config.schema import (
    BatchingMode,
    BatchingPassConfig,
    OversizePolicy,
    PoolStrategy,
)

PIPELINES = [
    (1, 1, None),
    (2, 1, None),
    (2, 2, None),
    (2, 2, 3),
    (4, 2, None),
    (3, 3, 5),
    (2, 4, 2),
]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw: st.DrawFn, modes: list[BatchingMode] | None = None) -> dict:
    r = draw(st.sampled_from([1, 2, 8, 64]))
    budget = r * draw(st.integers(1, 64))
    longest = draw(st.sampled_from([budget // 2 + 1, budget, budget * 2]))
    lengths = draw(st.lists(st.integers(1, max(longest, 1)), max_size=300))
    mode = draw(st.sampled_from(modes or list(BatchingMode)))
    cfg = BatchingPassConfig(
        mode=mode,
        max_tokens=budget,
        sequence_length_round=r,
        micro_batch_size=draw(st.integers(1, 16)),
        oversize=draw(st.sampled_from([OversizePolicy.isolate, OversizePolicy.truncate])),
        pool_size=draw(st.integers(1, 40)),
        pool_strategy=draw(st.sampled_from(list(PoolStrategy))),
        pool_packing=draw(st.booleans()),
        spread_siblings=draw(st.booleans()),
    )
    pp, vpp, group = draw(st.sampled_from(PIPELINES))
    return {
        "lengths": lengths,
        "cfg": cfg,
        "dp": draw(st.integers(1, 64)),
        "pp": pp,
        "vpp": vpp,
        "group": group,
        "group_size": draw(st.sampled_from([1, 4, 16])),
        "cost": CostModel(1.0, draw(st.sampled_from([0.0, 1e-4, 1e-2]))),
        "seed": draw(st.integers(0, 3)),
    }


def run(case: dict):  # type: ignore[no-untyped-def]
    return plan_pass(
        case["lengths"],
        case["cfg"],
        dp=case["dp"],
        pp=case["pp"],
        vpp=case["vpp"],
        microbatch_group_size=case["group"],
        group_size=case["group_size"],
        cost=case["cost"],
        seed=case["seed"],
    )


@SETTINGS
@given(cases())
def test_every_rule_holds(case: dict) -> None:
    plan = run(case)
    check_plan(
        plan,
        case["lengths"],
        case["cfg"],
        dp=case["dp"],
        pp=case["pp"],
        vpp=case["vpp"],
        group=case["group"],
        cost=case["cost"],
    )


@settings(max_examples=60, deadline=None)
@given(cases())
def test_deterministic(case: dict) -> None:
    assert plan_key(run(case)) == plan_key(run(case))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_fillers_only_when_nothing_is_left_to_split(case: dict) -> None:
    """Zero-weight fillers are the last resort: a plan with fillers has no micro-batch of two
    or more samples left (each could have been split instead)."""
    plan = run(case)
    if plan.stats.fillers:
        assert all(len(mb.samples) <= 1 for rp in plan.ranks for mb in rp.micro_batches)
