"""Pool mode (after cosmos-rl's pool batcher): streaming, step-based micro-batching from per-rank pools.

The data is one **global** stream: a permutation of all samples, reshuffled every epoch from
(seed, epoch) (not a shuffle within each rank's shard). Each rank keeps a pool of up to
``pool_size`` samples, refilled from the shared stream, and forms its micro-batches from it:

- padded, ``prefer_closest``: anchor = the oldest sample in the pool (no starvation), then
  repeatedly add the sample whose rounded length is closest to the current padded length, while
  rows * round_up(max_len) <= max_tokens;
- padded, ``prefer_first``: anchor = the oldest, then pool samples in arrival order (FIFO), each
  added if it still fits;
- ``pool_packing``: anchor = the oldest, then repeatedly the longest sample that still fits the
  packed budget (a best fit; the seed's greedy takes them in arrival order).

Every step each rank forms M micro-batches (M = the VPP-valid count >= micro_batches_per_step);
the step's dp*M micro-batches are then assigned to ranks balancing cost, exactly M each, like
every other mode. State (stream cursor, epoch, pool contents, seed) is a small JSON-able dict:
resume continues identically without replaying data.
"""

from __future__ import annotations

import random
import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from rlbatch.batching.assemble import Prepared, assemble_plan, prepare_lengths
from rlbatch.batching.cost import TOKEN_COUNT, CostModel
from rlbatch.batching.plan import PassPlan
from rlbatch.batching.vpp import resolve_group_size, valid_count
from rlbatch.config.schema import BatchingPassConfig, PoolStrategy

