"""torchrun worker of tests/dist/test_moe_balance_pipeline.py: the MoE load-balancing case
(moe_balance_case.py) at pp 2, pp 2 x vpp 2 and tp 2 (sequence parallel), each without and with
full activation recompute, and the routing-replay cases (r3, r2) pipelined under full recompute,
in one 2-process world (megatron's parallel state re-initialised for each layout).

Usage: moe_balance_worker.py HF_DIR OUT_DIR
Reads OUT_DIR/routing.pt (what the replay cases replay); writes OUT_DIR/{layout}_{case}.pt
(rank 0: metrics and gradients).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from moe_balance_case import CASES, REPLAY_CASES, make_cfg, record_old_routing, run_step

from rlbatch.engine import parallel

LAYOUTS = {  # name -> (tp, pp, vpp, model.recompute)
    "pp2": (1, 2, 1, "none"),
    "pp2_full": (1, 2, 1, "full"),
    "pp2_vpp2": (1, 2, 2, "none"),
    "pp2_vpp2_full": (1, 2, 2, "full"),
    "tp2": (2, 1, 1, "none"),
    "tp2_full": (2, 1, 1, "full"),
}
REPLAYED = ("pp2_full", "pp2_vpp2_full")
"""The layouts that also run the replay cases: a chunk's recomputed forward comes after later
micro-batches' forwards there."""


def main() -> None:
    hf_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    routing = torch.load(out_dir / "routing.pt", weights_only=False)
    shape = None
    for name, (tp, pp, vpp, recompute) in LAYOUTS.items():
        cases = [*CASES, *(REPLAY_CASES if name in REPLAYED else ())]
        for case in cases:
            cfg = make_cfg(hf_dir, case, pp=pp, vpp=vpp, recompute=recompute, tp=tp)
            if shape != (tp, pp, vpp):  # megatron's groups, made once a parallel shape
                shape, state = (tp, pp, vpp), parallel.initialize(cfg)
            else:
                parallel.seed(cfg.trainer.seed)
            result = run_step(cfg, case, routing)
            if state.rank == 0:
                torch.save(result, out_dir / f"{name}_{case}.pt")
        if name == "tp2":  # r2's record: the old pass's routing, every rank's slice gathered
            record = record_old_routing(make_cfg(hf_dir, "token", tp=2))
            torch.save(record, out_dir / f"tp2_record_rank{state.rank}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
