"""Engine test helpers: the single-process Megatron world fixtures (imported by the test
modules: a conftest.py here would shadow tests/conftest.py's ``conftest`` module) and
hand-built plan objects (independent of the planner)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rlbatch.batching.plan import MicroBatch, PassPlan, PlanStats, RankPlan


def round_up(n: int, r: int) -> int:
    return -(-n // r) * r


def padded_mb(samples: Sequence[int], lengths: Sequence[int], r: int = 4) -> MicroBatch:
    width = round_up(max(lengths), r)
    return MicroBatch(tuple(samples), tuple(lengths), width, width * len(lengths), sum(lengths))


def packed_mb(samples: Sequence[int], lengths: Sequence[int], r: int = 4) -> MicroBatch:
    width = sum(round_up(n, r) for n in lengths)
    return MicroBatch(tuple(samples), tuple(lengths), width, width, sum(lengths), packed=True)


def filler_mb(width: int = 4) -> MicroBatch:
    return MicroBatch((), (), width, width, 0, filler=True)


def make_plan(ranks: Sequence[Sequence[MicroBatch]], group_size: int = 1) -> PassPlan:
    stats = PlanStats(1, 1.0, 1.0, 1.0, 1.0, 0, 0.0, 0, 0)
    rank_plans = tuple(RankPlan(i, tuple(mbs)) for i, mbs in enumerate(ranks))
    return PassPlan("test", len(ranks), len(ranks[0]), group_size, rank_plans, stats)


@pytest.fixture()
def megatron_world():
    """torch.distributed (a world of 1) + Megatron parallel state, initialized when missing
    (once per process in practice; other tests may have torn it down)."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel

    cfg = RunConfig()
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    return cfg


@pytest.fixture()
def tiny_cfg():
    """A fresh RunConfig with the tiny model (fp32), seeds reset."""
    from rlbatch.config.schema import RunConfig
    from rlbatch.engine import parallel

    cfg = RunConfig()
    if not parallel.is_initialized():
        parallel.initialize(cfg)
    parallel.seed(cfg.trainer.seed)
    return cfg
