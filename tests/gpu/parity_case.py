"""Run the engine test case (tests/dist/scripts/engine_case.py) in this process and save the
results: ``python parity_case.py HF_DIR OUT.pt DTYPE [--export]``. With CUDA hidden
(CUDA_VISIBLE_DEVICES="") it is the CPU fp32 reference; on a GPU it runs the Transformer Engine
spec, THD packed attention for the packed micro-batches, and the given parameter dtype."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist" / "scripts"))
from engine_case import MICRO_BATCHES, make_cfg, run_case  # noqa: E402

from rlbatch.config.schema import Dtype  # noqa: E402
from rlbatch.engine import hf, parallel  # noqa: E402
from rlbatch.engine import model as engine_model  # noqa: E402


def main() -> None:
    hf_dir, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if "--export" in sys.argv:  # the shared initial weights
        cfg = make_cfg()
        parallel.initialize(cfg)
        parallel.seed(7)
        hf.export_hf(engine_model.build_model(cfg, wrap_ddp=False), cfg.model, hf_dir)
        parallel.destroy()
    cfg = make_cfg(hf_path=str(hf_dir))
    cfg.model = replace(cfg.model, params_dtype=Dtype(dtype))
    parallel.initialize(cfg)
    result = run_case(cfg, MICRO_BATCHES[:3], step=True)
    result["te"] = engine_model.have_transformer_engine()
    torch.save({k: v for k, v in result.items() if k != "rollout"}, out)
    parallel.destroy()


if __name__ == "__main__":
    main()
