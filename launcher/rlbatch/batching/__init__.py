"""rlbatch.batching: the pure micro-batch planner (docs/batching.md).

Ints and config in, frozen plan objects out. No torch, torch.distributed, megatron, hydra,
omegaconf, logging or environment reads (tests/unit/batching/test_purity.py enforces it).
"""

from rlbatch.batching.assemble import sibling_spread
from rlbatch.batching.cost import (
    TOKEN_COUNT,
    CostModel,
    attention_flops_per_token_pair,
    cost_model_for,
    linear_flops_per_token,
)
from rlbatch.batching.minibatch import split_mini_batches
from rlbatch.batching.plan import MicroBatch, PassPlan, PlanStats, RankPlan
from rlbatch.batching.planner import plan_pass
from rlbatch.batching.stats import compute_stats, lower_bound, micro_batch_cost
from rlbatch.batching.vpp import is_valid_count, resolve_group_size, valid_count
from rlbatch.batching.workloads import GROUP_SIZE, MAX_LENGTH, make_workload

__all__ = [
    "GROUP_SIZE",
    "MAX_LENGTH",
    "TOKEN_COUNT",
    "CostModel",
    "MicroBatch",
    "PassPlan",
    "PlanStats",
    "RankPlan",
    "attention_flops_per_token_pair",
    "compute_stats",
    "cost_model_for",
    "is_valid_count",
    "linear_flops_per_token",
    "lower_bound",
    "make_workload",
    "micro_batch_cost",
    "plan_pass",
    "resolve_group_size",
    "sibling_spread",
    "split_mini_batches",
    "valid_count",
]
