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
        saved = dist_checkpointing.load_common_state_dict(str(directory)).get("optimizer")
        optimizer.load_state_dict(fit_optimizer_chains(loaded["optimizer"], saved, optimizer))


def _chains(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _saved_parts(saved: Any) -> list[dict[str, Any]]:
    """The per-optimizer common state a checkpoint holds: megatron's chained optimizer writes
    one dict per optimizer under its index (several), or the only one's dict itself."""
    indices = sorted(k for k in saved if isinstance(k, int))
    return [saved[i] for i in indices] if indices else [saved]


_GROUPED = ("optimizer", "param_groups", "state")
"""Common state that is per parameter group (hyperparameters, the step), fitted below."""
GROUP_KEY = ("wd_mult", "lr_mult", "is_decoupled_lr")
"""What tells a parameter group's hyperparameters apart whatever the expert-parallel layout
(megatron's own key adds ``is_expert_parallel``, which the layout decides)."""


def fit_optimizer_chains(loaded: Any, saved: Any, optimizer: Any) -> Any:
    """``loaded`` (megatron's load of this run's optimizer structure: its tensors, Adam moments
    keyed by parameter name, resharded) with the common state of a checkpoint saved under
    another grouping of optimizers. megatron builds one optimizer for the dense parameters and
    one for the routed experts when expert parallelism is on (their gradients reduce over other
    groups), a single one at ``parallel.ep=1``; the common state (each parameter group's
    hyperparameters, the step count) is written per optimizer, so a checkpoint of one grouping
    does not load into the other. Each of this run's parameter groups takes the hyperparameters
    of the saved group with the same weight-decay and learning-rate multipliers (and the saved
    step); the tensors stay as loaded. At the saved grouping: ``loaded`` unchanged."""
    chains = _chains(optimizer)
    old = _saved_parts(saved) if isinstance(saved, dict) else []
    if not old or len(old) == len(chains):
        return loaded
    steps = [p["state"]["common_step"] for p in old if "common_step" in p.get("state", {})]
    if len({float(x) for x in steps}) > 1:
        raise ValueError(f"the checkpoint's optimizers disagree on the step: {steps}")
    saved_groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for part in old:
        for g in _param_groups(part):
            saved_groups.setdefault(tuple(g[k] for k in GROUP_KEY), g)
    new = [loaded] if len(chains) == 1 else [loaded[i] for i in range(len(chains))]
    out = []
    for part, chain in zip(new, chains, strict=True):
        current = chain.state_dict()
        fitted = [_fit_group(g, saved_groups) for g in _param_groups(current)]
        mine = {k: v for k, v in part.items() if not isinstance(k, int)}
        # the rest of the saved common state (the distributed optimizer's sharding type, a
        # grad scaler's): the same for every optimizer of a run
        mine |= {k: v for k, v in old[0].items() if k not in (*mine, *_GROUPED)}
        if "optimizer" in current:  # the distributed optimizer: moments in its param_state
            out.append(mine | {"optimizer": current["optimizer"] | {"param_groups": fitted}})
            continue
        ids = [g["params"] for g in part["param_groups"]]
        state = {k: v for k, v in part["state"].items() if k != "common_step"}
        if steps:
            state["common_step"] = steps[0].clone()
        groups = [g | {"params": p} for g, p in zip(fitted, ids, strict=True)]
        out.append(mine | {"param_groups": groups, "state": state})
    return out[0] if len(chains) == 1 else dict(enumerate(out))


def _param_groups(part: dict[str, Any]) -> list[dict[str, Any]]:
    """A parameter group list of one optimizer's state: top level (megatron's FP32 optimizer),
    or under "optimizer" (its distributed optimizer)."""
    inner = part.get("optimizer")
    return inner["param_groups"] if isinstance(inner, dict) else part["param_groups"]


def _fit_group(mine: dict[str, Any], saved: dict[tuple[Any, ...], dict[str, Any]]) -> dict:
    """This run's parameter group ``mine`` with the saved hyperparameters of its kind."""
    key = tuple(mine[k] for k in GROUP_KEY)
    if key not in saved:
        raise ValueError(
            "the checkpoint has no optimizer parameter group with "
            f"{dict(zip(GROUP_KEY, key, strict=True))}"
        )
    hyper = {k: v for k, v in saved[key].items() if k != "params"}
    return hyper | {"is_expert_parallel": mine["is_expert_parallel"]}


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
