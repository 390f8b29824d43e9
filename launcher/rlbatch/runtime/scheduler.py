"""What a job scheduler tells a multi-node launch: one run id, this node's rank, node 0's host.

Every node runs the same ``rlbatch-train`` command; the keys that differ per node or must be
the same on all of them come from the scheduler's environment when not given:

- ``parallel.run_id``: ``slurm-<SLURM_JOB_ID>[.<SLURM_STEP_ID>]``, ``pbs-<PBS_JOBID>`` or
  ``lsf-<LSB_JOBID>`` (multi-node only; a single-node run gets a new id per run, as before);
- ``parallel.node_rank``: ``SLURM_NODEID``;
- ``parallel.rdzv_endpoint``: the first host of ``SLURM_JOB_NODELIST`` (``scontrol show
  hostnames``, or a simple parse without scontrol) and port ``RDZV_BASE_PORT + job id % 1000``.

Torch-free and Hydra-free; the environment is passed in, so all of it is testable here.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from typing import Optional

from rlbatch.config.errors import ConfigError
from rlbatch.config.schema import ParallelConfig

RDZV_BASE_PORT = 29500
"""Rendezvous port under SLURM: this + (job id mod 1000), so jobs sharing node 0 differ."""
JOB_ID_VARS = (("SLURM_JOB_ID", "slurm"), ("PBS_JOBID", "pbs"), ("LSB_JOBID", "lsf"))
"""Scheduler job-id variables, first found wins, and the run-id prefix of each."""


def scheduler_run_id(env: Mapping[str, str]) -> Optional[str]:
    """The id every node of this scheduler job shares, or None outside a scheduler job."""
    for var, prefix in JOB_ID_VARS:
        job = env.get(var)
        if job:
            step = env.get("SLURM_STEP_ID") if prefix == "slurm" else None
            name = f"{prefix}-{job}" + (f".{step}" if step else "")
            return re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list without scontrol: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def scontrol_first_host(nodelist: str) -> str:
    """First host by ``scontrol show hostnames`` (exact for every syntax), else :func:`first_host`."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else first_host(nodelist)


def apply_scheduler_env(
    parallel: ParallelConfig,
    env: Mapping[str, str],
    resolve_host: Callable[[str], str] = scontrol_first_host,
) -> list[ConfigError]:
    """Fill the multi-node keys left null from the scheduler's environment (in place); return
    what contradicts it (an ``srun`` step over another number of nodes than parallel.nnodes).

    Single node: ``node_rank`` null -> 0 and nothing else (standalone rendezvous, a new run id
    per run). Keys that stay null on a multi-node run are reported by config validation.
    """
    errors = _step_mismatch(parallel, env)
    if parallel.nnodes <= 1:
        if parallel.node_rank is None:
            parallel.node_rank = 0
        return errors
    if parallel.run_id is None:
        parallel.run_id = scheduler_run_id(env)
    if parallel.node_rank is None and env.get("SLURM_NODEID", "").isdigit():
        parallel.node_rank = int(env["SLURM_NODEID"])
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if parallel.rdzv_endpoint is None and nodelist and env.get("SLURM_JOB_ID", "").isdigit():
        port = RDZV_BASE_PORT + int(env["SLURM_JOB_ID"]) % 1000
        parallel.rdzv_endpoint = f"{resolve_host(nodelist)}:{port}"
    return errors


def _step_mismatch(parallel: ParallelConfig, env: Mapping[str, str]) -> list[ConfigError]:
    """srun runs the command once per node of its step: that count must be parallel.nnodes
    (more would start independent copies of the run, fewer would wait at the rendezvous)."""
    nodes = env.get("SLURM_STEP_NUM_NODES", "")
    if not nodes.isdigit() or int(nodes) == parallel.nnodes:
        return []
    fix = (
        f"srun started this command on {nodes} node(s) (SLURM_STEP_NUM_NODES): set "
        f"parallel.nnodes={nodes}, or run srun with --nodes={parallel.nnodes} --ntasks-per-node=1"
    )
    return [ConfigError("parallel.nnodes", parallel.nnodes, fix)]
