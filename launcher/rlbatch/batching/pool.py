"""Pool mode (after cosmos-rl's pool batcher): one pass over a mini-batch, streamed through per-rank pools.

Pool mode has one meaning, in training and in rlbatch-plan alike: the samples of the pass (the
step's mini-batch) form a stream in a global order shuffled from (seed, step) (one permutation
over all ranks' samples, not a shuffle within each rank's shard). Each DP rank keeps a pool of
up to ``pool_size`` samples refilled from that stream; the ranks take turns forming one
micro-batch each from their pool until stream and pools are empty:

- padded, ``prefer_closest``: anchor = the oldest sample in the pool (no starvation), then
  repeatedly add the sample whose rounded length is closest to the current padded length, while
  rows * round_up(max_len) <= max_tokens;
- padded, ``prefer_first``: anchor = the oldest, then pool samples in arrival order (FIFO), each
  added if it still fits;
- ``pool_packing``: anchor = the oldest, then repeatedly the longest sample that still fits the
  packed budget (a best fit; the seed's greedy takes them in arrival order).

The micro-batches then get an equal count per rank, at least ``pool_micro_batches_per_step``
and valid for megatron's interleaved schedule, and a cost-balanced assignment like every other
mode. Nothing outlives the pass: a mini-batch is a fixed set of samples (rule 6 of docs/batching.md), so no
pool state is carried to the next step or checkpointed.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence

from rlbatch.batching.assemble import Prepared, assemble_plan, prepare_lengths
from rlbatch.batching.cost import CostModel
from rlbatch.batching.plan import PassPlan
from rlbatch.config.schema import BatchingPassConfig, PoolStrategy

_POS_BITS = 64  # a pool key is rounded_len << 64 | stream position (unique, arrival order)
_POS_MASK = (1 << _POS_BITS) - 1


def step_permutation(num_samples: int, seed: int, step: int) -> list[int]:
    """The global stream order of the pass at 1-based optimizer ``step`` (the same on every
    rank)."""
    step_index = step - 1  # the generator is seeded with the 0-based index of the step
    perm = list(range(num_samples))
    random.Random(f"rlbatch-pool:{seed}:{step_index}").shuffle(perm)
    return perm


class _Pool:
    """One rank's pool: samples with their stream positions, by arrival and by rounded length."""

    def __init__(self) -> None:
        self.arrival: list[int] = []  # stream positions, oldest first
        self.keys: list[int] = []  # sorted rounded << 64 | position
        self.sample_at: dict[int, int] = {}  # position -> sample

    def __len__(self) -> int:
        return len(self.arrival)

    def add(self, sample: int, position: int, rounded: int) -> None:
        self.arrival.append(position)
        insort(self.keys, (rounded << _POS_BITS) | position)
        self.sample_at[position] = sample

    def take(self, key: int, index: int | None = None) -> int:
        """Remove the entry with this key (at keys[index] if known); returns the sample."""
        if index is None:
            index = bisect_left(self.keys, key)
        del self.keys[index]
        position = key & _POS_MASK
        self.arrival.remove(position)
        return self.sample_at.pop(position)


