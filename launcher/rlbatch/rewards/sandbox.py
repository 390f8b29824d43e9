"""Run untrusted Python in a sandbox: one sandbox per execution, nothing kept afterwards.

An execution is ``unshare`` (util-linux) starting :mod:`rlbatch.rewards.sandbox_init` as PID 1
of fresh PID, mount, network, IPC and UTS namespaces; it runs the program as a fresh
unprivileged uid with rlimits, from a scratch directory on a tmpfs that vanishes with the
namespaces (docs/data_and_rewards.md, "The sandbox"). As a non-root user the namespaces are
entered through a user namespace (``unshare --user --map-root-user``): the program then keeps
the user's own file permissions and process count (documented as weaker).

:func:`probe_isolation` says which isolation works on this machine (the driver refuses a
``code_exec`` run without one unless ``data.code_exec.isolation=none``). ``none`` runs the same
bootstrap without namespaces: rlimits and a clean environment only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

from rlbatch.config.rewards import Isolation, SandboxLimits

INIT = Path(__file__).with_name("sandbox_init.py")
NAMESPACES = ["--pid", "--fork", "--mount-proc", "--mount", "--net", "--ipc", "--uts"]
_GRACE_S = 2.0
"""Seconds the host waits beyond the wall limit before killing the sandbox's process group."""


class Outcome(str, Enum):
    """How one execution ended."""

    ok = "ok"
    timeout = "timeout"
    memory = "memory"
    output_limit = "output_limit"
    crash = "crash"


@dataclass(frozen=True)
class Execution:
    """The result of one sandboxed run."""

    outcome: Outcome
    exit_code: Optional[int]
    signal: Optional[int]
    stdout: str
    """At most SandboxLimits.max_output_bytes of the program's standard output."""
    stderr: str
    """The last 2,000 characters of its standard error."""
    wall_s: float


def _base_python() -> tuple[str, str]:
    """(installation prefix, interpreter path relative to it) of the base interpreter (a
    virtualenv's python is a link into it; the sandbox sees the standard library only)."""
    exe = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    prefix = Path(sys.base_prefix).resolve()
    return str(prefix), str(exe.relative_to(prefix))


def _command(isolation: Isolation) -> list[str]:
    python = str(Path(_base_python()[0]) / _base_python()[1])
    tail = [python, "-I", "-S", "-B", str(INIT)]
    if isolation == Isolation.none:
        return tail
    unshare = shutil.which("unshare") or "unshare"
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [unshare, *user, *NAMESPACES, "--kill-child", *tail]


def probe_isolation(requested: Isolation) -> tuple[Optional[Isolation], str]:
    """(the isolation to use, "") or (None, why none works): ``auto`` and ``unshare`` try an
    empty program in the namespaces; ``none`` always works."""
    if requested == Isolation.none:
        return Isolation.none, ""
    if shutil.which("unshare") is None:
        return None, "no 'unshare' on PATH (util-linux)"
    limits = SandboxLimits(wall_s=10.0, cpu_s=10.0)
    try:
        run = execute("print('ok')", "", limits, Isolation.unshare)
    except (OSError, RuntimeError) as err:
        return None, f"unshare failed: {err}"
    if run.outcome != Outcome.ok or run.stdout.strip() != "ok":
        return None, f"unshare failed: exit {run.exit_code}, stderr {run.stderr[-300:]!r}"
    return Isolation.unshare, ""


def _job(limits: SandboxLimits, isolation: Isolation) -> dict:
    prefix, rel = _base_python()
    uid: Optional[int] = None
    if os.geteuid() == 0 and isolation != Isolation.none:
        uid = random.SystemRandom().randrange(1_000_000, 2_000_000_000)
    nproc = limits.max_processes
    if os.geteuid() != 0:  # the count is the user's own: room for what it already runs
        nproc += _count_processes(os.getuid())
    return {
        "prefix": prefix,
        "python_rel": rel,
        "uid": uid,
        "cpu_s": limits.cpu_s,
        "wall_s": limits.wall_s,
        "memory_mb": limits.memory_mb,
        "file_size_mb": limits.file_size_mb,
        "max_open_files": limits.max_open_files,
        "max_processes": nproc,
        "scratch_mb": limits.scratch_mb,
        "isolation": isolation.value,
    }


def _count_processes(uid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def execute(program: str, stdin: str, limits: SandboxLimits, isolation: Isolation) -> Execution:
    """Run ``program`` (Python source) with ``stdin`` under ``limits``; never raises for
    anything the program does (RuntimeError only when the sandbox itself cannot start)."""
    job_dir = Path(tempfile.mkdtemp(prefix="rlbatch-sandbox-"))
    try:
        (job_dir / "job.json").write_text(json.dumps(_job(limits, isolation)))
        (job_dir / "program.py").write_text(program)
        (job_dir / "stdin.txt").write_text(stdin)
        return _run(job_dir, limits, isolation)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def _run(job_dir: Path, limits: SandboxLimits, isolation: Isolation) -> Execution:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    started = time.monotonic()
    with open(job_dir / "init.log", "wb") as log:
        proc = subprocess.Popen(
            [*_command(isolation), str(job_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limits.wall_s + _GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - started
    status_text = (
        (job_dir / "status.json").read_text() if (job_dir / "status.json").exists() else ""
    )
    if not status_text:
        if wall >= limits.wall_s:
            return Execution(Outcome.timeout, None, signal.SIGKILL, "", "", wall)
        raise RuntimeError(
            f"the sandbox did not start (exit {proc.returncode}):"
            f" {(job_dir / 'init.log').read_text(errors='replace')[-500:]}"
        )
    status = json.loads(status_text)
    stdout = _read_head(job_dir / "stdout", limits.max_output_bytes)
    stderr = _read_tail(job_dir / "stderr", 2000)
    outcome = classify(status, stderr, limits.cpu_s)
    return Execution(outcome, status["exit_code"], status["signal"], stdout, stderr, wall)


def classify(status: dict, stderr: str, cpu_limit_s: float) -> Outcome:
    """The outcome of a run from its status (exit code or signal, CPU seconds, wall limit)
    and stderr. RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL at the hard one; a
    SIGKILL before the CPU limit is the program's own doing (a crash)."""
    sig = status.get("signal")
    over_cpu = sig == signal.SIGKILL and status.get("cpu_s", 0.0) >= cpu_limit_s - 0.05
    if status.get("wall_timeout") or sig == signal.SIGXCPU or over_cpu:
        return Outcome.timeout
    if sig == signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: EFBIG
        return Outcome.output_limit
    if status.get("exit_code") == 0:
        return Outcome.ok
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return Outcome.memory
    return Outcome.crash


def _read_head(path: Path, limit: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _read_tail(path: Path, limit: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode("utf-8", errors="replace")
