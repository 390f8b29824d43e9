"""Shared test helpers. Multi-process and CLI tests run real subprocesses (no mocks)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for CLI / torchrun subprocesses: one thread each on this small machine."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """Directory of the installed console scripts (rlbatch-train, ...)."""
    return Path(sys.executable).parent


# Only tests that need (or must not have) a GPU, or an optional extra, may skip. Any other skip (an import that
# regressed, an importorskip of a required dependency) would silently turn a core test off, so
# it is reported as a failure instead.
_MAY_SKIP = ("gpu", "cpu_only", "optional_extra")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not any(item.get_closest_marker(m) for m in _MAY_SKIP):
        if getattr(report, "wasxfail", None) is None:
            report.outcome = "failed"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
            report.longrepr = (
                f"core test skipped ({reason}); only tests marked gpu or optional_extra may "
                "skip: install the missing dependency or fix the import"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (a module-level importorskip) is a failure too, except
    in tests/gpu/, whose modules may need CUDA-only packages."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not str(report.nodeid).replace("\\", "/").startswith("tests/gpu"):
        report.outcome = "failed"


@pytest.fixture(scope="session")
def gpu_figures():
    """tests/gpu's figures (parity errors, tokens/s, peak memory): printed, and appended as JSON
    lines to the file named by RLBATCH_GPU_FIGURES when it is set (tests/gpu/check.sh shows
    them at the end)."""
    import json

    path = os.environ.get("RLBATCH_GPU_FIGURES")
    dryrun = os.environ.get("RLBATCH_GPU_DRYRUN") == "1"

    def record(check: str, **figures):
        line = {"check": check, "dryrun": dryrun, **figures}
        print(json.dumps(line))
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    return record


def pytest_sessionstart(session):
    """A suite started in the background by a shell without job control (``cmd &`` in a
    script, nohup) inherits SIGINT ignored, and so would every launcher and worker the tests
    start: their Ctrl-C tests would see nothing happen. Python's own handler is put back, so
    children start with the default action, as from a terminal or CI."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


SANDBOX_FILES = frozenset(
    {
        "test_documented_commands.py", "test_reward_integrity_cli.py", "test_rewards_cli.py",
        "test_sandbox_battery.py", "test_code_exec.py", "test_sandbox.py", "test_shape_twins.py",
    }
)  # fmt: skip
"""Test files that run code_exec sandboxes (the grpo_code recipe among the shape twins and the
documented commands), some under CPU and wall-time limits a hostile program is classified by:
they form one unit, run one after the other on one worker, so that two of them never load
the machine at once (their leftover checks count only their own sandboxes)."""


TEACHER_FILE = "test_served_teacher_cli.py"

SERVER_FILES = frozenset({"test_vllm_servers.py", "test_server_sync_cli.py", TEACHER_FILE})
"""Test files that train on the session's vLLM servers (:func:`vllm_server_pool`): one unit,
so the pool is started once, on one worker."""


@pytest.fixture(scope="session")
def vllm_server_pool(request, bin_dir, subprocess_env, tmp_path_factory):
    """tests/vllm_pool.POOL_SIZE rlbatch-serve servers, each on its own port, started at once
    and stopped (SIGTERM) at the end of the session; their URLs. When the session has the
    served-teacher tests, that teacher's server (tests/vllm_pool.TEACHER) starts with them, so
    that the two vLLM start-ups overlap."""
    pytest.importorskip("vllm")
    from vllm_pool import POOL_SIZE, PROCS, free_ports, serve, start_teacher, started_url, stop_all

    cwd = tmp_path_factory.mktemp("servers")
    *ports, teacher_port = free_ports(POOL_SIZE + 1)
    PROCS[:] = [serve(bin_dir, subprocess_env, cwd, port) for port in ports]
    try:
        if any(Path(str(item.fspath)).name == TEACHER_FILE for item in request.session.items):
            root = tmp_path_factory.mktemp("served_teacher")
            start_teacher(bin_dir, subprocess_env, root, teacher_port)
        yield [
            started_url(proc, cwd, port)
            for proc, port in zip(PROCS[:POOL_SIZE], ports, strict=True)
        ]
    finally:
        stop_all()


def pytest_runtest_teardown(item, nextitem):
    """The server files run one after the other on one worker: after the last of their tests,
    the pool stops at once rather than at the end of the session."""
    if Path(str(item.fspath)).name not in SERVER_FILES:
        return
    if nextitem is None or Path(str(nextitem.fspath)).name not in SERVER_FILES:
        from vllm_pool import stop_all

        stop_all()


LONG_SINGLES = ("tests/unit/test_types.py",)
"""Single tests that take a minute (mypy over the package): collected first, so the workers
take them early among the single tests, not as the run's last test while the other worker
idles."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not str(item.nodeid).startswith(LONG_SINGLES))


def pytest_xdist_make_scheduler(config, log):
    """How the test command's workers (``-n 2``) share the suite: a file with module-scoped
    fixtures (servers, reference runs) goes whole to one worker, so they are made once; the
    files on the session's vLLM servers (:data:`SERVER_FILES`) form one such unit, and so do
    the files that run sandboxes (:data:`SANDBOX_FILES`); every other test is a unit of its
    own, so the two workers stay busy to the end. xdist hands out the
    units with the most tests first, so the long shared units start early and single tests
    fill in around them."""
    from functools import cache

    from xdist.scheduler import LoadScopeScheduling

    @cache
    def shares_fixtures(path: str) -> bool:
        return 'scope="module"' in (config.rootpath / path).read_text()

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = str(nodeid).split("::", 1)[0]
            name = Path(path).name
            if name in SANDBOX_FILES:
                return "sandbox"
            if name in SERVER_FILES:
                return "vllm-servers"
            return path if shares_fixtures(path) else nodeid

    return Units(config, log)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The suite's time per test file (setup + call + teardown, summed over the workers), the
    costliest first: what to look at when the suite's wall time grows (CI shows the end of the
    output, so this comes after the slowest tests, and only failures get a line after it)."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration = getattr(report, "duration", None)
            if duration is None or not hasattr(report, "nodeid"):
                continue
            path = str(report.nodeid).split("::", 1)[0]
            per_file[path] = per_file.get(path, 0.0) + duration
    if not per_file:
        return
    total = sum(per_file.values())
    terminalreporter.write_sep("=", f"test time per file: {total:.0f} s over the workers")
    costliest = [
        f"{seconds:7.1f} s {100 * seconds / total:4.1f}% {path.removeprefix('tests/'):<44}"
        for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:40]
    ]
    for first in range(0, len(costliest), 2):  # two a line: CI shows only the end of the output
        terminalreporter.write_line("  ".join(costliest[first : first + 2]).rstrip())
