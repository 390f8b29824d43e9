"""Golden cases (ROLL's dynamic-batching worked example, budget-respecting) and worst cases."""

from __future__ import annotations

import pytest
from batching_checks import check_plan

from rlbatch.batching import CostModel, plan_pass, sibling_spread
from rlbatch.config.schema import BatchingMode, BatchingPassConfig, OversizePolicy

SEED_002 = [7, 6, 8, 5, 1, 3, 8, 6]  # dp=2, max_tokens=10, sequence_length_round=2


def samples_of(plan):  # type: ignore[no-untyped-def]
    return [[mb.samples for mb in rp.micro_batches] for rp in plan.ranks]


def test_seed_002_dynamic_respects_the_budget() -> None:
    """ROLL's published answer puts 2 rows x 6 = 12 tokens in a 10-token micro-batch.
    Rounded lengths are 8,6,8,6,2,4,8,6: no two of 8/6 fit 10 padded tokens, so they sit alone;
    3 and 1 (padded 4 and 2) could share one, but 7 runs need 4 per rank anyway, so that pair
    is split too (its halves get padded lengths 4 and 2, recomputed)."""
    cfg = BatchingPassConfig(mode=BatchingMode.dynamic, max_tokens=10, sequence_length_round=2)
    plan = plan_pass(SEED_002, cfg, dp=2)
    check_plan(plan, SEED_002, cfg, dp=2)
    assert plan.num_micro_batches == 4
    assert plan.stats.lower_bound == 3
    assert plan.stats.max_computed_tokens == 8 <= 10
    assert samples_of(plan) == [[(0,), (6,), (7,), (4,)], [(2,), (1,), (3,), (5,)]]
    assert [[mb.padded_len for mb in rp.micro_batches] for rp in plan.ranks] == [
        [8, 8, 6, 2],
        [8, 6, 6, 4],
    ]
    # 44 real tokens in 48 computed (the seed's budget-breaking answer computes 56).
    assert plan.stats.padding_efficiency == pytest.approx(44 / 48)
    assert plan.stats.token_imbalance == 1.0 and plan.stats.cost_imbalance == 1.0


def test_seed_002_packed_reaches_the_lower_bound() -> None:
    cfg = BatchingPassConfig(mode=BatchingMode.packed, max_tokens=10, sequence_length_round=2)
    plan = plan_pass(SEED_002, cfg, dp=2)
    check_plan(plan, SEED_002, cfg, dp=2)
    assert plan.num_micro_batches == plan.stats.lower_bound == 3
    assert samples_of(plan) == [[(6, 4), (0,), (1,)], [(7, 5), (2,), (3,)]]
    assert plan.stats.cost_imbalance == 1.0


def test_seed_002_with_vpp_splits_to_a_valid_count() -> None:
    """pp=2, vpp=2: 3 packed micro-batches per rank is not valid (3 % 2 = 1 < pp); 4 is. The
    packed pairs are split (or repacked evenly), each micro-batch re-padded to its own length."""
    cfg = BatchingPassConfig(mode=BatchingMode.packed, max_tokens=10, sequence_length_round=2)
    plan = plan_pass(SEED_002, cfg, dp=2, pp=2, vpp=2)
    check_plan(plan, SEED_002, cfg, dp=2, pp=2, vpp=2)
    assert plan.num_micro_batches == 4 and plan.microbatch_group_size == 2
    assert plan.stats.fillers == 0
    assert sorted(mb.padded_len for rp in plan.ranks for mb in rp.micro_batches) == [
        2,
        4,
        6,
        6,
        6,
        8,
        8,
        8,
    ]


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed", "pool"])
def test_all_lengths_equal(mode: str) -> None:
    lengths = [100] * 640
    cfg = BatchingPassConfig(
        mode=mode, max_tokens=1000, sequence_length_round=8, micro_batch_size=8
    )
    plan = plan_pass(lengths, cfg, dp=8, group_size=8)
    check_plan(plan, lengths, cfg, dp=8)
    # round_up(100, 8) = 104: 9 rows per micro-batch, 72 per rank -> 8 micro-batches.
    if mode in ("dynamic", "packed"):
        assert plan.num_micro_batches == plan.stats.lower_bound == 9 or plan.num_micro_batches == 9
        assert plan.stats.cost_imbalance == pytest.approx(1.0)
        assert plan.stats.lockstep_efficiency == pytest.approx(1.0)
    if mode != "pool":  # siblings of one prompt (8 contiguous samples) are spread out
        assert sibling_spread(plan, 8) <= 2


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed", "pool"])
def test_one_giant_error_names_sample_length_budget_and_key(mode: str) -> None:
    lengths = [10] * 20 + [5000] + [10] * 5
    cfg = BatchingPassConfig(mode=mode, max_tokens=1024)
    with pytest.raises(ValueError) as err:
        plan_pass(lengths, cfg, dp=2, pass_name="infer")
    msg = str(err.value)
    for part in ("sample 20", "5000", "1024", "batching.infer.max_tokens", "oversize"):
        assert part in msg


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed", "pool"])
def test_one_giant_isolated(mode: str) -> None:
    lengths = [10] * 20 + [5000] + [10] * 5
    cfg = BatchingPassConfig(mode=mode, max_tokens=1024, oversize=OversizePolicy.isolate)
    plan = plan_pass(lengths, cfg, dp=2)
    check_plan(plan, lengths, cfg, dp=2)
    giant = [mb for rp in plan.ranks for mb in rp.micro_batches if 20 in mb.samples]
    assert len(giant) == 1 and giant[0].samples == (20,) and giant[0].oversize
    assert giant[0].computed_tokens == 5000
    assert plan.stats.oversize == 1 and plan.stats.max_computed_tokens == 5000


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed", "pool"])
def test_one_giant_truncated(mode: str) -> None:
    lengths = [10] * 20 + [5000] + [10] * 5
    cfg = BatchingPassConfig(mode=mode, max_tokens=1020, oversize=OversizePolicy.truncate)
    plan = plan_pass(lengths, cfg, dp=2)
    check_plan(plan, lengths, cfg, dp=2)
    assert plan.stats.oversize == 1
    assert plan.stats.truncated_tokens == 5000 - 1016  # cut to the longest that fits: 127 * 8
    assert plan.stats.max_computed_tokens <= 1020


