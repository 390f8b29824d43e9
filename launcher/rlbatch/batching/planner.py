"""plan_pass: one pass over a mini-batch -> a global PassPlan (docs/batching.md).

Pipeline (every mode): prepare lengths (oversize policy, rounding) -> bins (which samples share
a micro-batch; mode-specific) -> count M per rank (ceil(bins / dp), raised to megatron-core's
VPP rule) -> split the costliest bins up to dp*M, zero-weight fillers only if nothing is left to
split -> assign exactly M bins per rank balancing a*L + b*L^2 (largest first, then swaps) ->
order each rank costliest first (lockstep) -> stats.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rlbatch.batching.assemble import Prepared, assemble_plan, length_order, prepare_lengths
from rlbatch.batching.cost import TOKEN_COUNT, CostModel
from rlbatch.batching.packing import pack_best_fit_decreasing, pack_sorted_runs
from rlbatch.batching.plan import PassPlan
from rlbatch.batching.vpp import resolve_group_size
from rlbatch.config.schema import BatchingMode, BatchingPassConfig


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while planning. A plan allocates tens of thousands
    of small containers (bins, tuples, micro-batches) and frees none of them in cycles, yet
    each allocation burst triggers collections that rescan every tracked object of the process
    (in a trainer: all of torch's); the state is restored afterwards, even on error."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_pass(
    lengths: Sequence[int],
    cfg: BatchingPassConfig,
    *,
    dp: int,
    pp: int = 1,
    vpp: int = 1,
    microbatch_group_size: int | None = None,
    group_size: int = 1,
    cost: CostModel | None = None,
    seed: int = 0,
    step: int = 1,
    pass_name: str = "train",
) -> PassPlan:
    """Plan one pass: every sample of ``lengths`` in exactly one micro-batch of one DP rank.

    lengths: tokens (prompt + response) per sample; MicroBatch.samples index into it.
    group_size: siblings of one prompt are contiguous runs of this many samples.
    cost: the DP cost model (None: computed tokens).
    seed, step: used by the pool mode's shuffle (``step``: the 1-based optimizer step); the
        other modes are deterministic functions of lengths and config alone.
    pass_name: "train" or "infer", for the config keys named in error messages.
    Raises ValueError for bad input or, with oversize=error, a sample over the budget.
    """
    if step < 1:
        raise ValueError(f"step={step}: optimizer steps are numbered from 1")
    with gc_paused():
        return _plan_pass(
            lengths, cfg, dp, pp, vpp, microbatch_group_size, group_size, cost, seed, step,
            pass_name,
        )  # fmt: skip


def _packer(
    mode: BatchingMode, cfg: BatchingPassConfig, prep: Prepared, order: list[int], pass_name: str
) -> Callable[[int], list[list[int]]]:
    """pack(capacity) -> micro-batches (sample indices) of a fixed / dynamic / packed pass:
    best-fit decreasing bins for packed, sorted runs (of micro_batch_size rows for fixed)."""
    if mode == BatchingMode.fixed and cfg.micro_batch_size < 1:
        raise ValueError(
            f"batching.{pass_name}.micro_batch_size={cfg.micro_batch_size} must be >= 1"
        )
    rows = cfg.micro_batch_size if mode == BatchingMode.fixed else None

    def pack(capacity: int) -> list[list[int]]:
        if mode == BatchingMode.packed:
            return pack_best_fit_decreasing(order, prep.rounded, capacity)
        return pack_sorted_runs(order, prep.rounded, capacity, rows)

    return pack


def _plan_pass(
    lengths: Sequence[int],
    cfg: BatchingPassConfig,
    dp: int,
    pp: int,
    vpp: int,
    microbatch_group_size: int | None,
    group_size: int,
    cost: CostModel | None,
    seed: int,
    step: int,
    pass_name: str,
) -> PassPlan:
    started = time.perf_counter()
    if dp < 1:
        raise ValueError(f"parallel.dp={dp} must be >= 1")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    n_group = resolve_group_size(pp, vpp, microbatch_group_size)
    cost = cost or TOKEN_COUNT
    mode = BatchingMode(cfg.mode)
    if mode == BatchingMode.pool:
        from rlbatch.batching.pool import plan_pool_pass

        return plan_pool_pass(
            lengths,
            cfg,
            dp=dp,
            pp=pp,
            vpp=vpp,
            mb_group_size=n_group,
            cost=cost,
            seed=seed,
            step=step,
            pass_name=pass_name,
            started=started,
        )
    prep = prepare_lengths(lengths, cfg, pass_name)
    packed = mode == BatchingMode.packed
    pack = _packer(mode, cfg, prep, length_order(prep, group_size, cfg.spread_siblings), pass_name)
    return assemble_plan(
        pack(cfg.max_tokens),
        prep,
        cfg,
        mode=mode.value,
        packed=packed,
        dp=dp,
        pp=pp,
        vpp=vpp,
        mb_group_size=n_group,
        cost=cost,
        started=started,
        repack=pack if packed else None,
    )
