"""torchrun worker of tests/dist/test_lora_parallel.py: tp 2, tp 2 with sequence parallelism and
pp 2, one after the other in the same 2-process world (megatron's parallel state re-initialised
for each).

Usage: lora_worker.py HF_DIR ADAPTERS_FILE OUT_DIR
Writes OUT_DIR/{layout}_rank{r}.pt and each layout's checkpoint after its step,
OUT_DIR/ckpt_{layout}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from engine_case import MICRO_BATCHES
from lora_case import lora_cfg, run_lora_case

from rlbatch.engine import parallel

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
}


def main() -> None:
    hf_dir, adapters_file, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    adapters = torch.load(adapters_file)
    for name, layout in LAYOUTS.items():
        cfg = lora_cfg(hf_path=hf_dir, **layout)
        state = parallel.initialize(cfg)
        save = out_dir / f"ckpt_{name}"
        if state.rank == 0:
            save.mkdir()
        torch.distributed.barrier()
        result = run_lora_case(cfg, MICRO_BATCHES[:3], adapters, save_dir=str(save))
        torch.save(result, out_dir / f"{name}_rank{state.rank}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
