"""What an execution's empty root holds, and the memory cgroup of an execution (host side).

:func:`root_plan` lists, once per process, the paths the sandboxed interpreter needs and nothing
else: the base interpreter, the shared libraries it and its compiled standard-library modules
load (``ldd``), the standard library directories (the installation's ``site-packages`` covered
by an empty directory), ``/etc/ld.so.cache``, and every symlink on the way to them. The sandbox's
PID 1 replays the plan (:mod:`rlbatch.rewards.sandbox_root`).

:class:`MemoryCgroup` bounds the memory of all the processes of one execution together: a child
cgroup with ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (the v1 memory controller)
when this process may create one; :func:`cgroup_kind` says which (or ``none``: then each process
is bounded by RLIMIT_AS and their number by RLIMIT_NPROC).
"""

from __future__ import annotations

import functools
import glob
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

_SITE_DIRS = ("site-packages", "dist-packages")


def base_python() -> tuple[str, str]:
    """(installation prefix, interpreter path relative to it) of the base interpreter (a
    virtualenv's python is a link into it; the sandbox sees the standard library only)."""
    exe = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    prefix = Path(sys.base_prefix).resolve()
    return str(prefix), str(exe.relative_to(prefix))


def _stdlib_dirs() -> list[str]:
    prefix = Path(sys.base_prefix).resolve()
    dirs = []
    for entry in sys.path:
        path = Path(entry).resolve() if entry else None
        if path is None or not path.is_dir() or any(s in path.parts for s in _SITE_DIRS):
            continue
        if path.is_relative_to(prefix) and str(path) not in dirs:
            dirs.append(str(path))
    return dirs


def _shared_libraries(binaries: list[str]) -> list[str]:
    """Every library ``ldd`` resolves for ``binaries`` (the loader included)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    out = subprocess.run([ldd, *binaries], capture_output=True, text=True, check=False).stdout
    paths = []
    for line in out.splitlines():
        token = line.split("=>")[-1].strip().split(" (")[0].strip()
        if token.startswith("/") and os.path.exists(token) and token not in paths:
            paths.append(token)
    return paths


def _replicate(path: str, ops: list[list[str]], seen: set[str]) -> Optional[str]:
    """Add the ops that make ``path`` resolve in the new root as on the host (each symlink on
    the way recreated); the resolved path, to bind."""
    current = "/"
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        step = os.path.join(current, part)
        if os.path.islink(step):
            target = os.readlink(step)
            if step not in seen:
                seen.add(step)
                ops.append(["symlink", step, target])
            resolved = os.path.normpath(os.path.join(current, target))
            return _replicate(os.path.join(resolved, *parts[i + 1 :]), ops, seen)
        current = step
    return current if os.path.exists(current) else None


@functools.lru_cache(maxsize=1)
def root_plan() -> tuple[tuple[str, ...], ...]:
    """The ops that build an execution's root: dirs, symlinks, read-only binds, empty covers."""
    prefix, rel = base_python()
    interpreter = os.path.join(prefix, rel)
    stdlib = _stdlib_dirs()
    compiled = [f for d in stdlib for f in glob.glob(os.path.join(d, "*.so"))]
    libraries = _shared_libraries([interpreter, *compiled])
    fallback = [] if libraries else ["/lib", "/lib64", "/usr/lib", "/usr/lib64"]
    ops: list[list[str]] = []
    seen: set[str] = set()
    bound: list[str] = []
    for path, kind in (
        *((d, "bind_dir") for d in [*stdlib, *fallback] if os.path.exists(d)),
        *((f, "bind_file") for f in [interpreter, *libraries, "/etc/ld.so.cache"]),
    ):
        if not os.path.exists(path):
            continue
        real = _replicate(path, ops, seen)
        if real is None or any(real == b or real.startswith(b + "/") for b in bound):
            continue
        bound.append(real)
        ops.append([kind, real])
    for directory in stdlib:
        for site in _SITE_DIRS:
            if os.path.isdir(os.path.join(directory, site)):
                ops.append(["cover", os.path.join(directory, site)])
    return tuple(tuple(op) for op in ops)


# ---------------------------------------------------------------- memory cgroup


def _own_cgroup(kind: str) -> Optional[Path]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if kind == "v2" and controllers == "":
            for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                if Path(mount, "cgroup.controllers").exists():
                    return Path(mount + path)
        if kind == "v1" and "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory" + path)
    return None


def _try_child(parent: Path, kind: str) -> bool:
    child = parent / f"rlbatch-probe-{secrets.token_hex(4)}"
    limit_file = "memory.max" if kind == "v2" else "memory.limit_in_bytes"
    try:
        if kind == "v2" and "memory" not in (parent / "cgroup.subtree_control").read_text():
            return False  # not delegated to this process (rlbatch never changes it)
        child.mkdir()
    except OSError:
        return False
    try:
        (child / limit_file).write_text(str(64 << 20))
        return True
    except OSError:
        return False
    finally:
        child.rmdir()


@functools.lru_cache(maxsize=1)
def cgroup_kind() -> tuple[str, Optional[Path]]:
    """("v2" | "v1", the parent directory) where this process may create memory cgroups, else
    ("none", None)."""
    for kind in ("v2", "v1"):
        parent = _own_cgroup(kind)
        if parent is not None and parent.is_dir() and _try_child(parent, kind):
            return kind, parent
    return "none", None


class MemoryCgroup:
    """A fresh cgroup bounding the memory of one execution's processes (removed on close)."""

    def __init__(self, limit_bytes: int) -> None:
        self.kind, parent = cgroup_kind()
        self.path: Optional[Path] = None
        if parent is None:
            return
        path = parent / f"rlbatch-sandbox-{secrets.token_hex(8)}"
        try:
            path.mkdir()
            if self.kind == "v2":
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                swap = path / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    swap.write_text(str(limit_bytes))
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            return
        self.path = path

    def job(self) -> Optional[dict[str, str]]:
        """What the sandbox's PID 1 needs: the file that takes a process, the OOM counter."""
        if self.path is None:
            return None
        events = "memory.events" if self.kind == "v2" else "memory.oom_control"
        return {"procs": str(self.path / "cgroup.procs"), "events": str(self.path / events)}

    def close(self) -> None:
        if self.path is None:
            return
        for _ in range(50):  # the last processes may still be exiting
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