class _PoolStream:
    """The pass's stream (shuffled from seed and step) and the dp per-rank pools it refills."""

    def __init__(self, prep: Prepared, cfg: BatchingPassConfig, dp: int, seed: int, step: int):
        self.prep, self.cfg = prep, cfg
        self.perm = step_permutation(len(prep.lengths), seed, step)
        self.cursor = 0
        self.pools = [_Pool() for _ in range(dp)]

    def refill(self, pool: _Pool) -> None:
        while len(pool) < self.cfg.pool_size and self.cursor < len(self.perm):
            sample = self.perm[self.cursor]
            pool.add(sample, self.cursor, self.prep.rounded[sample])
            self.cursor += 1

    def form_micro_batch(self, pool: _Pool) -> list[int]:
        """Take one micro-batch's samples out of the pool (decreasing rounded length)."""
        if not pool:
            return []
        rounded = self.prep.rounded
        budget = self.cfg.max_tokens
        anchor_pos = pool.arrival[0]
        anchor = pool.take((rounded[pool.sample_at[anchor_pos]] << _POS_BITS) | anchor_pos)
        chosen = [anchor]
        if rounded[anchor] > budget:  # isolated oversize sample
            return chosen
        if self.cfg.pool_packing:
            self._fill_packed(pool, chosen, budget - rounded[anchor])
        elif self.cfg.pool_strategy == PoolStrategy.prefer_first:
            self._fill_first(pool, chosen, rounded[anchor], budget)
        else:
            self._fill_closest(pool, chosen, rounded[anchor], budget)
        chosen.sort(key=lambda s: -rounded[s])
        return chosen

    def _fill_packed(self, pool: _Pool, chosen: list[int], room: int) -> None:
        while pool.keys:
            i = bisect_right(pool.keys, (room << _POS_BITS) | _POS_MASK) - 1
            if i < 0:
                return
            key = pool.keys[i]
            i = bisect_left(pool.keys, (key >> _POS_BITS) << _POS_BITS)  # oldest of that length
            key = pool.keys[i]
            room -= key >> _POS_BITS
            chosen.append(pool.take(key, i))

    def _fill_first(self, pool: _Pool, chosen: list[int], padded: int, budget: int) -> None:
        rows = 1
        for position in list(pool.arrival):
            sample = pool.sample_at[position]
            r = self.prep.rounded[sample]
            if (rows + 1) * max(padded, r) <= budget:
                pool.take((r << _POS_BITS) | position)
                chosen.append(sample)
                rows += 1
                padded = max(padded, r)

    def _fill_closest(self, pool: _Pool, chosen: list[int], padded: int, budget: int) -> None:
        rows = 1
        keys = pool.keys
        while keys and (rows + 1) * padded <= budget:
            hi = bisect_right(keys, (padded << _POS_BITS) | _POS_MASK)
            best: tuple[int, int] | None = None  # (distance, index)
            if hi > 0:  # longest sample not longer than padded: no extra padding
                below = keys[hi - 1] >> _POS_BITS
                best = (padded - below, bisect_left(keys, below << _POS_BITS))
            if hi < len(keys):
                above = keys[hi] >> _POS_BITS
                if (rows + 1) * above <= budget and (best is None or above - padded < best[0]):
                    best = (above - padded, hi)
            if best is None:
                return
            key = keys[best[1]]
            chosen.append(pool.take(key, best[1]))
            rows += 1
            padded = max(padded, key >> _POS_BITS)


def plan_pool_pass(
    lengths: Sequence[int],
    cfg: BatchingPassConfig,
    *,
    dp: int,
    pp: int,
    vpp: int,
    mb_group_size: int,
    cost: CostModel,
    seed: int,
    step: int,
    pass_name: str,
    started: float,
) -> PassPlan:
    """One pass over ``lengths`` in pool mode: the per-rank pools drain the (step-seeded) global
    stream, the ranks forming one micro-batch each in turn; the micro-batches then get equal,
    VPP-valid counts of at least ``cfg.pool_micro_batches_per_step`` and a cost-balanced
    assignment like every mode."""
    if cfg.pool_size < 1:
        raise ValueError(f"batching.{pass_name}.pool_size={cfg.pool_size} must be >= 1")
    if cfg.pool_micro_batches_per_step < 1:
        raise ValueError(
            f"batching.{pass_name}.pool_micro_batches_per_step="
            f"{cfg.pool_micro_batches_per_step} must be >= 1"
        )
    prep = prepare_lengths(lengths, cfg, pass_name)
    stream = _PoolStream(prep, cfg, dp, seed, step)
    bins: list[list[int]] = []
    active = True
    while active:
        active = False
        for pool in stream.pools:
            stream.refill(pool)
            mb = stream.form_micro_batch(pool)
            if mb:
                bins.append(mb)
                active = True
    return assemble_plan(
        bins,
        prep,
        cfg,
        mode="pool",
        packed=cfg.pool_packing,
        dp=dp,
        pp=pp,
        vpp=vpp,
        mb_group_size=mb_group_size,
        cost=cost,
        started=started,
        min_count=cfg.pool_micro_batches_per_step if bins else 0,
    )
