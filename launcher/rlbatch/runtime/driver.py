"""The driver: writes resolved.yaml into the run directory and launches the torchrun workers.

One launch per run (and per multirun job), so every job gets fresh processes: Megatron's
parallel state is process-global. Ctrl-C or a crashed rank stops every worker promptly, and the
failing rank's error is shown; a preemption signal makes the workers save and stop
(rlbatch.runtime.preempt); one launcher per directory (rlbatch.runtime.lock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.config.load import dump_run_config, make_paths_absolute
from rlbatch.config.schema import RunConfig
from rlbatch.config.validate import world_size
from rlbatch.runtime import preempt
from rlbatch.runtime.lifeline import child_env
from rlbatch.runtime.lock import RunLock, RunLockedError, acquire
from rlbatch.runtime.scheduler import scheduler_run_id

log = logging.getLogger("rlbatch")

RESOLVED = "resolved.yaml"
ERRORS_DIR = "errors"
DONE_DIR = "done"
STOP_GRACE_S = 10.0
EXIT_LOCKED = 3
"""Exit code when another launcher holds the run (or checkpoint) directory."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, as a shell reports it)."""


@dataclass(frozen=True)
class Ending:
    """What the launcher says when a run stops before its end."""

    resume_command: str | None
    """The command line that continues the run (rlbatch-train's own, with hydra.run.dir and
    trainer.resume=auto), or None."""

    def how_to_continue(self) -> str:
        return f"Continue this run with:\n  {self.resume_command}" if self.resume_command else ""


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
    cmd += ["--max-restarts=0", "--monitor-interval=0.1", "-m", "rlbatch.runtime.worker"]
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


def launch(
    cfg: RunConfig,
    run_dir: Path,
    entry: str,
    *,
    stdout_to_stderr: bool = False,
    resume_command: str | None = None,
) -> int:
    """Lock the run directory, write <run_dir>/resolved.yaml, run the workers, return 0 or the
    failure's exit code (EXIT_PREEMPTED after a preemption save, EXIT_INTERRUPTED after Ctrl-C,
    EXIT_LOCKED when another launcher holds the directory).
    ``stdout_to_stderr``: the workers' output goes to stderr (a command printing JSON).
    ``resume_command``: the command line that continues this run, printed after a preemption or
    an interrupt (None: the command cannot be resumed).

    Multi-node: every node calls this with the same ``run_dir``, which must be on a filesystem
    all nodes share (each rank writes its checkpoint shard there; rank 0 commits it); node 0
    alone takes the lock (rlbatch.runtime.lock)."""
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    if cfg.parallel.run_id is None:
        cfg.parallel.run_id = run_dir.name
    try:
        lock = _lock(cfg, run_dir)
    except RunLockedError as err:
        _console().print(f"rlbatch: {err}", markup=False, highlight=False)
        return EXIT_LOCKED
    with lock:
        _clear_previous_run(cfg, run_dir)
        resolved = resolved_path(cfg, run_dir)
        make_paths_absolute(cfg)
        dump_run_config(cfg, resolved)
        cmd = torchrun_command(cfg, resolved, entry)
        ending = Ending(resume_command)
        with _rollout_servers(cfg, run_dir) as env:
            return _run_workers(
                cfg, run_dir, cmd, ending, stdout_to_stderr=stdout_to_stderr, env=env
            )


@contextlib.contextmanager
def _rollout_servers(cfg: RunConfig, run_dir: Path) -> Iterator[dict[str, str]]:
    """rollout.servers.count > 0: that many vLLM servers for the run, started before the
    workers (their URLs in the workers' environment) and stopped after them (each bound to this
    process: none outlives it, even after a SIGKILL). Logs in <run_dir>/servers/."""
    if cfg.rollout.backend.value != "vllm_server" or not cfg.rollout.servers.count:
        yield {}
        return
    from rlbatch.config.schema import ServerFailure
    from rlbatch.rollout.servers.pool import LOGS_ENV, URLS_ENV
    from rlbatch.rollout.servers.process import Restarter, remove_dir, start_servers, stop_servers

    s = cfg.rollout.servers
    root = run_dir / "servers"
    log.info("starting %d vLLM rollout server(s) (logs: %s)", s.count, root)
    servers = start_servers(cfg, root, s.count)
    log.info("rollout servers: %s", ", ".join(server.url for server in servers))
    restarter = None
    if ServerFailure(s.on_failure) == ServerFailure["restart"]:
        restarter = Restarter(servers, s.max_restarts, s.start_timeout_s)
    try:
        yield {
            URLS_ENV: ",".join(server.url for server in servers),
            LOGS_ENV: ",".join(str(server.log_path) for server in servers),
        }
    finally:
        if restarter is not None:
            restarter.close()
        stop_servers(servers)
        remove_dir(root / "model")


