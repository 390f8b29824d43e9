"""torchrun worker of tests/dist/test_engine_parallel.py: the parallel layouts one after the
other in the same 2-process world (megatron's parallel state re-initialised for each, as in
lora_worker.py).

Usage: engine_worker.py MODES HF_DIR OUT_DIR   (MODES: comma-separated, each pp2 | vpp | tp2 |
tp2sp | dp2 | dp2do)
Writes OUT_DIR/MODE/rank{r}.pt with the case results (gathered on rank 0) and checks of
rlbatch.distributed, and OUT_DIR/MODE/export.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_case import MICRO_BATCHES, make_cfg, run_case

from rlbatch import distributed
from rlbatch.engine import parallel

LAYOUTS = {  # mode -> (tp, pp, vpp, dp, micro-batches of this rank, N)
    "pp2": (1, 2, 1, 1, lambda r: MICRO_BATCHES[:3], None),
    "vpp": (1, 2, 2, 1, lambda r: MICRO_BATCHES[:5], 3),
    "tp2": (2, 1, 1, 1, lambda r: MICRO_BATCHES[:3], None),
    "tp2sp": (2, 1, 1, 1, lambda r: MICRO_BATCHES[:3], None),  # + sequence parallel
    "dp2": (1, 1, 1, 2, lambda r: MICRO_BATCHES[3 * r : 3 * r + 3], None),
    "dp2do": (1, 1, 1, 2, lambda r: MICRO_BATCHES[3 * r : 3 * r + 3], None),  # + distributed opt
}


def distributed_checks(mode: str) -> dict:
    """rlbatch.distributed on this layout."""
    out: dict = {}
    r = dist.get_rank()
    a, b, c = distributed.all_reduce_sum(
        [torch.tensor([1.0, 2.0]) * (r + 1), 3.0, torch.ones(2, 2)], group=None
    )
    out["all_reduce_sum"] = (a.tolist(), float(c.sum()), float(b))
    out["dp_sum"] = distributed.all_reduce_floats([1.0, float(r)])
    try:
        distributed.check_same_across_ranks({"plan": r == 0}, "the step plan")
        out["check_same"] = "no error"
    except RuntimeError as exc:
        out["check_same"] = str(exc)
    distributed.check_same_across_ranks({"plan": 1}, "the step plan")  # agreeing: no error
    if mode == "pp2":
        last = distributed.is_last_stage()
        x = torch.arange(4.0) + 10 if last else None
        out["broadcast"] = distributed.broadcast_from_last_stage(x, (4,), torch.float32).tolist()
        out["reduce_step"] = distributed.reduce_step(  # summed over the stages
            torch.full((2,), 5.0 if last else 0.5, dtype=torch.float64)
        ).tolist()
    return out


def run_mode(mode: str, hf_dir: str, out_dir: Path) -> None:
    tp, pp, vpp, dp, mbs, group = LAYOUTS[mode]
    cfg = make_cfg(
        tp,
        pp,
        vpp,
        dp,
        hf_dir,
        sequence_parallel=mode == "tp2sp",
        distributed_optimizer=mode == "dp2do",
    )
    cfg.parallel.microbatch_group_size_per_vp_stage = group
    state = parallel.initialize(cfg)
    export = str(out_dir / "export")
    result = run_case(
        cfg,
        mbs(state.dp_rank),
        dp=dp,
        step=mode in ("dp2", "dp2do", "tp2", "tp2sp"),
        export_dir=export,
    )
    result["state"] = state
    result["distributed"] = distributed_checks(mode)
    torch.save(result, out_dir / f"rank{state.rank}.pt")


def main() -> None:
    modes, hf_dir, out_dir = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
    for mode in modes:
        (out_dir / mode).mkdir(exist_ok=True)  # every rank: whichever comes first makes it
        run_mode(mode, hf_dir, out_dir / mode)
    parallel.destroy()


if __name__ == "__main__":
    main()
