"""First process of a code sandbox (PID 1 of its own PID, mount, network, IPC and UTS
namespaces); standard library only, run as ``python -I -S sandbox_init.py MOUNT_POINT``.

It reads the job (JSON) from its standard input and answers with one JSON report on its
standard output: the program never holds either pipe, and the report carries the host's
per-execution token. Steps:

1. joins the execution's memory cgroup when the host made one (the program's processes only);
2. builds the empty root (:mod:`sandbox_root`): a tmpfs with the interpreter and its standard
   library read-only, /dev/null, /dev/zero, /dev/urandom, a private /proc, the scratch tmpfs,
   nothing else, then ``pivot_root``;
3. forks the program with no capabilities (a fresh uid as root; capability-less uid 0 of the
   user namespace otherwise), no new privileges, rlimits, an isolated interpreter;
   for ``test_code`` it also forks the asserts' process (:mod:`sandbox_asserts`), which talks
   to the program (:mod:`sandbox_harness`) over two pipes and alone holds the pipe that carries the verdict;
4. waits until the program ends (the asserts' verdict for ``test_code``), or until the wall
   limit, counted on the time its processes ran or slept but not the time they waited for a
   CPU or were all blocked on the disk (a busy machine does not make a correct program time
   out), or the hard ceiling;
5. kills every process left in the namespace (daemons, threads, the program itself), reads
   the program's stdout/stderr (memory files, never on the scratch tmpfs) and reports.
"""

import json
import math
import os
import resource
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sandbox_asserts  # noqa: E402
import sandbox_codec  # noqa: E402
import sandbox_harness  # noqa: E402
import sandbox_root  # noqa: E402

HARNESS = "/.rlbatch/harness.py"
CODEC = "/.rlbatch/sandbox_codec.py"
_RESET = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ)


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


def _program(job, ctx):
    """The program's process (never returns): capability-less, limited, isolated interpreter."""
    if ctx["cgroup_fd"] is not None:
        os.write(ctx["cgroup_fd"], b"0")
    keep = [ctx["stdin"], ctx["stdout"], ctx["stderr"]]
    for target, fd in enumerate(keep):
        os.dup2(fd, target)
    argv = [ctx["python"], "-I", "-S", "-B", ctx["harness"], "--script", "program.py"]
    if ctx["rpc"] is not None:  # requests in on 3, answers out on 4
        requests, answers = ctx["rpc"]
        os.dup2(answers, 1000)  # out of the way of the two targets
        os.dup2(requests, 3)
        os.dup2(1000, 4)
        argv = [ctx["python"], "-I", "-S", "-B", ctx["harness"], "program.py"]
    os.closerange(5 if ctx["rpc"] is not None else 3, 65536)
    os.chdir(ctx["scratch"])
    os.setsid()
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)
    if ctx["isolated"]:
        sandbox_root.drop_privileges(job["uid"], ctx["last_cap"])
    for which, value in _limits(job):
        resource.setrlimit(which, value)
    env = {"PATH": "/usr/bin:/bin", "HOME": ctx["scratch"], "LANG": "C.UTF-8"}
    env["PYTHONHASHSEED"] = "0"
    os.execve(ctx["python"], argv, env)


def _asserts(job, ctx, fds, verdict_w):
    """The asserts' process (a fork of this one: nothing the program wrote is executed)."""
    null = os.open("/dev/null", os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    keep = sorted((*fds, verdict_w))
    for low, high in zip([2, *keep], [*keep, 65536], strict=True):
        os.closerange(low + 1, high)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a closed pipe is an error, not death
    if ctx["isolated"]:
        sandbox_root.drop_privileges(job["asserts_uid"], ctx["last_cap"])
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (4 * job["memory_mb"] * mb,) * 2)
    channel = sandbox_harness.Channel(*fds)
    verdict = sandbox_asserts.run_asserts(channel, job["test_code"], job["token"])
    os.write(verdict_w, json.dumps(verdict).encode())


def _spawn(job, ctx):
    """Fork the program (and the asserts' process): {role: pid}, the verdict pipe's read end."""
    pids = {}
    verdict_r = None
    if job["test_code"] is not None:
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        ctx["rpc"] = (requests_r, answers_w)
        verdict_r, verdict_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _program(job, ctx)
        finally:
            os._exit(126)
    pids["program"] = pid
    if verdict_r is not None:
        os.close(requests_r)
        os.close(answers_w)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(verdict_r)
                _asserts(job, ctx, (answers_r, requests_w), verdict_w)
            finally:
                os._exit(0)
        pids["asserts"] = pid
        for fd in (answers_r, requests_w, verdict_w):
            os.close(fd)
    return pids, verdict_r


def _schedstat_ns(pid):
    """(nanoseconds ``pid`` ran on a CPU, nanoseconds it spent runnable but waiting for one),
    or None once it is gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def _blocked_on_disk(pids):
    """Whether every one of ``pids`` still alive sleeps uninterruptibly (state D: a page of the
    interpreter or its standard library being read from a disk that others keep busy)."""
    states = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(state == "D" for state in states)


def ran_s(elapsed, waited, used, cpus, stalled=0.0):
    """The seconds the wall limit counts: ``elapsed`` less the machine's load (the longest any
    process of the execution waited for a CPU, ``waited`` in ns per process, and ``stalled``,
    the seconds all of them were blocked on the disk), but never less than the CPU the
    execution used itself (``used``, ns per process) over the ``cpus`` it may use: else a
    program keeps one process waiting behind its other, busy ones and stretches its own limit
    to the hard ceiling."""
    busy = sum(used.values()) / 1e9 / cpus
    return max(elapsed - max(waited.values(), default=0) / 1e9 - stalled, busy)


def _watched(job, pids, done):
    """The execution's processes: every one of the PID namespace but this one, or (without
    namespaces) the program and the asserts' process."""
    if job["isolation"] == "none":
        return [pid for role, pid in pids.items() if role not in done]
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1"]


