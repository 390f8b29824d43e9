"""First process of a code sandbox (PID 1 of its own PID, mount, network, IPC and UTS
namespaces); standard library only, run as ``python -I -S sandbox_init.py JOB_DIR``.

It reads the job (``JOB_DIR/job.json``, ``program.py``, ``stdin.txt``) and opens the result files
while the host's /tmp is still visible, then:

1. covers every world-writable directory (/tmp, /var/tmp, /run/lock, /dev/shm) with a fresh
   size-limited tmpfs, so nothing the program writes outlives the namespace;
2. bind-mounts the interpreter's installation read-only at /tmp/.python (the program runs the
   interpreter from there: a home directory that other users cannot enter is no obstacle);
3. creates the scratch directory /tmp/scratch owned by the program's user, copies the program;
4. forks the program: it drops to that unprivileged user (a fresh uid per execution, so process
   limits and signals never reach another execution), sets its rlimits, and execs the
   interpreter in isolated mode (``-I -S``: no site-packages, no user environment);
5. waits up to the wall limit, kills everything left in the namespace, and writes
   ``status.json`` (exit code or signal, wall seconds, whether the wall limit hit).

When this process ends the kernel kills every process left in the PID namespace, and the mount
namespace (scratch included) disappears with it.
"""

import ctypes
import json
import math
import os
import resource
import signal
import sys
import time

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data):
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _cover_writable(scratch_mb):
    for path in ("/tmp", "/var/tmp", "/run/lock", "/dev/shm"):
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("none", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=1777")


def _bind_python(prefix):
    target = "/tmp/.python"
    os.mkdir(target, 0o755)
    _mount(prefix, target, None, MS_BIND | MS_REC, None)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
    return target


def _limits(job):
    mb = 1024 * 1024
    cpu = max(1, math.ceil(job["cpu_s"]))
    return [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (job["memory_mb"] * mb, job["memory_mb"] * mb)),
        (resource.RLIMIT_FSIZE, (job["file_size_mb"] * mb, job["file_size_mb"] * mb)),
        (resource.RLIMIT_NOFILE, (job["max_open_files"], job["max_open_files"])),
        (resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]


def _child(job, python, fds, scratch):
    """The program: unprivileged, limited, isolated interpreter."""
    os.dup2(fds["stdin"], 0)
    os.dup2(fds["stdout"], 1)
    os.dup2(fds["stderr"], 2)
    os.closerange(3, 65536)
    os.chdir(scratch)
    os.setsid()
    if job["uid"] is not None:
        os.setgroups([])
        os.setresgid(job["uid"], job["uid"], job["uid"])
        os.setresuid(job["uid"], job["uid"], job["uid"])
    for which, value in _limits(job):
        resource.setrlimit(which, value)
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    os.execve(python, [python, "-I", "-S", "-B", "program.py"], env)


def _wait(pid, wall_s, isolated):
    """(wait status, CPU seconds of the program, whether the wall limit hit)."""
    deadline = time.monotonic() + wall_s
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage.ru_utime + usage.ru_stime, False
        if time.monotonic() > deadline:
            if isolated:  # PID 1 of the namespace: every other process in it
                os.kill(-1, signal.SIGKILL)
            else:  # no namespace: the program's session (it may have left it)
                os.killpg(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            return status, usage.ru_utime + usage.ru_stime, True
        time.sleep(0.002)


def main(job_dir):
    with open(os.path.join(job_dir, "job.json")) as f:
        job = json.load(f)
    with open(os.path.join(job_dir, "program.py"), "rb") as f:
        program = f.read()
    fds = {
        "stdin": os.open(os.path.join(job_dir, "stdin.txt"), os.O_RDONLY),
        "stdout": os.open(os.path.join(job_dir, "stdout"), os.O_WRONLY | os.O_CREAT, 0o600),
        "stderr": os.open(os.path.join(job_dir, "stderr"), os.O_WRONLY | os.O_CREAT, 0o600),
    }
    status_fd = os.open(os.path.join(job_dir, "status.json"), os.O_WRONLY | os.O_CREAT, 0o600)
    isolated = job["isolation"] != "none"
    if isolated:  # only ever inside the mount namespace: never on the host's /tmp
        if os.getpid() != 1:
            raise SystemExit("sandbox_init: not PID 1 of a new PID namespace; refusing to mount")
        _cover_writable(job["scratch_mb"])
        python = os.path.join(_bind_python(job["prefix"]), job["python_rel"])
        scratch = "/tmp/scratch"
    else:
        python = os.path.join(job["prefix"], job["python_rel"])
        scratch = os.path.join(job_dir, "scratch")
    os.mkdir(scratch, 0o700)
    with open(os.path.join(scratch, "program.py"), "wb") as f:
        f.write(program)
    if job["uid"] is not None:
        os.chown(scratch, job["uid"], job["uid"])
        os.chown(os.path.join(scratch, "program.py"), job["uid"], job["uid"])
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child(job, python, fds, scratch)
        finally:
            os._exit(126)
    for fd in fds.values():
        os.close(fd)
    status, cpu, timed_out = _wait(pid, job["wall_s"], isolated)
    wall = time.monotonic() - started
    result = {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "wall_s": wall,
        "cpu_s": cpu,
        "wall_timeout": timed_out,
    }
    os.write(status_fd, json.dumps(result).encode())
    os.close(status_fd)


if __name__ == "__main__":
    main(sys.argv[1])
