"""The one model set-up sequence of every worker (training, rlbatch-logprobs, rlbatch-export):

setup = set_up_model(cfg, wrap_ddp=True)   # init parallel, resolve HF config, build, load
setup.cfg.model      # the architecture of model.hf_path's config.json (cfg is not changed)
setup.model          # this rank's chunks, HF weights loaded when model.hf_path is set
setup.state          # this rank's rlbatch.layout.ParallelLayout
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from rlbatch.config.schema import RunConfig

log = logging.getLogger("rlbatch.engine")


@dataclass(frozen=True)
class ModelSetup:
    cfg: RunConfig
    """A copy of the run config whose ``model`` is resolved from ``model.hf_path``."""
    model: list[Any]
    """This rank's model chunks (one per virtual pipeline stage)."""
    state: Any
    """This rank's rlbatch.layout.ParallelLayout."""


def set_up_model(cfg: RunConfig, *, wrap_ddp: bool, load_weights: bool = True) -> ModelSetup:
    """Initialise torch.distributed + Megatron's parallel state, take the architecture of
    ``model.hf_path`` (a warning per preset field it replaces), build this rank's chunks and
    load the HF weights (``load_weights``; random init without hf_path). A LoRA model loads its
    frozen base from hf_path whatever ``load_weights`` says: its checkpoints hold only the
    adapters."""
    from rlbatch.engine import hf, lora, parallel
    from rlbatch.engine.model import build_model

    state = parallel.initialize(cfg)
    model_cfg, changed = hf.resolve_model_config(cfg.model)
    if state.rank == 0:
        for note in changed:
            log.warning("from %s: %s", model_cfg.hf_path, note)
    resolved = replace(cfg, model=model_cfg)
    model = build_model(resolved, wrap_ddp=wrap_ddp)
    if (load_weights or model_cfg.lora.rank > 0) and model_cfg.hf_path:
        # LoRA: the frozen base always comes from hf_path (checkpoints hold the adapters)
        hf.load_hf_into(model, model_cfg.hf_path)
        lora.mark_base_loaded(model, model_cfg.hf_path)
    return ModelSetup(cfg=resolved, model=model, state=state)
