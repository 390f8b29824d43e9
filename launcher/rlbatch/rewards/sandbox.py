"""Run untrusted Python in a sandbox: one sandbox per execution, nothing kept afterwards.

An execution is ``unshare`` (util-linux) starting :mod:`rlbatch.rewards.sandbox_init` as PID 1
of fresh PID, mount, network, IPC and UTS namespaces (as a non-root user, inside a user
namespace). PID 1 builds an empty root (only the interpreter and its standard library, read-only)
and runs the program without any capability, under rlimits and, where this process may create
one, a memory cgroup (docs/data_and_rewards.md, "The sandbox"). The job goes to PID 1 on its
stdin and the report comes back on its stdout, with a random token of this execution: the
program holds neither pipe. A ``test_code`` execution runs the asserts in a process of their
own that talks to the program in plain data (:mod:`rlbatch.rewards.sandbox_harness`).

:func:`probe_isolation` says which isolation works on this machine (the driver refuses a
``code_exec`` run without one unless ``data.code_exec.isolation=none``). ``none`` runs the same
bootstrap without namespaces: rlimits and a clean environment only.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional

from rlbatch.config.rewards import Isolation, SandboxLimits
from rlbatch.rewards.sandbox_plan import MemoryCgroup, base_python, root_plan

INIT = Path(__file__).with_name("sandbox_init.py")
NAMESPACES = ["--pid", "--fork", "--mount-proc", "--mount", "--net", "--ipc", "--uts"]
STARTUP_S = 60.0
"""Seconds the host allows the sandbox to start (namespaces, root, PID 1's interpreter) on top
of the execution's own ceiling: its limits start when the program does, so a slow start on a
busy machine never counts against the program."""
CEILING_FACTOR = 10.0
"""The hard wall ceiling of an execution, in multiples of wall_s: the wall limit does not count
the time the program waited for a CPU, and this bounds how long a starved one may hold a worker."""


class Outcome(str, Enum):
    """How one execution ended."""

    ok = "ok"
    wrong_answer = "wrong_answer"
    """test_code: an assertion failed."""
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
    detail: str = ""
    """test_code: why the asserts did not pass (the failed assertion, the program's end)."""


def longest_s(limits: SandboxLimits) -> float:
    """The longest the host waits for one execution (its start-up, the hard ceiling of a
    starved program, the report): what a batch's bound must allow per wave."""
    return STARTUP_S + CEILING_FACTOR * limits.wall_s + 5.0


def _command(isolation: Isolation) -> list[str]:
    python = str(Path(base_python()[0]) / base_python()[1])
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


def _job(limits: SandboxLimits, isolation: Isolation, token: str) -> dict:
    prefix, rel = base_python()
    uid: Optional[int] = None
    asserts_uid: Optional[int] = None
    if os.geteuid() == 0 and isolation != Isolation.none:
        rng = random.SystemRandom()
        uid, asserts_uid = (rng.randrange(1_000_000, 2_000_000_000) for _ in range(2))
    nproc = limits.max_processes
    if os.geteuid() != 0 and isolation != Isolation.none:
        # counted per user namespace: unshare, PID 1 and the asserts' process share uid 0
        nproc += 3
    elif os.geteuid() != 0:  # no namespace: the user's own count, room for what it runs
        nproc += _count_processes(os.getuid())
    wall = limits.wall_s
    return {
        "token": token,
        "python": os.path.join(prefix, rel),
        "plan": [list(op) for op in root_plan()] if isolation != Isolation.none else [],
        "uid": uid,
        "asserts_uid": asserts_uid,
        "cpu_s": limits.cpu_s,
        "wall_s": wall,
        "ceiling_s": CEILING_FACTOR * wall,
        "memory_mb": limits.memory_mb,
        "file_size_mb": limits.file_size_mb,
        "max_open_files": limits.max_open_files,
        "max_processes": nproc,
        "scratch_mb": limits.scratch_mb,
        "max_output_bytes": limits.max_output_bytes,
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


def execute(
    program: str,
    stdin: str,
    limits: SandboxLimits,
    isolation: Isolation,
    test_code: Optional[str] = None,
) -> Execution:
    """Run ``program`` (Python source) with ``stdin`` under ``limits`` (with ``test_code``: run
    those asserts against it, in a process of their own); never raises for anything the program
    does (RuntimeError only when the sandbox itself cannot start)."""
    token = secrets.token_hex(16)
    job = _job(limits, isolation, token)
    job.update(program=program, stdin=stdin, test_code=test_code)
    cgroup = MemoryCgroup((limits.memory_mb + limits.scratch_mb) << 20)
    if isolation != Isolation.none:
        job["cgroup"] = cgroup.job()
    mount_point = tempfile.mkdtemp(prefix="rlbatch-sandbox-")
    try:
        return _run(job, mount_point, isolation)
    finally:
        shutil.rmtree(mount_point, ignore_errors=True)
        cgroup.close()


def _run(job: dict, mount_point: str, isolation: Isolation) -> Execution:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        [*_command(isolation), mount_point],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(
            json.dumps(job).encode(), timeout=STARTUP_S + job["ceiling_s"] + 5.0
        )
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Execution(Outcome.timeout, None, signal.SIGKILL, "", "", job["ceiling_s"])
    try:
        report = json.loads(out) if out else None
    except ValueError:
        report = None
    if type(report) is not dict or report.get("token") != job["token"]:
        raise RuntimeError(
            f"the sandbox did not start (exit {proc.returncode}):"
            f" {err.decode(errors='replace')[-500:]}"
        )
    outcome, detail = classify(report, job["cpu_s"], job["test_code"] is not None)
    return Execution(
        outcome,
        report["exit_code"],
        report["signal"],
        report["stdout"],
        report["stderr"],
        report["wall_s"],
        detail,
    )


def classify(report: dict, cpu_limit_s: float, asserts: bool = False) -> tuple[Outcome, str]:
    """The outcome of a run from PID 1's report, and a detail for test_code runs.

    The program's own end: RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL at the hard
    one (a SIGKILL before the CPU limit is the program's own doing: a crash, unless the memory
    cgroup killed it). With test_code only the asserts' verdict passes a run: an exit status,
    whatever it is, never does."""
    verdict = report.get("verdict") or {}
    if asserts and verdict.get("passed") is True:
        return Outcome.ok, ""
    if report.get("oom_kills", 0) > 0:  # the execution's memory cgroup killed a process
        return Outcome.memory, "over memory_mb + scratch_mb, all its processes together"
    if report.get("wall_timeout"):
        return Outcome.timeout, ""
    if asserts and verdict.get("kind") == "assert":
        return Outcome.wrong_answer, str(verdict.get("detail", ""))
    detail = str(verdict.get("detail", ""))
    if asserts and detail.startswith("MemoryError"):
        return Outcome.memory, detail
    status = _status_outcome({**report, "stderr": report.get("stderr", "") + detail}, cpu_limit_s)
    if asserts and status == Outcome.ok:
        code = report.get("exit_code")
        ended = f"the program ended (exit {code}) before the tests finished"
        said = verdict.get("kind") == "error" or detail.startswith("ProtocolError")
        return Outcome.crash, detail if said else ended
    return status, detail


def _status_outcome(report: dict, cpu_limit_s: float) -> Outcome:
    sig = report.get("signal")
    stderr = report.get("stderr", "")
    over_cpu = sig == signal.SIGKILL and report.get("cpu_s", 0.0) >= cpu_limit_s - 0.05
    if sig == signal.SIGXCPU or over_cpu:
        return Outcome.timeout
    if report.get("oom_kills", 0) > 0:  # the execution's memory cgroup killed it
        return Outcome.memory
    full = report.get("output_full") and report.get("exit_code") != 0
    if sig == signal.SIGXFSZ or full or "File too large" in stderr:  # Python ignores SIGXFSZ
        return Outcome.output_limit
    if report.get("exit_code") == 0:
        return Outcome.ok
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return Outcome.memory
    return Outcome.crash
