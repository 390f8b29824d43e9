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
