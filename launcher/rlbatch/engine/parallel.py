"""torch.distributed + Megatron parallel state from torchrun's environment (or a world of 1).

    state = initialize(cfg)      # every worker, before building the model
    ...
    destroy()                    # at the end (and between runs in one process, e.g. tests)

gloo on CPU, NCCL on GPU (``parallel.backend``), ``trainer.timeout_s`` on every collective.
Without torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) a single-process
world is created from an in-memory store, so the same code runs under pytest.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from rlbatch.config.schema import DistBackend, ParallelConfig, RunConfig
from rlbatch.engine import cpu_compat
from rlbatch.layout import ParallelLayout


def _backend(parallel: ParallelConfig) -> str:
    if parallel.backend == DistBackend.auto:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return DistBackend(parallel.backend).value


def _init_process_group(cfg: RunConfig) -> None:
    backend = _backend(cfg.parallel)
    timeout = timedelta(seconds=cfg.trainer.timeout_s)
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # a world of one (pytest, a plain python call)
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


def check_world(parallel: ParallelConfig, world_size: int) -> None:
    """The world must be exactly tp * pp * cp * dp processes (clear message otherwise)."""
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if world_size != model_parallel * parallel.dp:
        raise ValueError(
            f"parallel: world size {world_size} != tp*pp*cp*dp = {parallel.tp}*{parallel.pp}*"
            f"{parallel.cp}*{parallel.dp} = {model_parallel * parallel.dp}: launch "
            f"{model_parallel * parallel.dp} workers, or set parallel.dp="
            f"{world_size // model_parallel if world_size % model_parallel == 0 else '?'}"
        )
    if parallel.vpp > 1 and parallel.pp < 2:
        raise ValueError(f"parallel.vpp={parallel.vpp} needs parallel.pp > 1")
    if (parallel.dp * parallel.cp) % parallel.ep:
        raise ValueError(
            f"parallel.ep={parallel.ep} must divide parallel.dp * parallel.cp = "
            f"{parallel.dp * parallel.cp} (expert parallelism is carved out of them)"
        )
    if parallel.cp > 1 and not torch.cuda.is_available():
        raise ValueError(f"parallel.cp={parallel.cp}: context parallelism needs CUDA (set cp=1)")


def initialize(cfg: RunConfig) -> ParallelLayout:
    """Init torch.distributed (torchrun env or a world of 1), Megatron's parallel state and the
    seeds (trainer.seed). Installs the CPU layer when CUDA is unavailable."""
    cpu_compat.import_megatron()
    from megatron.core import parallel_state as ps

    cpu_compat.install()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    _init_process_group(cfg)
    p = cfg.parallel
    check_world(p, dist.get_world_size())
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
    )
    seed(cfg.trainer.seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    """This process's ParallelLayout (a single process when nothing is initialized)."""
    from megatron.core import parallel_state as ps

    if not is_initialized():
        return ParallelLayout()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return ParallelLayout(
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=vpp,
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        device=f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu",
    )


def seed(value: int) -> None:
    """Seed torch and Megatron's RNG tracker (model_parallel_cuda_manual_seed). On CPU the CPU
    layer maps the "CUDA" RNG state onto the CPU generator, so the tracker's states, forks and
    activation recomputation work on it."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(value)
    model_parallel_cuda_manual_seed(value, force_reset_rng=True)
    torch.manual_seed(value)  # the same CPU stream on every rank: CPU init is rank-independent


def destroy(destroy_process_group: bool = True) -> None:
    """Tear down Megatron's parallel state (and the process group)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    from megatron.core import parallel_state as ps

    return dist.is_initialized() and ps.model_parallel_is_initialized()


def world_size_of(cfg: RunConfig) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp * p.dp


def device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def microbatch_group_size(cfg: RunConfig, plan_group_size: Optional[int] = None) -> Optional[int]:
    """Megatron's microbatch_group_size_per_vp_stage: the plan's, else the config's, else pp."""
    if plan_group_size is not None:
        return plan_group_size
    return cfg.parallel.microbatch_group_size_per_vp_stage or cfg.parallel.pp
