"""Worker side of rlbatch-export: ``run(cfg)`` in every worker, with the training run's own
parallel layout. Builds the run's model (architecture only: no HF weights are read), loads
the checkpoint's model state into this rank's chunks and writes the Hugging Face directory
through :func:`rlbatch.engine.hf.export_hf` (global rank 0 writes), the adapters merged in. A
LoRA run also gets ``adapter/``, its adapters as a PEFT adapter directory, and, when the run
started from random weights (no model.hf_path), ``base/``: the frozen base model PEFT loads
them onto."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rlbatch.config.schema import RunConfig

log = logging.getLogger("rlbatch.export")
ADAPTER_DIR = "adapter"
"""The PEFT adapter directory inside an export of a LoRA run."""
BASE_DIR = "base"
"""The base model of a LoRA run without model.hf_path, inside its export."""


def load_model_state(model: list[Any], path: str, rank: int, world_size: int) -> None:
    """This rank's model chunks from a training checkpoint (the one call into the checkpoint
    module: its format may change, this adapts)."""
    from rlbatch.train.checkpoint import load_checkpoint

    payload = load_checkpoint(path, rank=rank, world_size=world_size)
    if "sharded_dir" in payload:  # megatron dist_checkpointing: model shards of any layout
        from rlbatch.engine.dist_checkpoint import load_sharded

        load_sharded(payload["sharded_dir"], model, optimizer=None)
        return
    states = payload["model"]
    if len(states) != len(model):
        raise ValueError(f"{path}: {len(states)} model chunks, this layout has {len(model)}")
    for chunk, state in zip(model, states, strict=True):
        chunk.load_state_dict(state)


def run(cfg: RunConfig) -> None:
    """The rlbatch-export worker entry (every rank calls it)."""
    from rlbatch.cli.export import REQUEST
    from rlbatch.engine import hf, lora, parallel
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
    if lora.has_adapters(setup.model):
        export_adapters(setup.model, cfg, setup.cfg, Path(request["output"]), request)
    if state.rank == 0:
        log.info("exported %s to %s", request["checkpoint"], request["output"])
    parallel.destroy()


def base_model_name(hf_path: str) -> str:
    """base_model_name_or_path for model.hf_path: a local directory as an absolute path, a hub
    id as it is."""
    from rlbatch.config.hub_id import looks_like_hub_id

    return hf_path if looks_like_hub_id(hf_path) else str(Path(hf_path).expanduser().resolve())


def export_adapters(
    model: list[Any], cfg: RunConfig, resolved: RunConfig, out: Path, request: dict[str, Any]
) -> None:
    """``out/adapter`` (PEFT) and, without model.hf_path, ``out/base`` (the base model: the
    export with every adapter disabled). ``cfg``: the run's config (model.hf_path as the user
    gave it); ``resolved``: its model resolved from that path. Every rank calls."""
    from rlbatch.engine import hf, lora
    from rlbatch.engine.adapter import torch_dtype
    from rlbatch.engine.peft_adapter import export_peft_adapter

    dtype = torch_dtype(request["dtype"]) if request["dtype"] else None
    if cfg.model.hf_path:
        base = base_model_name(cfg.model.hf_path)
    else:
        base = str(out / BASE_DIR)
        with lora.adapters_disabled(model):
            hf.export_hf(
                model, resolved.model, base, dtype=dtype, max_shard_bytes=request["max_shard_bytes"]
            )
    export_peft_adapter(model, resolved.model, out / ADAPTER_DIR, base=base, dtype=dtype)
