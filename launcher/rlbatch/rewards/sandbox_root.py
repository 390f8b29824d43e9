"""The empty root of one execution and the credentials of its processes; standard library only
(imported by the sandbox's PID 1).

:func:`build_root` makes a fresh tmpfs the root of the mount namespace (``pivot_root``) holding
only what the host's plan lists (the interpreter, its shared libraries and its standard library,
each bind-mounted read-only at its own path, with the symlinks that lead to them), a minimal
/dev (null, zero, urandom), a private /proc of the PID namespace and a size-limited /tmp holding
the scratch directory; the old root is detached, so nothing else of the machine (datasets, home
directories, other executions' folders) has a path. :func:`drop_privileges` leaves a process
with no capability in any namespace and no way to gain one.
"""

import ctypes
import os

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
SECBITS_LOCKED_NO_ROOT = 0b11101011
"""NOROOT, KEEP_CAPS off and NO_CAP_AMBIENT_RAISE, each locked: uid 0 never regains capabilities
through exec, and no capability can be raised again."""
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
_ST_FLAGS = ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC))

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _locked_flags(path):
    """The flags of the mount holding ``path`` that a remount must keep (in a user namespace
    the kernel refuses to clear nosuid, nodev or noexec of a mount it did not create)."""
    flags = os.statvfs(path).f_flag
    return sum(ms for st, ms in _ST_FLAGS[1:] if flags & st)


def bind_readonly(source, target, device=False, readonly=True):
    mount(source, target, None, MS_BIND | MS_REC)
    extra = _locked_flags(source) | MS_NOSUID | (0 if device else MS_NODEV)
    mount(None, target, None, MS_REMOUNT | MS_BIND | (MS_RDONLY if readonly else 0) | extra)


def _apply(plan, root):
    """Replay the host's plan (dirs, symlinks, read-only binds, empty covers) under ``root``."""
    for op in plan:
        kind, path = op[0], root + op[1]
        if kind == "dir":
            os.makedirs(path, 0o755, exist_ok=True)
        elif kind == "symlink" and not os.path.lexists(path):
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            os.symlink(op[2], path)
        elif kind in ("bind_dir", "bind_file", "cover"):
            os.makedirs(path if kind != "bind_file" else os.path.dirname(path), 0o755, True)
            if kind == "bind_file":
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            if kind == "cover":
                mount("none", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
            else:
                bind_readonly(op[1], path)


def _dev(root):
    os.makedirs(root + "/dev", 0o755)
    for name in ("null", "zero", "urandom"):
        path = f"{root}/dev/{name}"
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        bind_readonly(f"/dev/{name}", path, device=True, readonly=name != "null")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/1", f"{root}/dev/stdout")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")


def _proc(root):
    os.makedirs(root + "/proc", 0o555)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:  # processes the program may not trace are not even listed
        mount("proc", root + "/proc", "proc", flags, "hidepid=invisible,subset=pid")
    except OSError:
        mount("proc", root + "/proc", "proc", flags)


def pivot(root):
    """Make ``root`` the root of this mount namespace and detach the old one."""
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: unknown system call number on {os.uname().machine}")
    os.chdir(root)
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def build_root(mount_point, plan, scratch_mb, files):
    """Build the execution's root at ``mount_point`` and pivot into it. ``files`` maps a path in
    the new root to its text (written before the root turns read-only). Returns the scratch
    directory's path."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("none", mount_point, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    root = mount_point
    _apply(plan, root)
    _dev(root)
    _proc(root)
    os.makedirs(root + "/tmp", 0o755)
    mount("none", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=1777")
    os.makedirs(root + "/dev/shm", 0o755)
    mount(root + "/tmp", root + "/dev/shm", None, MS_BIND)  # shm shares the scratch budget
    for path, text in files.items():
        os.makedirs(os.path.dirname(root + path), 0o755, exist_ok=True)
        with open(root + path, "w") as f:
            f.write(text)
    pivot(root)
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return "/tmp/scratch"


def _last_cap():
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def drop_privileges(uid, last_cap):
    """No capabilities, now or after exec: lock the securebits so that exec grants none back to
    uid 0, empty the bounding set, then as root become ``uid`` (a fresh uid with no groups), in
    a user namespace (``uid`` None) stay its uid 0, and drop every capability left. Then no new privileges
    and not dumpable (nothing of the same uid may trace or read this process)."""
    _check(_libc.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NO_ROOT, 0, 0, 0), "securebits")
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "capability bounding set")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")


def last_cap():
    """The highest capability number of this kernel (read while /proc is the host's)."""
    return _last_cap()
