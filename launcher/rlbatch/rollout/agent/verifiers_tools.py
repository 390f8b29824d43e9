"""verifiers' tool servers as rlbatch runs them (rlbatch.rollout.agent.verifiers_env): the
taskset's shared servers started and probed before launch, each server bound to the process
that started it (a kill -9 of the run takes it along), one that exits before reporting its port
reported at once with its log, its port file removed once read, and a server that died mid-run
named in its episode's error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rlbatch.rollout.agent import verifiers_folders

TOOLS_START_S = 120.0
"""How long the pre-launch check waits for the taskset's shared tool servers to start: the
default of env.agent.verifiers_check_timeout_s."""
PORT_WAIT_S = 90.0
"""How long a tool server has to report its port (verifiers waits 180 s, then names no
fix): past it, an error naming what the server's module must do, with its log's tail. The
default of env.agent.verifiers_port_timeout_s."""
CHECK_KEY = "env.agent.verifiers_check_timeout_s"
PORT_KEY = "env.agent.verifiers_port_timeout_s"
PROGRESS_AFTER_S = 5.0
"""The pre-launch check says what it waits for once the tool servers take this long..."""
PROGRESS_EVERY_S = 10.0
"""...and again this often while it waits."""
NO_PORT_FIX = (
    "the module verifiers starts as `python -m MODULE` must serve its toolset from its"
    " `if __name__ == '__main__':` block (`MyToolset.run()`, which writes the port to"
    " MCP_PORT_FILE before its own setup); a server still importing or loading after that is"
    " too slow to start: move its loading into the toolset's setup"
)


def tool_servers_problem(
    env: Any,
    timeout_s: float = TOOLS_START_S,
    port_timeout_s: float = PORT_WAIT_S,
    what: str = "the verifiers environment",
) -> Optional[str]:
    """Why the taskset's shared tool servers do not start within ``timeout_s`` (each reporting
    its port within ``port_timeout_s``), started as the run starts them (verifiers'
    ``Env.shared_tools``: a ``python -m`` process of the taskset's module each, probed, then
    stopped), with the failing server's log; None when they start or there are none. While it
    waits longer than :data:`PROGRESS_AFTER_S` it says so on stderr (``what``: the key and
    environment it checks). A task's own tool servers start with its episode, not here."""
    toolsets = env.taskset.toolsets(env.taskset.config)
    if not toolsets:
        return None
    verifiers_folders.record_runtime_folders()
    fail_fast_tool_servers(port_timeout_s)
    bind_tool_servers()
    servers = ", ".join(sorted({f"python -m {type(t).__module__}" for t in toolsets}))

    async def start() -> None:
        async with env.shared_tools():
            pass

    async def progress(started: float) -> None:
        await asyncio.sleep(PROGRESS_AFTER_S)
        while True:
            print(
                f"rlbatch: {what}: waiting for its taskset's tool servers ({servers}) to start:"
                f" {time.monotonic() - started:.0f} s so far, at most {timeout_s:g} s"
                f" ({CHECK_KEY})",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(PROGRESS_EVERY_S)

    async def check() -> None:
        watch = asyncio.ensure_future(progress(time.monotonic()))
        try:
            await asyncio.wait_for(start(), timeout_s)
        finally:
            watch.cancel()

    try:
        asyncio.run(check())
    except TimeoutError:
        return (
            f"its taskset's tool servers ({servers}) did not start within {timeout_s:g} s"
            f" ({CHECK_KEY}={timeout_s:g}): {NO_PORT_FIX}; or raise {CHECK_KEY} when starting"
            " them takes longer"
        )
    except Exception as err:  # noqa: BLE001 - verifiers' own message, with the server's log
        return f"its taskset's tool servers did not start: {type(err).__name__}: {err}"[:3000]
    return None


BOUND_SERVER = (
    "import runpy, signal, sys\n"
    "from rlbatch.runtime.lifeline import die_with_parent\n"
    "die_with_parent(signal.SIGKILL, kernel=False)\n"
    "module = sys.argv[1]\n"
    "del sys.argv[1]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)
"""The program a tool server runs as: its module as ``python -m`` runs it, bound to the
process that started it (rlbatch.runtime.lifeline's parent-pid watch)."""


def bind_tool_servers() -> None:
    """Make every ``python -m MODULE`` process verifiers' subprocess runtime starts in the
    background (a tool server) die with the process that started it: verifiers starts it in a
    session of its own and stops it only from its serving context's exit, which a ``kill -9``
    of the run never reaches, so the server lived on, orphaned and listening. It runs the same
    module as ``__main__`` after binding itself (:data:`BOUND_SERVER`; the parent-pid watch,
    not the kernel's parent-death signal, which fires when the *thread* that started it ends:
    an evaluation's loop thread may end before the run)."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    original = SubprocessRuntime.run_background
    if getattr(original, "rlbatch_bound", False):
        return

    async def run_background(self: Any, argv: list[str], env: dict[str, str], log: str) -> None:
        module = argv[2] if len(argv) == 3 and argv[1] == "-m" else None
        if module is not None:
            argv = [argv[0], "-c", BOUND_SERVER, module]
        await original(self, argv, env, log)
        if module is not None and self.workdir is not None:
            _TOOL_SERVERS[:] = [t for t in _TOOL_SERVERS if t[2].parent.is_dir()]  # torn down
            _TOOL_SERVERS.append((self._background[-1], module, Path(self.workdir) / log))

    run_background.rlbatch_bound = True  # type: ignore[attr-defined]
    SubprocessRuntime.run_background = run_background  # type: ignore[method-assign]


_TOOL_SERVERS: list[tuple[Any, str, Path]] = []
"""(process, module, log file) of each tool server started here whose runtime is not torn
down (its folder, which holds the log, still there)."""


def dead_tool_servers() -> list[str]:
    """Each tool server that exited while its runtime was still up (a crash mid-run, which
    verifiers reports only as the tool call's connection error): its module, pid, exit code
    and the tail of its log."""
    dead = []
    for process, module, log in _TOOL_SERVERS:
        code = getattr(process, "returncode", None)
        if code in (None, -signal.SIGTERM) or not log.is_file():  # SIGTERM: stopped, as asked
            continue  # by a teardown (its runtime's, after a port timeout) or the run's end
        tail = log.read_bytes()[-1500:].decode(errors="replace").strip()
        dead.append(
            f"the tool server `python -m {module}` (pid {process.pid}) exited with code {code};"
            f" its log ({log}) ends: {tail or '(empty)'}"
        )
    return dead


_PORT_TIMEOUT_S = [PORT_WAIT_S]
"""The bound the installed port read applies (the last :func:`fail_fast_tool_servers`'s)."""


def fail_fast_tool_servers(port_timeout_s: Optional[float] = None) -> None:
    """Make verifiers report at once a tool server that exits before it reports its port:
    verifiers polls the port file for 180 s and only then raises with the server's log, so a
    server that crashed on start stalled the first episode past its deadline (a timeout naming
    nothing). The server's exit now raises verifiers' own ToolsetError, which verifiers
    completes with the log's tail. And remove the port file (``/tmp/vf-port-*``) once the port
    is read: verifiers leaves it, one file per server start (per episode for a task's own
    toolsets: tens of thousands over a run). A server that runs but has not reported its port
    within ``port_timeout_s`` (env.agent.verifiers_port_timeout_s) is an error naming what its
    module must do."""
    from verifiers.v1.mcp import launch

    if port_timeout_s is not None:
        _PORT_TIMEOUT_S[0] = port_timeout_s

    original = launch._read_back_port
    if getattr(original, "rlbatch_fail_fast", False):
        return

    async def read_back_port(runtime: Any, path: str) -> int:
        # the server: the runtime's newest background process (started just before the poll)
        server = (getattr(runtime, "_background", None) or [None])[-1]
        polling = asyncio.ensure_future(original(runtime, path))
        bound = _PORT_TIMEOUT_S[0]
        deadline = time.monotonic() + bound
        try:
            while not (await asyncio.wait({polling}, timeout=0.2))[0]:
                code = getattr(server, "returncode", None)
                if code is not None:
                    raise launch.ToolsetError(f"the server exited with code {code} before reporting its port")  # fmt: skip
                if time.monotonic() > deadline:  # verifiers adds the log's tail
                    with contextlib.suppress(Exception):  # verifiers reads it once a second:
                        data = (await runtime.read(path)).decode().strip()  # a last look
                        if data.isdigit():
                            return int(data)
                    raise launch.ToolsetError(
                        f"the server did not report its port within {bound:g} s"
                        f" ({PORT_KEY}={bound:g}): {NO_PORT_FIX}; or raise {PORT_KEY} when"
                        " the server takes longer to start"
                    )
            port = polling.result()
        finally:
            polling.cancel()
            if getattr(runtime, "type", None) == "subprocess":  # a file of this machine
                with contextlib.suppress(OSError):
                    os.unlink(path if os.path.isabs(path) else os.path.join(runtime.workdir, path))  # fmt: skip
        if getattr(runtime, "type", None) != "subprocess":  # in a sandbox: best effort
            with contextlib.suppress(Exception):
                await runtime.run(["rm", "-f", path], {})
        return port

    read_back_port.rlbatch_fail_fast = True  # type: ignore[attr-defined]
    launch._read_back_port = read_back_port
