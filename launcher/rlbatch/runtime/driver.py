"""The driver: writes resolved.yaml into the run directory and launches the torchrun workers.

One launch per run (and per multirun job), so every job gets fresh processes: Megatron's
parallel state is process-global. Ctrl-C or a crashed rank stops every worker promptly, and the
failing rank's error is shown.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlbatch.config.load import dump_run_config
from rlbatch.config.schema import RunConfig
from rlbatch.config.validate import world_size
from rlbatch.runtime.lifeline import child_env

log = logging.getLogger("rlbatch")

RESOLVED = "resolved.yaml"
ERRORS_DIR = "errors"
STOP_GRACE_S = 10.0


def torchrun_command(cfg: RunConfig, resolved: Path, entry: str) -> list[str]:
    """The torchrun command line of one run.

    Single node: standalone rendezvous. Multi-node: torchrun's static rendezvous at
    ``parallel.rdzv_endpoint``, served by node 0, so node r holds global ranks
    ``r * nproc .. (r + 1) * nproc - 1`` and rank 0 (metrics, checkpoint commits) is on node 0.
    """
    p = cfg.parallel
    nproc = p.nproc_per_node or world_size(cfg) // p.nnodes
    cmd = [sys.executable, "-m", "rlbatch.runtime.torchrun", f"--nproc-per-node={nproc}"]
    if p.nnodes == 1 and not p.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={p.nnodes}",
            f"--node-rank={p.node_rank or 0}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={p.rdzv_endpoint}",
            f"--rdzv-id=rlbatch-{p.run_id or resolved.parent.name}",
        ]
    cmd += ["--max-restarts=0", "--monitor-interval=0.5", "-m", "rlbatch.runtime.worker"]
    return cmd + ["--config", str(resolved), "--entry", entry]


def resolved_path(cfg: RunConfig, run_dir: Path) -> Path:
    """<run_dir>/resolved.yaml; node r > 0 of a multi-node run writes resolved.node<r>.yaml, so
    nodes sharing the run directory never read each other's half-written file."""
    rank = cfg.parallel.node_rank or 0
    return run_dir / (RESOLVED if rank == 0 else f"resolved.node{rank}.yaml")


def worker_env(cfg: RunConfig) -> dict[str, str]:
    env = dict(os.environ)
    nproc = cfg.parallel.nproc_per_node or world_size(cfg) // cfg.parallel.nnodes
    threads = cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // nproc)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def launch(cfg: RunConfig, run_dir: Path, entry: str, *, stdout_to_stderr: bool = False) -> int:
    """Write <run_dir>/resolved.yaml, run the workers, return 0 or the failure's exit code.
    ``stdout_to_stderr``: the workers' output goes to stderr (a command printing JSON).

    Multi-node: every node calls this with the same ``run_dir``, which must be on a filesystem
    all nodes share (each rank writes its checkpoint shard there; rank 0 commits it)."""
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    if cfg.parallel.run_id is None:
        cfg.parallel.run_id = run_dir.name
    resolved = resolved_path(cfg, run_dir)
    dump_run_config(cfg, resolved)
    cmd = torchrun_command(cfg, resolved, entry)
    nodes = cfg.parallel.nnodes
    where = f", node {cfg.parallel.node_rank} of {nodes}" if nodes > 1 else ""
    log.info("run directory: %s (%d worker(s)%s)", run_dir, world_size(cfg), where)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=child_env(worker_env(cfg)),
        start_new_session=True,
        stdout=sys.stderr if stdout_to_stderr else None,
    )
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        log.warning("interrupted: stopping every worker")
        _stop(proc)
        return 130
    finally:
        if proc.poll() is None:
            _stop(proc)
    if code != 0:
        _report_failure(run_dir, code)
    else:
        log.info("workers finished in %.1f s", time.monotonic() - started)
    return code


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the whole worker process group, SIGKILL it after a grace period."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _report_failure(run_dir: Path, code: int) -> None:
    """Show the first failing rank's error (written by the worker) in a panel."""
    from rich.console import Console
    from rich.panel import Panel

    console = Console(stderr=True)
    reports = sorted((run_dir / ERRORS_DIR).glob("rank*.txt"), key=lambda p: p.stat().st_mtime)
    if not reports:
        console.print(f"[red]workers failed (exit code {code}); no rank reported an error[/]")
        return
    first = reports[0]
    others = ", ".join(p.stem for p in reports[1:])
    title = f"{first.stem} failed first" + (f" (also: {others})" if others else "")
    console.print(Panel(first.read_text().rstrip(), title=title, border_style="red"))
    console.print(f"full reports: {run_dir / ERRORS_DIR}")
