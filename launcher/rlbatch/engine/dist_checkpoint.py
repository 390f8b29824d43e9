"""Model and optimizer state through megatron-core's distributed checkpointing.

    save_sharded(directory, model, optimizer)    # collective: every rank of the world
    load_sharded(directory, model, optimizer)    # collective; any (tp, pp, vpp, dp) layout

A LoRA model whose frozen base was loaded from model.hf_path saves and loads its adapters
only (rlbatch.engine.lora.saves_adapters_only); the caller loads the base first. Every rank
contributes its shards of the model chunks (``sharded_state_dict()``: tensors keyed
by their global name and offset, so a layer is the same tensor whatever pipeline stage or
tensor-parallel rank holds it) and of the optimizer (Adam moments keyed by the parameter they
belong to; the distributed optimizer's sharded parameter state included, in the
``fully_reshardable`` format, which is resharded over TP, PP and DP on load). The
``torch_dist`` backend (torch.distributed.checkpoint) writes them; it needs only
torch.distributed, so it runs on gloo as on NCCL.

The directory must exist (empty) on a file system every rank sees. The trainer's atomic commit
(rlbatch.train.checkpoint) wraps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}
"""How the optimizer names its shards: by model parameter (reshardable over TP, PP, DP) and
without the chained optimizer's index (which depends on how parameters are grouped)."""


def is_sharded_model(model: list[Any]) -> bool:
    """Megatron chunks (they know their sharded state dict); plain torch modules are not."""
    return bool(model) and all(hasattr(chunk, "sharded_state_dict") for chunk in model)


def sharded_state_dict(model: list[Any], optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    """``{"model0": ..., "model1": ..., "optimizer": ...}`` of this rank."""
    from rlbatch.engine import lora
    from rlbatch.engine.adapter import unwrap

    adapters_only = lora.saves_adapters_only(model)
    state: dict[str, Any] = {}
    for i, chunk in enumerate(model):
        chunk_state = unwrap(chunk).sharded_state_dict()
        if adapters_only:  # LoRA: the frozen base is reloaded from model.hf_path
            chunk_state = {k: v for k, v in chunk_state.items() if lora.is_adapter_key(k)}
        state[f"model{i}"] = chunk_state
    if optimizer is not None:
        # the nested dict: chunks share module paths, megatron finds each parameter in it
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    return state


def save_sharded(directory: str | Path, model: list[Any], optimizer: Any) -> None:
    """Write this rank's model and optimizer shards into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    state = sharded_state_dict(model, optimizer, is_loading=False)
    dist_checkpointing.save(state, str(directory), content_metadata=dict(OPTIMIZER_METADATA))


def _in_process_results_queue() -> None:
    """megatron's checkpoint writer reports through a queue that it creates once per process
    from a *spawned* multiprocessing manager: an extra Python process that re-imports the
    worker's main module at the first save and outlives a killed worker (holding its stdout
    open). The synchronous save used here puts and gets the results in this process, so a
    plain thread-safe queue serves it without any helper process."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_sharded(directory: str | Path, model: list[Any], optimizer: Any) -> None:
    """Load the model chunks and the optimizer in place from ``directory`` (collective), in
    whatever layout this run has."""
    from megatron.core import dist_checkpointing

    if optimizer is not None:
        _init_torch_adam_state(optimizer)
    state = sharded_state_dict(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, str(directory))
    from rlbatch.engine import lora
    from rlbatch.engine.adapter import unwrap

    adapters_only = lora.saves_adapters_only(model)
    for i, chunk in enumerate(model):
        result = unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=not adapters_only)
        if adapters_only:
            missing = [k for k in result.missing_keys if lora.is_adapter_key(k)]
            if missing or result.unexpected_keys:
                raise ValueError(
                    f"{directory}: the LoRA checkpoint does not match the model (adapters "
                    f"missing: {missing[:4]}, unexpected: {result.unexpected_keys[:4]})"
                )
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])


def _init_torch_adam_state(optimizer: Any) -> None:
    """Give a fresh torch Adam/AdamW (megatron's optimizer without TE / apex, e.g. on CPU) the
    state torch creates at its first step: zero moments and step 0. megatron initialises only
    the moments before a load, and its distributed optimizer then fails to read the step. The
    loaded checkpoint overwrites all three."""
    import torch

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt = getattr(inner, "optimizer", None)
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state[param]
                state.setdefault("step", torch.tensor(0.0))
                state.setdefault(
                    "exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format)
                )
                state.setdefault(
                    "exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format)
                )
