"""torchrun worker of tests/dist/test_moe_balance_pipeline.py: the MoE load-balancing case
(moe_balance_case.py) at pp 2 and pp 2 x vpp 2, each without and with full activation recompute,
in one 2-process world (megatron's parallel state re-initialised for each layout).

Usage: moe_balance_worker.py HF_DIR OUT_DIR
Writes OUT_DIR/{layout}_{case}.pt (rank 0: metrics and gradients; the last stage's metrics
under "last").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from moe_balance_case import CASES, make_cfg, run_step

from rlbatch.engine import parallel

LAYOUTS = {  # name -> (pp, vpp, model.recompute)
    "pp2": (2, 1, "none"),
    "pp2_vpp2": (2, 2, "none"),
    "pp2_full": (2, 1, "full"),
    "pp2_vpp2_full": (2, 2, "full"),
}


def main() -> None:
    hf_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    for name, (pp, vpp, recompute) in LAYOUTS.items():
        for case in CASES:
            cfg = make_cfg(hf_dir, case, pp=pp, vpp=vpp, recompute=recompute)
            state = parallel.initialize(cfg)
            result = run_step(cfg, case)
            if state.rank == 0:
                torch.save(result, out_dir / f"{name}_{case}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