@pytest.mark.parametrize("mode", ["dynamic", "packed"])
def test_bimodal_just_over_half_the_budget(mode: str) -> None:
    """Samples of 504 > B/2 = 500 can never share a micro-batch: one each, and the count is
    the lower bound ceil(#big / dp)."""
    lengths = [504] * 37 + [8] * 50
    cfg = BatchingPassConfig(mode=mode, max_tokens=1000, sequence_length_round=8)
    plan = plan_pass(lengths, cfg, dp=4)
    check_plan(plan, lengths, cfg, dp=4)
    assert plan.stats.lower_bound == 10
    assert plan.num_micro_batches == 10
    if mode == "packed":  # the short ones fill the gaps next to the long ones
        assert plan.stats.fillers == 0


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed", "pool"])
def test_fewer_samples_than_ranks_get_zero_weight_fillers(mode: str) -> None:
    lengths = [100, 200, 300]
    cfg = BatchingPassConfig(mode=mode, max_tokens=1024)
    plan = plan_pass(lengths, cfg, dp=8)
    check_plan(plan, lengths, cfg, dp=8)
    assert plan.num_micro_batches == 1
    assert plan.stats.fillers == 5
    fillers = [mb for rp in plan.ranks for mb in rp.micro_batches if mb.filler]
    assert all(mb.samples == () and mb.real_tokens == 0 for mb in fillers)


def test_fillers_obey_the_vpp_rule() -> None:
    lengths = [100, 200, 300]
    cfg = BatchingPassConfig(mode=BatchingMode.packed, max_tokens=1024)
    plan = plan_pass(lengths, cfg, dp=2, pp=4, vpp=2, microbatch_group_size=6)
    check_plan(plan, lengths, cfg, dp=2, pp=4, vpp=2, group=6)
    assert plan.num_micro_batches == 6 and plan.stats.fillers == 12 - 3


@pytest.mark.parametrize("mode", ["fixed", "dynamic", "packed", "pool"])
def test_empty_input(mode: str) -> None:
    cfg = BatchingPassConfig(mode=mode)
    plan = plan_pass([], cfg, dp=4, pp=2, vpp=2)
    check_plan(plan, [], cfg, dp=4, pp=2, vpp=2)
    assert plan.num_micro_batches == 0 and plan.stats.lower_bound == 0
    assert plan.stats.padding_efficiency == 1.0


def test_cost_model_balances_attention_not_just_tokens() -> None:
    """One 4000-token sample vs eight of 500: equal tokens, but attention makes the long one
    costlier; with a quadratic cost the long sample's rank gets fewer tokens."""
    lengths = [4000, 4000] + [500] * 16
    cfg = BatchingPassConfig(mode=BatchingMode.packed, max_tokens=4096)
    plan = plan_pass(lengths, cfg, dp=2, cost=CostModel(1.0, 1e-3))
    check_plan(plan, lengths, cfg, dp=2, cost=CostModel(1.0, 1e-3))
    assert plan.stats.cost_imbalance == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"dp": 0}, "parallel.dp"),
        (
            {"dp": 2, "pp": 2, "vpp": 2, "microbatch_group_size": 1},
            "microbatch_group_size_per_vp_stage",
        ),
        ({"dp": 2, "pp": 1, "vpp": 2}, "parallel.vpp"),
    ],
)
def test_bad_parallel_arguments(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        plan_pass([10, 20], BatchingPassConfig(), **kwargs)


@pytest.mark.parametrize("lengths", [[10, 0], [10, -3], [10, 2.5], [10, "7"]])
def test_bad_lengths(lengths: list) -> None:
    with pytest.raises(ValueError, match="sample 1"):
        plan_pass(lengths, BatchingPassConfig(), dp=1)


def test_budget_below_round_is_rejected() -> None:
    with pytest.raises(ValueError, match="batching.train.max_tokens=4"):
        plan_pass([1], BatchingPassConfig(max_tokens=4, sequence_length_round=8), dp=1)


def test_fast_micro_batch_constructor_matches_the_dataclass() -> None:
    from rlbatch.batching.plan import MicroBatch, new_micro_batch

    a = new_micro_batch((3, 1), (9, 7), 16, 32, 16, False, False)
    b = MicroBatch((3, 1), (9, 7), 16, 32, 16, False, False, False)
    assert a == b and hash(a) == hash(b) and a.to_json() == b.to_json()
    with pytest.raises(AttributeError):
        a.padded_len = 1  # type: ignore[misc]