def _lock(cfg: RunConfig, run_dir: Path) -> RunLock:
    if (cfg.parallel.node_rank or 0) != 0:
        return RunLock()  # node 0 holds the lock of the whole run
    dirs = [run_dir]
    if cfg.trainer.checkpoint.dir:
        dirs.append(Path(cfg.trainer.checkpoint.dir))
    return acquire(dirs, cfg.parallel.run_id, scheduler_run_id(os.environ))


def _clear_previous_run(cfg: RunConfig, run_dir: Path) -> None:
    """Error reports, heartbeats and exit records of an earlier run in this directory must not
    be taken for this run's (each node clears its own ranks' files)."""
    nproc = cfg.parallel.nproc_per_node or world_size(cfg) // cfg.parallel.nnodes
    first = (cfg.parallel.node_rank or 0) * nproc
    for rank in range(first, first + nproc):
        for name in (f"{ERRORS_DIR}/rank{rank}.txt", f"heartbeat/rank{rank}.json", done_file(rank)):
            (run_dir / name).unlink(missing_ok=True)
    if first == 0:
        (run_dir / preempt.RECORD).unlink(missing_ok=True)


def done_file(rank: int) -> str:
    """Written by a worker whose entry returned (rlbatch.runtime.worker)."""
    return f"{DONE_DIR}/rank{rank}"


def _run_workers(
    cfg: RunConfig,
    run_dir: Path,
    cmd: list[str],
    ending: Ending,
    *,
    stdout_to_stderr: bool = False,
    env: dict[str, str] | None = None,
) -> int:
    nodes = cfg.parallel.nnodes
    where = f", node {cfg.parallel.node_rank} of {nodes}" if nodes > 1 else ""
    log.info("run directory: %s (%d worker(s)%s)", run_dir, world_size(cfg), where)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=child_env(worker_env(cfg) | (env or {})),
        start_new_session=True,
        stdout=sys.stderr if stdout_to_stderr else None,
    )
    received: list[int] = []
    previous = _forward_preemption(proc, received)
    try:
        code = _wait(proc, received, cfg.trainer.preempt_timeout_s)
    except KeyboardInterrupt:
        _stop(proc, first=signal.SIGINT)
        _report_interrupt(cfg, run_dir, ending)
        return EXIT_INTERRUPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            _stop(proc)
    if code == 0:
        code = _unfinished(cfg, run_dir, ending)
    if code == preempt.EXIT_PREEMPTED:
        _report_preemption(run_dir, signal.Signals(received[0]).name if received else None, ending)
    elif code != 0:
        if _report_failure(run_dir, code) in ROLLOUT_FAILURES and ending.resume_command:
            _console().print(
                "A rollout server failed (the error above names it); the last completed step"
                " was saved. Once the server is back (or with other servers in"
                f" rollout.servers.urls), {ending.how_to_continue()}",
                markup=False,
                soft_wrap=True,
            )
    else:
        log.info("workers finished in %.1f s", time.monotonic() - started)
    return code


def _forward_preemption(proc: subprocess.Popen, received: list[int]) -> dict[int, Any]:
    """SIGTERM / SIGUSR1 / SIGHUP to the launcher: pass it on to torchrun as SIGUSR1 (the
    workers save at the end of the step and stop) instead of dying of it."""

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        log.warning(
            "%s: the workers save a checkpoint at the end of this step, then stop",
            signal.Signals(signum).name,
        )
        try:
            os.kill(proc.pid, preempt.FORWARD)
        except ProcessLookupError:
            pass

    previous: dict[int, Any] = {}
    for sig in preempt.SIGNALS:
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread (an embedding program): no forwarding
            break
    return previous


def _wait(proc: subprocess.Popen, received: list[int], preempt_timeout_s: float) -> int:
    """The workers' exit code; after a preemption signal, stop them once
    trainer.preempt_timeout_s passed without their exit."""
    while True:
        try:
            timeout = None if not received else preempt_timeout_s
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error(
                "the workers did not save and stop within trainer.preempt_timeout_s=%s: "
                "stopping them; the last periodic checkpoint is the newest",
                preempt_timeout_s,
            )
            _stop(proc)
            return 128 + int(received[0])


