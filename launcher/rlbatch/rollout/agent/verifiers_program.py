"""verifiers' chat program (the model side of an episode) as rlbatch runs it
(rlbatch.rollout.agent.verifiers_env): prepared for this interpreter from the verifiers extra's
packages instead of installed with ``uv`` at run time, and run in this process on the harness
loop, with verifiers' arguments, instead of as a process per harness segment (a program with
tools that run on this machine still runs as a process)."""

from __future__ import annotations

import contextvars
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional


def program_problem() -> Optional[str]:
    """Why this interpreter cannot run verifiers' chat program in place of the environment
    ``uv`` would build for it (a dependency missing, or another version of a pinned one); None
    when it can."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM

    deps = re.search(r"dependencies = \[(.*)\]", CHAT_PROGRAM)
    for dep in re.findall(r'"([^"]+)"', deps.group(1) if deps else ""):
        name, _, pinned = dep.partition("==")
        if importlib.util.find_spec(name) is None:
            return f"verifiers' chat program needs the {name} package: pip install 'rlbatch[verifiers]'"  # fmt: skip
        if pinned and importlib.metadata.version(name) != pinned:
            return (
                f"verifiers' chat program pins {dep}, and {name}"
                f" {importlib.metadata.version(name)} is installed: pip install '{dep}'"
            )
    return None


def prepare_chat_program() -> Path:
    """Hand verifiers' subprocess runtime this interpreter for its chat program: write the
    program where the runtime keeps prepared scripts (``<scripts_dir>/<sha256>.py``, the path
    it derives from the program's text) and enter this interpreter in its cache of prepared
    ones, so ``Runtime.prepare_uv_script`` finds it prepared and runs no ``uv``."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_bytes() != data:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    SubprocessRuntime._interpreters[str(path)] = sys.executable
    return path


LOCAL_TOOLS = ("--bash", "--edit", "--search")
"""The chat program's flags that run tools on this machine (the ``bash`` harness): such a
program runs as verifiers runs it, a process in the runtime's folder."""
_ARGV: contextvars.ContextVar[list[str]] = contextvars.ContextVar("rlbatch_vf_argv")
_PROGRAM: dict[str, Any] = {}


def _program() -> dict[str, Any]:
    """The chat program's namespace, executed once in this process (its ``__main__`` guard not
    run), its ``argparse`` reading each run's arguments (:data:`_ARGV`) rather than sys.argv."""
    if not _PROGRAM:
        import argparse
        import types

        from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

        class Parser(argparse.ArgumentParser):
            def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
                return super().parse_args(_ARGV.get() if args is None else args, namespace)

        namespace: dict[str, Any] = {"__name__": "verifiers_chat_program"}
        exec(compile(CHAT_PROGRAM_SOURCE, "verifiers_chat_program", "exec"), namespace)  # noqa: S102
        shim = types.ModuleType("argparse")
        shim.__dict__.update(vars(argparse))
        shim.ArgumentParser = Parser  # type: ignore[attr-defined]
        namespace["argparse"] = shim
        _PROGRAM.update(namespace)
    return _PROGRAM


async def run_in_process(args: list[str], folder: Optional[Path]) -> Any:
    """verifiers' chat program run with ``args`` on this event loop: its ``main()``, its
    relative file arguments read from the runtime's ``folder``; its ProgramResult (0; its own
    exit code; 1 and the traceback when it raises)."""
    import traceback

    from verifiers.v1.runtimes import ProgramResult

    flag = "--initial-messages-file="
    if folder is not None:
        args = [
            f"{flag}{folder / a[len(flag) :]}"
            if a.startswith(flag) and not Path(a[len(flag) :]).is_absolute()
            else a  # fmt: skip
            for a in args
        ]
    main = _program()["main"]
    token = _ARGV.set(args)
    try:
        await main()
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
        return ProgramResult(code, "", traceback.format_exc() if code else "")
    except Exception:  # noqa: BLE001 - the program's failure is its result, as a process's is
        return ProgramResult(1, "", traceback.format_exc())
    finally:
        _ARGV.reset(token)
    return ProgramResult(0, "", "")


def run_chat_in_process(path: Path) -> None:
    """Make verifiers' subprocess runtime run the chat program at ``path`` in this process
    (:func:`run_in_process`) instead of starting it as a process, unless its arguments ask for
    tools that run on this machine (:data:`LOCAL_TOOLS`) or its harness sets program variables:
    those run as a process, as verifiers runs them."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    original = SubprocessRuntime.run_program
    if getattr(original, "rlbatch_in_process", None) == str(path):
        return
    program = str(path)

    async def run_program(self: Any, argv: list[str], env: dict[str, str]) -> Any:
        if program in argv and not env:
            args = argv[argv.index(program) + 1 :]
            if not any(a.split("=", 1)[0] in LOCAL_TOOLS for a in args):
                return await run_in_process(args, self.workdir)
        return await original(self, argv, env)

    run_program.rlbatch_in_process = program  # type: ignore[attr-defined]
    SubprocessRuntime.run_program = run_program  # type: ignore[method-assign]
