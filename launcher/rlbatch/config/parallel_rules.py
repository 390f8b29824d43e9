"""The parallel layout's rules: interleaving and its group size, the workers the launcher starts
over its nodes, and the keys every node of a multi-node run needs."""

from __future__ import annotations

import re

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import ParallelConfig, RunConfig


def world_size(cfg: RunConfig) -> int:
    """Workers the run needs: tp * pp * cp * dp."""
    p = cfg.parallel
    return p.tp * p.pp * p.cp * p.dp


def check_layout(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Interleaving needs a pipeline; the virtual-stage group holds every stage."""
    p = cfg.parallel
    if p.vpp > 1 and p.pp < 2:
        errors.append(
            ConfigError("parallel.vpp", p.vpp, "interleaving needs parallel.pp > 1: set pp >= 2")
        )
    n = p.microbatch_group_size_per_vp_stage
    if n is not None and n < p.pp:
        errors.append(
            ConfigError(
                "parallel.microbatch_group_size_per_vp_stage", n, f"must be >= parallel.pp = {p.pp}"
            )
        )


def runs_on_gloo(p: ParallelConfig) -> bool:
    """The workers' collectives run on gloo: parallel.backend=gloo, or auto on a machine without
    CUDA (the launcher runs where its workers do: a scheduler's job validates on its node)."""
    from rlbatch.config.enums import DistBackend

    if DistBackend(p.backend) != DistBackend.auto:
        return DistBackend(p.backend) == DistBackend.gloo
    import torch

    return not torch.cuda.is_available()


def check_gloo_layout(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Layouts gloo cannot run, refused before launch rather than by the workers: context
    parallelism (its attention needs CUDA), and expert parallelism with tensor parallelism (the
    expert-tensor-parallel group all-gathers uneven token counts after the all-to-all, which
    gloo refuses). rlbatch-plan, which only previews a layout, does not apply them."""
    p, experts = cfg.parallel, cfg.model.num_moe_experts
    cp = p.cp > 1
    tp_ep = bool(experts) and p.ep > 1 and p.tp > 1
    if not (cp or tp_ep) or not runs_on_gloo(p):
        return
    if cp:
        errors.append(
            ConfigError(
                "parallel.cp", p.cp, "context parallelism needs CUDA (NCCL): set parallel.cp=1"
            )
        )
    if tp_ep:
        errors.append(
            ConfigError(
                "parallel.ep",
                p.ep,
                f"with parallel.tp={p.tp} on gloo (a machine without CUDA): after the experts' "
                "all-to-all the tensor-parallel ranks hold different numbers of tokens, which "
                "the dispatcher all-gathers over them, and gloo refuses uneven sizes: set "
                "parallel.tp=1 (ep scales the experts) or parallel.ep=1",
            )
        )


def check_world(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The workers the launcher starts: tp*pp*cp*dp, over nnodes."""
    p = cfg.parallel
    total = world_size(cfg)
    if p.nproc_per_node is not None and p.nproc_per_node * p.nnodes != total:
        errors.append(
            ConfigError(
                "parallel.nproc_per_node",
                p.nproc_per_node,
                f"nproc_per_node * nnodes = {p.nproc_per_node * p.nnodes} workers but "
                f"tp*pp*cp*dp = {total}: set parallel.dp = "
                f"{p.nproc_per_node * p.nnodes // max(1, p.tp * p.pp * p.cp)} or fix nproc_per_node",
            )
        )
    if p.nproc_per_node is None and total % max(p.nnodes, 1):
        errors.append(
            ConfigError("parallel.nnodes", p.nnodes, f"must divide tp*pp*cp*dp = {total} workers")
        )
    if p.node_rank is not None and not 0 <= p.node_rank < max(p.nnodes, 1):
        errors.append(ConfigError("parallel.node_rank", p.node_rank, "must be in [0, nnodes)"))
    if p.run_id is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", p.run_id):
        errors.append(
            ConfigError("parallel.run_id", p.run_id, "use letters, digits, '.', '_', '-' only")
        )
    if p.nnodes > 1:
        errors += _multi_node_errors(p)


def _multi_node_errors(p: ParallelConfig) -> list[ConfigError]:
    """Keys every node of a multi-node run needs (filled from SLURM's environment when given)."""
    multi = f"multi-node (nnodes={p.nnodes}): "
    needed = {
        "parallel.run_id": (
            p.run_id,
            multi + "every node must share one run id (torchrun's --rdzv-id and the run directory "
            "outputs/<run_id>) and no scheduler job id was found (SLURM_JOB_ID, PBS_JOBID, "
            "LSB_JOBID): set parallel.run_id=NAME, the same on every node",
        ),
        "parallel.node_rank": (
            p.node_rank,
            multi + "not under SLURM (no SLURM_NODEID): set parallel.node_rank=0..nnodes-1 "
            "on each node",
        ),
        "parallel.rdzv_endpoint": (
            p.rdzv_endpoint,
            multi + "not under SLURM (no SLURM_JOB_NODELIST): set "
            "parallel.rdzv_endpoint=HOST:PORT of node 0, the same on every node",
        ),
    }
    return [ConfigError(key, None, fix) for key, (value, fix) in needed.items() if value is None]