def _unfinished(cfg: RunConfig, run_dir: Path, ending: Ending) -> int:
    """0 when every local worker's entry returned; else report the ranks that exited with code
    0 before that (user code calling sys.exit(0) or os._exit(0)), with the command that continues
    the run from its newest checkpoint, and return 1."""
    nproc = cfg.parallel.nproc_per_node or world_size(cfg) // cfg.parallel.nnodes
    first = (cfg.parallel.node_rank or 0) * nproc
    missing = [r for r in range(first, first + nproc) if not (run_dir / done_file(r)).exists()]
    if not missing:
        return 0
    beats = {r: _last_beat(run_dir, r) for r in missing}
    where = "; ".join(f"rank {r}: {beat}" for r, beat in beats.items())
    _console().print(
        f"workers exited with code 0 before the run finished ({where}). Something in the "
        "process (user code such as a reward function) called sys.exit or os._exit: this run "
        "FAILED; the newest checkpoint is intact. "
        + (ending.how_to_continue() or "Continue it with trainer.resume=auto"),
        markup=False,
        style="red",
        soft_wrap=True,
    )
    return 1


def _last_beat(run_dir: Path, rank: int) -> str:
    try:
        beat = json.loads((run_dir / "heartbeat" / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return "before its first step"
    detail = f", in {beat['detail']}" if beat.get("detail") else ""
    return f"last seen at step {beat['step']} ({beat['phase']}{detail})"


def _stop(proc: subprocess.Popen, first: signal.Signals = signal.SIGTERM) -> None:
    """Signal the whole worker process group with ``first`` (SIGTERM; SIGINT after Ctrl-C: the
    workers stop at once instead of saving, which SIGTERM asks of them), then SIGTERM and SIGKILL
    after grace periods."""
    steps = [(first, STOP_GRACE_S)] + ([(signal.SIGTERM, 5.0)] if first != signal.SIGTERM else [])
    for sig, wait in (*steps, (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _report_preemption(run_dir: Path, launcher_signal: str | None, ending: Ending) -> None:
    """The signal, the step saved, where (the signal the launcher got, else the one a worker
    got), and the command that continues the run."""
    try:
        record = json.loads((run_dir / preempt.RECORD).read_text())
        line = (
            f"preempted ({launcher_signal or record['signal']}): saved step {record['step']} at "
            f"{record['path']}; exit code {preempt.EXIT_PREEMPTED}."
        )
    except (OSError, ValueError, KeyError):
        line = f"preempted: exit code {preempt.EXIT_PREEMPTED} (no checkpoint record found)."
    more = ending.how_to_continue()
    _console().print(line + (f" {more}" if more else ""), markup=False, soft_wrap=True)


def _report_interrupt(cfg: RunConfig, run_dir: Path, ending: Ending) -> None:
    """After Ctrl-C: the workers were stopped without saving; the newest checkpoint, and the
    command that continues from it."""
    ckpt_dir = Path(cfg.trainer.checkpoint.dir or run_dir / "checkpoints")
    saved = sorted(ckpt_dir.glob("step_*")) if ckpt_dir.is_dir() else []
    line = f"interrupted (Ctrl-C): stopped every worker; exit code {EXIT_INTERRUPTED}."
    if saved and ending.resume_command:
        line += f" The newest checkpoint is {saved[-1]}. {ending.how_to_continue()}"
    _console().print(line, markup=False, soft_wrap=True)


SECONDARY = (
    "Connection closed by peer",
    "Connection reset by peer",
    "RankTimeoutError",
    "Broken pipe",
)
"""What a rank reports when a peer failed first: shown after the peers' own errors."""


ROLLOUT_FAILURES = ("RolloutUnavailableError", "ServerError", "ServerDownError")
"""The error types of a rollout server that failed (rlbatch.rollout.servers.client), as a rank's
report names them."""


def _report_failure(run_dir: Path, code: int) -> str | None:
    """Show the failing rank's own error (written by the worker) in a panel: reports caused by a
    peer's failure (a closed connection, a timed-out collective) come after the others. Never
    reads markup in what it shows. The type of the error shown (its class name), if any."""
    from rich.panel import Panel
    from rich.text import Text

    console = _console()
    reports = sorted((run_dir / ERRORS_DIR).glob("rank*.txt"), key=_report_order)
    if not reports:
        console.print(f"workers failed (exit code {code}); no rank reported an error", style="red")
        return None
    first = reports[0]
    others = ", ".join(p.stem for p in reports[1:])
    title = f"{first.stem} failed first" + (f" (also: {others})" if others else "")
    body = Text(first.read_text(errors="replace").rstrip())
    console.print(Panel(body, title=Text(title), border_style="red"))
    console.print(Text(f"full reports: {run_dir / ERRORS_DIR}"))
    return _error_type(body.plain)


def _error_type(report: str) -> str | None:
    """The class name of the error a rank report starts with ("rank N: module.Class: ...")."""
    head = report.split("\n", 1)[0].split(": ")
    return head[1].rsplit(".", 1)[-1] if len(head) > 2 else None


def _report_order(path: Path) -> tuple[bool, float]:
    text = path.read_text(errors="replace")
    return any(mark in text.split("\n", 1)[0] for mark in SECONDARY), path.stat().st_mtime
