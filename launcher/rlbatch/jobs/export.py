"""Worker side of rlbatch-export: ``run(cfg)`` in every worker, with the training run's own
parallel layout. Builds the run's model (architecture only: no HF weights are read), loads
the checkpoint's model state into this rank's chunks and writes the Hugging Face directory
through :func:`rlbatch.engine.hf.export_hf` (global rank 0 writes)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rlbatch.config.schema import RunConfig

log = logging.getLogger("rlbatch.export")


def load_model_state(model: list[Any], path: str, rank: int, world_size: int) -> None:
    """This rank's model chunks from a training checkpoint (the one call into the checkpoint
    module: its format may change, this adapts)."""
    from rlbatch.train.checkpoint import load_checkpoint

    payload = load_checkpoint(path, rank=rank, world_size=world_size)
    states = payload["model"]
    if len(states) != len(model):
        raise ValueError(f"{path}: {len(states)} model chunks, this layout has {len(model)}")
    for chunk, state in zip(model, states, strict=True):
        chunk.load_state_dict(state)


def run(cfg: RunConfig) -> None:
    """The rlbatch-export worker entry (every rank calls it)."""
    from rlbatch.cli.export import REQUEST
    from rlbatch.engine import hf, parallel
    from rlbatch.engine.adapter import torch_dtype
    from rlbatch.engine.setup import set_up_model

    assert cfg.run_dir is not None, "the driver sets run_dir"
    request = json.loads((Path(cfg.run_dir) / REQUEST).read_text())
    setup = set_up_model(cfg, wrap_ddp=False, load_weights=False)
    state = setup.state
    load_model_state(setup.model, request["checkpoint"], state.rank, state.world_size)
    dtype = torch_dtype(request["dtype"]) if request["dtype"] else None
    hf.export_hf(
        setup.model,
        setup.cfg.model,
        request["output"],
        dtype=dtype,
        max_shard_bytes=request["max_shard_bytes"],
    )
    if state.rank == 0:
        log.info("exported %s to %s", request["checkpoint"], request["output"])
    parallel.destroy()