def _wait(job, pids):
    """Wait for the execution's end. Returns ({role: (wait status, rusage)}, wall_timeout)."""
    started = time.monotonic()
    fds = {os.pidfd_open(pid): role for role, pid in pids.items()}
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    done, waited, used = {}, {}, {}
    stalled, polled = 0.0, started
    cpus = max(1, len(os.sched_getaffinity(0)))
    last = "asserts" if "asserts" in pids else "program"
    while last not in done:
        events = poller.poll(20)
        for fd, _ in events:
            role = fds[fd]
            _, status, usage = os.wait4(pids[role], 0)
            done[role] = (status, usage, time.monotonic() - started)
            poller.unregister(fd)
            os.close(fd)
        watched = _watched(job, pids, done)
        for pid in watched:
            value = _schedstat_ns(pid)
            if value is not None:
                used[pid] = max(value[0], used.get(pid, 0))
                waited[pid] = max(value[1], waited.get(pid, 0))
        now = time.monotonic()
        if _blocked_on_disk(watched):
            stalled += now - polled
        polled, elapsed = now, now - started
        ran = ran_s(elapsed, waited, used, cpus, stalled)
        if last not in done and (ran > job["wall_s"] or elapsed > job["ceiling_s"]):
            return done, True, fds
    return done, False, fds


def _kill_all(isolated, pids, done):
    if isolated:  # PID 1 of the namespace: every other process in it
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:  # no namespace: the program's session and the asserts' process
        for role, pid in pids.items():
            if role not in done:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return
        for role, known in pids.items():
            if pid == known and role not in done:
                done[role] = (status, usage, None)


def _read(fd, limit, tail=False):
    size = os.fstat(fd).st_size
    start = max(0, size - limit) if tail else 0
    return os.pread(fd, limit, start).decode("utf-8", errors="replace")


def _oom_kills(fd):
    if fd is None:
        return 0
    for line in os.pread(fd, 4096, 0).decode().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def _verdict(verdict_r, token):
    if verdict_r is None:
        return None
    data = b""
    while True:
        chunk = os.read(verdict_r, 65536)
        if not chunk or len(data) > 1 << 20:
            break
        data += chunk
    try:
        verdict = json.loads(data)
    except ValueError:
        return None
    return verdict if type(verdict) is dict and verdict.get("token") == token else None


def _setup(job, mount_point):
    isolated = job["isolation"] != "none"
    cgroup = job.get("cgroup") or {}
    ctx = {"isolated": isolated, "rpc": None, "last_cap": sandbox_root.last_cap()}
    ctx["cgroup_fd"] = os.open(cgroup["procs"], os.O_WRONLY) if cgroup else None
    ctx["oom_fd"] = os.open(cgroup["events"], os.O_RDONLY) if cgroup else None
    harness_source = open(sandbox_harness.__file__).read()
    codec_source = open(sandbox_codec.__file__).read()
    if isolated:  # only ever inside the mount namespace: never on the host's root
        if os.getpid() != 1:
            raise SystemExit("sandbox_init: not PID 1 of a new PID namespace; refusing to mount")
        files = {HARNESS: harness_source, CODEC: codec_source}
        ctx["scratch"] = sandbox_root.build_root(mount_point, job["plan"], job["scratch_mb"], files)
        ctx["harness"] = HARNESS
    else:
        ctx["scratch"] = os.path.join(mount_point, "scratch")
        ctx["harness"] = sandbox_harness.__file__
    ctx["python"] = job["python"]
    os.mkdir(ctx["scratch"], 0o700)
    with open(os.path.join(ctx["scratch"], "program.py"), "w") as f:
        f.write(job["program"])
    if isolated and job["uid"] is not None:
        os.chown(ctx["scratch"], job["uid"], job["uid"])
        os.chown(os.path.join(ctx["scratch"], "program.py"), job["uid"], job["uid"])
    for name in ("stdin", "stdout", "stderr"):
        ctx[name] = os.memfd_create(name, 0)
    os.write(ctx["stdin"], job["stdin"].encode())
    os.lseek(ctx["stdin"], 0, os.SEEK_SET)
    return ctx


def main(mount_point):
    job = json.loads(sys.stdin.buffer.read())
    for sig in _RESET:  # as PID 1, a signal with its default action never reaches this process
        signal.signal(sig, signal.SIG_DFL)
    ctx = _setup(job, mount_point)
    started = time.monotonic()
    pids, verdict_r = _spawn(job, ctx)
    done, timed_out, _ = _wait(job, pids)
    _kill_all(ctx["isolated"], pids, done)
    status, usage, _ = done["program"]
    report = {
        "token": job["token"],
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": time.monotonic() - started,
        "wall_timeout": timed_out,
        "oom_kills": _oom_kills(ctx["oom_fd"]),
        "output_full": max(os.fstat(ctx[n]).st_size for n in ("stdout", "stderr"))
        >= job["file_size_mb"] << 20,
        "stdout": _read(ctx["stdout"], job["max_output_bytes"]),
        "stderr": _read(ctx["stderr"], 2000, tail=True),
        "verdict": _verdict(verdict_r, job["token"]),
    }
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