_POS_BITS = 64  # a pool key is rounded_len << 64 | stream position (unique, arrival order)
_POS_MASK = (1 << _POS_BITS) - 1
STATE_VERSION = 1


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The global order of one epoch (the same on every rank)."""
    perm = list(range(num_samples))
    random.Random(f"rlbatch-pool:{seed}:{epoch}").shuffle(perm)
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

    def entries(self) -> list[list[int]]:
        return [[self.sample_at[p], p] for p in self.arrival]


class PoolBatcher:
    """Step-based pool batching over a dataset of ``lengths`` (indices are dataset indices).

    ``next_step()`` returns the PassPlan of one optimizer step (every rank the same count), or
    None once the data is exhausted (infinite_loop=False). ``state_dict()`` /
    ``load_state_dict()`` save and restore the exact position.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        cfg: BatchingPassConfig,
        *,
        dp: int,
        pp: int = 1,
        vpp: int = 1,
        microbatch_group_size: int | None = None,
        micro_batches_per_step: int | None = None,
        cost: CostModel | None = None,
        seed: int = 0,
        pass_name: str = "train",
    ) -> None:
        if dp < 1:
            raise ValueError(f"parallel.dp={dp} must be >= 1")
        if cfg.pool_size < 1:
            raise ValueError(f"batching.{pass_name}.pool_size={cfg.pool_size} must be >= 1")
        per_step = (
            cfg.pool_micro_batches_per_step
            if micro_batches_per_step is None
            else micro_batches_per_step
        )
        if per_step < 1:
            raise ValueError(
                f"batching.{pass_name}.pool_micro_batches_per_step={per_step} must be >= 1"
            )
        self.cfg = cfg
        self.dp, self.pp, self.vpp = dp, pp, vpp
        self.group_size = resolve_group_size(pp, vpp, microbatch_group_size)
        self.per_step = valid_count(per_step, pp, vpp, self.group_size)
        self.cost = cost or TOKEN_COUNT
        self.seed = seed
        self.prep: Prepared = prepare_lengths(lengths, cfg, pass_name)
        self.num_samples = len(self.prep.lengths)
        self.epoch = 0
        self.cursor = 0
        self.step = 0
        self.pools = [_Pool() for _ in range(dp)]
        self._perm = epoch_permutation(self.num_samples, seed, 0)

    # -- stream --------------------------------------------------------------------------
    def _next_sample(self) -> tuple[int, int] | None:
        """(sample, global stream position), or None when the data is exhausted."""
        if self.cursor >= self.num_samples:
            if not self.cfg.infinite_loop or self.num_samples == 0:
                return None
            self.epoch += 1
            self.cursor = 0
            self._perm = epoch_permutation(self.num_samples, self.seed, self.epoch)
        position = self.epoch * self.num_samples + self.cursor
        sample = self._perm[self.cursor]
        self.cursor += 1
        return sample, position

    def _refill(self, pool: _Pool) -> None:
        while len(pool) < self.cfg.pool_size:
            nxt = self._next_sample()
            if nxt is None:
                return
            pool.add(nxt[0], nxt[1], self.prep.rounded[nxt[0]])

    # -- one micro-batch -----------------------------------------------------------------
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

    # -- steps ---------------------------------------------------------------------------
    def next_step(self) -> PassPlan | None:
        """The plan of the next optimizer step, or None when the data is exhausted."""
        started = time.perf_counter()
        bins: list[list[int]] = []
        for pool in self.pools:
            for _ in range(self.per_step):
                self._refill(pool)
                mb = self.form_micro_batch(pool)
                if mb:
                    bins.append(mb)
        if not bins:
            return None
        consumed = [s for b in bins for s in b]
        plan = assemble_plan(
            bins,
            self.prep,
            self.cfg,
            mode="pool",
            packed=self.cfg.pool_packing,
            dp=self.dp,
            pp=self.pp,
            vpp=self.vpp,
            mb_group_size=self.group_size,
            cost=self.cost,
            started=started,
            min_count=self.per_step,
            samples=consumed,
            extra={"step": self.step, "epoch": self.epoch},
        )
        self.step += 1
        return plan

    def __iter__(self) -> Iterator[PassPlan]:
        while True:
            plan = self.next_step()
            if plan is None:
                return
            yield plan

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: seed, epoch, cursor, step and every pool's contents (the epoch
        permutation is a function of seed and epoch, so no RNG object needs saving)."""
        return {
            "version": STATE_VERSION,
            "num_samples": self.num_samples,
            "dp": self.dp,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "step": self.step,
            "pools": [p.entries() for p in self.pools],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (
            ("version", STATE_VERSION),
            ("num_samples", self.num_samples),
            ("dp", self.dp),
        ):
            if state.get(key) != mine:
                raise ValueError(f"pool state has {key}={state.get(key)!r}, this batcher {mine!r}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.step = int(state["step"])
        self._perm = epoch_permutation(self.num_samples, self.seed, self.epoch)
        self.pools = []
        for entries in state["pools"]:
            pool = _Pool()
            for sample, position in entries:
                pool.add(int(sample), int(position), self.prep.rounded[int(sample)])
            self.pools.append(pool)


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
    stream once, each rank forming micro-batches in turn; the micro-batches then get equal,
    VPP-valid counts and a cost-balanced assignment like every mode."""
    batcher = PoolBatcher(
        lengths,
        replace(cfg, infinite_loop=False),
        dp=dp,
        pp=pp,
        vpp=vpp,
        microbatch_group_size=mb_group_size if vpp > 1 else None,
        micro_batches_per_step=1,
        cost=cost,
        seed=seed,
        pass_name=pass_name,
    )
    batcher.epoch = step
    batcher._perm = epoch_permutation(batcher.num_samples, seed, step)
    bins: list[list[int]] = []
    active = True
    while active:
        active = False
        for pool in batcher.pools:
            batcher._refill(pool)
            mb = batcher.form_micro_batch(pool)
            if mb:
                bins.append(mb)
                active = True
    return assemble_plan(
        bins,
        batcher.prep,
        cfg,
        mode="pool",
        packed=cfg.pool_packing,
        dp=dp,
        pp=pp,
        vpp=vpp,
        mb_group_size=mb_group_size,
        cost=cost,
        started=started,
    )
