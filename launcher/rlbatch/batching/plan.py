"""Plan objects: what the planner produces and the engine executes.

Pure data (frozen dataclasses of ints, floats and tuples). ``docs/interfaces.md`` is the
contract; ``to_json`` is the document ``rlbatch-plan --json`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward unit on one DP rank.

    samples: indices into the pass's input list, in execution (row / packing) order.
    lengths: the sequence length used for each sample (equal to the input length unless the
        oversize policy ``truncate`` cut it), aligned with ``samples``.
    padded_len: padded mode: the row length (round_up(max(lengths), r)); packed mode: the
        packed row length (sum of round_up(length, r)).
    computed_tokens: tokens the model computes: rows * padded_len (padded) or the sum of
        rounded lengths (packed). Never above the budget, except an ``isolate``d oversize
        sample (flagged by ``oversize``).
    real_tokens: sum of lengths.
    packed: True for packed (THD / block-diagonal) micro-batches.
    filler: a zero-weight micro-batch with no samples, so that every rank runs the same count;
        the engine runs one row of ``padded_len`` dummy tokens whose loss weight is 0.
    oversize: holds one sample longer than the budget (isolate policy).
    """

    samples: tuple[int, ...]
    lengths: tuple[int, ...]
    padded_len: int
    computed_tokens: int
    real_tokens: int
    packed: bool = False
    filler: bool = False
    oversize: bool = False

    @property
    def num_rows(self) -> int:
        """Rows of the input tensor: samples for padded, 1 for packed or filler."""
        if self.packed or self.filler:
            return 1
        return len(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": list(self.samples),
            "padded_len": self.padded_len,
            "computed_tokens": self.computed_tokens,
            "real_tokens": self.real_tokens,
            "filler": self.filler,
        }


def new_micro_batch(
    samples: tuple[int, ...],
    lengths: tuple[int, ...],
    padded_len: int,
    computed_tokens: int,
    real_tokens: int,
    packed: bool,
    oversize: bool,
) -> MicroBatch:
    """A non-filler MicroBatch, built without the frozen dataclass __init__ (one field at a
    time through object.__setattr__): the planner makes tens of thousands of them. The result
    is the same object (fields, equality, hash) as MicroBatch(...)."""
    mb = object.__new__(MicroBatch)
    d = mb.__dict__
    d["samples"] = samples
    d["lengths"] = lengths
    d["padded_len"] = padded_len
    d["computed_tokens"] = computed_tokens
    d["real_tokens"] = real_tokens
    d["packed"] = packed
    d["filler"] = False
    d["oversize"] = oversize
    return mb


@dataclass(frozen=True)
class RankPlan:
    """The ordered micro-batches of one DP rank."""

    rank: int
    micro_batches: tuple[MicroBatch, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "micro_batches": [mb.to_json() for mb in self.micro_batches]}


@dataclass(frozen=True)
class PlanStats:
    """Quality figures of a plan (docs/batching.md)."""

    lower_bound: int
    """max(ceil(T / (D*B)), ceil(#(L > B/2) / D)): no plan can use fewer micro-batches per rank."""
    padding_efficiency: float
    """real tokens / computed tokens."""
    token_imbalance: float
    """max over ranks of computed tokens / mean."""
    cost_imbalance: float
    """max over ranks of cost (a*L + b*L^2) / mean."""
    lockstep_efficiency: float
    """ideal time / sum over micro-batch index of the slowest rank's cost."""
    max_computed_tokens: int
    """largest computed_tokens of any micro-batch."""
    planner_seconds: float
    oversize: int
    """samples longer than the budget (isolated or truncated)."""
    fillers: int
    """zero-weight filler micro-batches added so counts match."""
    truncated_tokens: int = 0
    """tokens cut by the truncate policy."""
    budget_utilization: float = 0.0
    """mean computed_tokens / budget over non-filler micro-batches."""

    def to_json(self) -> dict[str, Any]:
        return {
            "lower_bound": self.lower_bound,
            "padding_efficiency": self.padding_efficiency,
            "token_imbalance": self.token_imbalance,
            "cost_imbalance": self.cost_imbalance,
            "lockstep_efficiency": self.lockstep_efficiency,
            "max_computed_tokens": self.max_computed_tokens,
            "planner_seconds": self.planner_seconds,
            "oversize": self.oversize,
            "fillers": self.fillers,
            "truncated_tokens": self.truncated_tokens,
            "budget_utilization": self.budget_utilization,
        }


@dataclass(frozen=True)
class PassPlan:
    """A global plan of one pass: every DP rank's micro-batches, computed identically on all
    ranks from the same global lengths (no count all-reduce needed)."""

    mode: str
    dp: int
    num_micro_batches: int
    """per rank; the same on every rank by construction."""
    microbatch_group_size: int
    """Megatron's microbatch_group_size_per_vp_stage to pass to the schedule (pp when no vpp)."""
    ranks: tuple[RankPlan, ...]
    stats: PlanStats
    max_tokens: int = 0
    """the budget the plan was made for."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def for_rank(self, rank: int) -> RankPlan:
        return self.ranks[rank]

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "dp": self.dp,
            "num_micro_batches": self.num_micro_batches,
            "microbatch_group_size": self.microbatch_group_size,
            "ranks": [r.to_json() for r in self.ranks],
            "stats": self.stats.to_json(),
        }
