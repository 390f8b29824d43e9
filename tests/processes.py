"""The live processes of a run, read from /proc (shared by the end-to-end fault tests)."""

from __future__ import annotations

import os
from pathlib import Path


def processes_of(run_dir: Path) -> dict[int, str]:
    """pid -> command line of every live process whose command line names ``run_dir``: the
    launcher (hydra.run.dir), torchrun and the workers (--config RUN_DIR/resolved.yaml)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended meanwhile
        if str(run_dir) in cmdline:
            found[int(proc.name)] = cmdline
    return found


def processes_marked(name: str, value: str) -> dict[int, str]:
    """pid -> command line of every live process (zombies excluded) whose environment holds
    ``name=value``: with a marker set in the launcher's environment, every process the run
    started, whatever its command line (spawned and forked children, multiprocessing's resource
    tracker) and whoever its parent is now."""
    marker = f"{name}={value}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_bytes().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended meanwhile
    return found
