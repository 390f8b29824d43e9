"""A weight sync to the rollout servers, driven by the trainer's global rank 0 over vLLM's RL
lifecycle, in the way ``rollout.servers.transfer`` names.

- ``file``: the Hugging Face-named tensors go to one safetensors file (``transfer_dir``,
  /dev/shm by default: shared memory), then every server at once: pause (waiting for requests
  in flight), init (nothing to set up), start_weight_update, update_weights (the server reads
  the file), finish_weight_update with the sync's label, reset_prefix_cache, resume. The file
  is removed once every server has read it; files that killed trainers left behind are swept
  at the next sync on the machine (:func:`sweep_weight_files`).
- ``broadcast``: the trainer's first rank and every server's workers form one process group
  (the trainer is rank 0 and hosts the rendezvous; each server's workers follow at their
  ``rank_offset``): NCCL when the trainer is on a GPU (servers run vLLM's own ``nccl``
  backend), gloo on CPU (rlbatch's plugin). A sync pauses every server, starts the update on
  each, then asks every server to receive (update_weights, one request per server, in flight
  together) while rank 0 broadcasts each tensor once to all of them, then finishes, resets the
  prefix cache and resumes each. The group is formed at the first sync and formed again
  whenever the pool changes (a server left it under rollout.servers.on_failure=continue). A
  server that fails before the first tensor is sent or after the last one arrived is that
  server's failure (on_failure); the group not forming, or a broadcast that breaks in the
  middle (every member of the group fails with it), stops the run in either mode, naming the
  server.

Either way, each server is first asked whose update it holds (rlbatch.rollout.servers.claim):
once paused, it is labelled with this process as the update's owner until the sync's own label
replaces it at finish; an update that this run or a run that is gone left open is ended
before this one starts, and another live run's stops the run naming it. An update the server
finds incomplete (a layer received fewer elements than it holds) fails at finish, naming the
layers, and the server keeps the owner's label: its weights are not the sync's.

``debug.fail_sync`` (tests only) kills the trainer right after a phase of the sync (pause,
start, update: mid-broadcast with the broadcast transfer, finish, resume).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import re
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from rlbatch.config.schema import RunConfig, ServerTransfer, SyncFault
from rlbatch.rollout.servers.claim import (
    ACTIVE_MARK,
    Verdict,
    parse_owner,
    this_process,
    verdict_of,
)
from rlbatch.rollout.servers.client import ServerError, call
from rlbatch.rollout.servers.process import NCCL_BACKEND, TRANSFER_BACKEND, free_port
from rlbatch.runtime.lock import pid_alive

LOOPBACK = ("127.0.0.1", "localhost", "::1")

log = logging.getLogger("rlbatch.rollout")


class ServerPool(Protocol):
    """What a sync needs of a process's connection to the servers
    (rlbatch.rollout.servers.backend's pool)."""

    urls: list[str]
    nonce: str
    timeout_s: float
    group: Any
    """The broadcast group, or None."""

    def drop(self, url: str, error: ServerError) -> None:
        """Leave ``url`` out of the pool (on_failure=continue) or raise ``error``."""


def push(
    servers: ServerPool, cfg: RunConfig, tensors: dict[str, Any], label: str, drop: bool
) -> None:
    """Every server of the pool takes ``tensors`` under ``label`` (``drop``: and drops its
    prefix cache); a server that is down leaves the pool or stops the run (on_failure)."""
    if ServerTransfer(cfg.rollout.servers.transfer) == ServerTransfer.broadcast:
        _push_broadcast(servers, cfg, tensors, label, drop)
    else:
        _push_file(servers, cfg, tensors, label, drop)


def _fault(cfg: RunConfig, phase: SyncFault) -> None:
    """debug.fail_sync: SIGKILL this process right after ``phase`` of the sync made for step
    debug.fail_at_step."""
    from rlbatch.runtime import progress

    d = cfg.debug
    if d.fail_sync is None or SyncFault(d.fail_sync) != phase:
        return
    if progress.current.step == d.fail_at_step:
        os.kill(os.getpid(), signal.SIGKILL)


def _claim(servers: ServerPool, url: str) -> bool:
    """Whose update ``url`` holds (its weight label): True when it is one to take over (this
    run's own, or of a run that is gone); a ServerError naming the owner when it belongs to
    another live run."""
    info = call(url, "/weight_info", timeout_s=servers.timeout_s, get=True)
    owner = parse_owner((info or {}).get("weight_version"))
    verdict = verdict_of(owner, servers.nonce, servers.timeout_s)
    if owner is not None and verdict == Verdict.refuse:
        raise ServerError(
            f"rollout server {url} holds a weight update of another live run"
            f" ({owner.describe()}): two runs cannot update one server; give each run servers"
            " of its own (rollout.servers.urls), or wait until that run ends"
        )
    if owner is not None:
        log.warning(
            "rollout server %s holds an unfinished or failed weight update of %s: taking it"
            " over (the whole weights are pushed and probed)", url, owner.describe(),
        )  # fmt: skip
    return verdict == Verdict.recover


def _own(servers: ServerPool, url: str) -> None:
    """Label the paused server with this process as its update's owner."""
    label = this_process(servers.nonce).label()
    call(url, "/update_weight_version", {"new_version": label}, timeout_s=servers.timeout_s)


def _start(url: str, taken_over: bool, timeout_s: float) -> None:
    """start_weight_update; an update left open by the owner this run takes over is ended
    first (closed without its weights), one nobody claims is refused naming the server."""
    try:
        call(url, "/start_weight_update", timeout_s=timeout_s)
        return
    except ServerError as err:
        if ACTIVE_MARK not in str(err):
            raise
        if not taken_over:
            raise ServerError(
                f"rollout server {url} is in the middle of a weight update that no rlbatch run"
                " claims (another client started it): restart the server with rlbatch-serve,"
                " or give this run servers of its own"
            ) from err
    abandon = {"update_info": {"abandon": True}}
    call(url, "/update_weights", abandon, timeout_s=timeout_s)
    call(url, "/finish_weight_update", timeout_s=timeout_s)  # no label: the owner's stays
    call(url, "/start_weight_update", timeout_s=timeout_s)


def _pause(drop: bool) -> str:
    # vLLM's pause drops the prefix cache unless told otherwise (clear_cache)
    return "/pause?mode=wait" + ("" if drop else "&clear_cache=false")


def _finish(url: str, label: str, drop: bool, timeout_s: float) -> None:
    call(url, "/finish_weight_update", {"weight_version": label}, timeout_s=timeout_s)
    if drop:
        call(url, "/reset_prefix_cache", timeout_s=timeout_s)


def _push_file(
    servers: ServerPool, cfg: RunConfig, tensors: dict[str, Any], label: str, drop: bool
) -> None:
    """Write the weights file, then every server of the pool takes it, all at once (each its
    own pause ... resume); the file is removed once they all have (and so are the files of
    this machine's trainers that died before they could remove theirs)."""
    from safetensors.torch import save_file

    folder = transfer_folder(cfg)
    sweep_weight_files(folder)
    path = folder / weight_file_name(os.getpid(), servers.nonce)
    with _held(path):
        save_file(tensors, str(path))
        urls = list(servers.urls)
        with ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="rlbatch-push") as ex:
            pushes = [
                ex.submit(_push_file_to, servers, cfg, url, path, label, drop) for url in urls
            ]
        for pushed in pushes:  # every server has finished: the first failure, in pool order
            pushed.result()


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """``path``'s lock file (:func:`lock_path`) locked while the block runs (before the
    weights file exists, until after it is gone); both removed at the end. The lock, not the
    pid in the name, tells a sweep that the file is in use: a trainer in another PID namespace
    (a container sharing /dev/shm and the host name, as --ipc=host --network=host do) has a pid
    this one cannot see."""
    lock = lock_path(path)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


def lock_path(path: Path) -> Path:
    """The lock file of a weights file: its name with ``.lock`` added."""
    return path.with_name(path.name + ".lock")


def _in_use(path: Path) -> bool:
    """Whether a live process holds the lock of weights file ``path`` (any PID namespace)."""
    try:
        fd = os.open(lock_path(path), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _push_file_to(
    servers: ServerPool, cfg: RunConfig, url: str, path: Path, label: str, drop: bool
) -> None:
    t = servers.timeout_s
    try:
        taken_over = _claim(servers, url)
        call(url, _pause(drop), timeout_s=t)
        _fault(cfg, SyncFault.pause)
        try:
            _own(servers, url)
            call(url, "/init_weight_transfer_engine", {"init_info": {}}, timeout_s=t)
            _start(url, taken_over, t)
            _fault(cfg, SyncFault.start)
            call(url, "/update_weights", {"update_info": {"path": str(path)}}, timeout_s=t)
            _fault(cfg, SyncFault.update)
            _finish(url, label, drop, t)
            _fault(cfg, SyncFault.finish)
        finally:
            call(url, "/resume", timeout_s=t)
        _fault(cfg, SyncFault.resume)
    except ServerError as err:
        servers.drop(url, err)


def transfer_folder(cfg: RunConfig) -> Path:
    """Where the file transfer writes: rollout.servers.transfer_dir, else /dev/shm."""
    d = cfg.rollout.servers.transfer_dir
    return Path(d or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()))


WEIGHT_FILE = re.compile(r"rlbatch-weights-(?P<pid>\d+)-(?P<nonce>\w+)-(?P<host>.+)\.safetensors")
"""The name of a file-transfer weights file: the trainer's pid, the run's nonce, its machine."""


def weight_file_name(pid: int, nonce: str) -> str:
    return f"rlbatch-weights-{pid}-{nonce}-{socket.gethostname()}.safetensors"


def sweep_weight_files(folder: Path) -> list[Path]:
    """Remove the weights files in ``folder`` that trainers of this machine left when they were
    killed in the middle of a sync (a whole model each, in shared memory by default): those of
    processes that no longer run. Files of other machines (a shared transfer_dir) are left
    alone, and so are files whose lock a live process holds (:func:`_held`; its pid may be
    one of another PID namespace). The files removed (lock files of dead trainers too)."""
    host = socket.gethostname()
    removed = []
    for path in folder.glob("rlbatch-weights-*.safetensors*"):
        weights = path.with_name(path.name.removesuffix(".lock"))
        m = WEIGHT_FILE.fullmatch(weights.name)
        if m is None or m["host"] != host or pid_alive(int(m["pid"])) or _in_use(weights):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _push_broadcast(
    servers: ServerPool, cfg: RunConfig, tensors: dict[str, Any], label: str, drop: bool
) -> None:
    """Pause, (re)form the group, start, broadcast, finish, resume. A server that fails before
    the first tensor is sent (pause, start) or after the last one arrived (finish) is one
    server's failure (on_failure: dropped, and the group formed again without it, or the run
    stops); forming the group or the broadcast itself failing stops the run."""
    t = servers.timeout_s
    paused, started, taken_over = [], set(), set()
    try:
        for url in list(servers.urls):
            try:
                if _claim(servers, url):
                    taken_over.add(url)
                call(url, _pause(drop), timeout_s=t)
                paused.append(url)
                _own(servers, url)
            except ServerError as err:
                servers.drop(url, err)
        _fault(cfg, SyncFault.pause)
        while True:
            urls = list(servers.urls)
            if servers.group is None or servers.group.urls != urls:
                close_group(servers)
                servers.group = _group_step(servers, partial(BroadcastGroup.join, urls, cfg, t))
            for url in urls:
                if url not in started:
                    try:
                        _start(url, url in taken_over, t)
                        started.add(url)
                    except ServerError as err:
                        servers.drop(url, err)
            if servers.urls == urls:
                break
        _fault(cfg, SyncFault.start)
        sent_one = partial(_fault, cfg, SyncFault.update)  # mid-broadcast
        _group_step(servers, partial(servers.group.send, tensors, sent_one))
        for url in urls:
            try:
                _finish(url, label, drop, t)
            except ServerError as err:  # the next sync forms the group without it
                servers.drop(url, err)
        _fault(cfg, SyncFault.finish)
    finally:
        for url in paused:  # one that is down now is found by its next request
            with contextlib.suppress(ServerError):
                call(url, "/resume", timeout_s=t)
    _fault(cfg, SyncFault.resume)


def _group_step(servers: ServerPool, step: Callable[[], Any]) -> Any:
    """Forming the group or broadcasting over it: a failure stops the run in either on_failure
    mode (not a ServerDownError: the group's other servers cannot go on without the one that
    failed, and whatever they received of this sync is incomplete)."""
    try:
        return step()
    except ServerError as err:
        close_group(servers)
        raise ServerError(
            f"the weight broadcast to the rollout servers failed"
            f" (rollout.servers.transfer=broadcast): {err}"
        ) from err


def close_group(servers: ServerPool) -> None:
    if servers.group is not None:
        servers.group.close()
        servers.group = None


def transfer_host(cfg: RunConfig, urls: list[str]) -> str:
    """Where the servers reach the trainer's first rank (rollout.servers.transfer_host)."""
    host = cfg.rollout.servers.transfer_host
    if host:
        return str(host)
    if all(urlsplit(u).hostname in LOOPBACK for u in urls):
        return "127.0.0.1"
    return socket.getfqdn()


def server_transfer(url: str, timeout_s: float) -> tuple[str, int]:
    """A server's weight-transfer backend and its number of workers (GET /server_info)."""
    info = call(url, "/server_info?config_format=json", timeout_s=timeout_s, get=True)
    config = info["vllm_config"]
    backend = str((config.get("weight_transfer_config") or {}).get("backend"))
    p = config["parallel_config"]
    return backend, int(p["world_size"]) * int(p.get("data_parallel_size", 1))


def expected_backend(cuda: bool) -> str:
    """The servers' backend a broadcast from this trainer needs: vLLM's NCCL one from a GPU,
    rlbatch's gloo plugin from the CPU."""
    return NCCL_BACKEND if cuda else TRANSFER_BACKEND


class BroadcastGroup:
    """The trainer's end (rank 0) of one process group with every server's workers."""

    def __init__(
        self, urls: list[str], comm: Any, store: Any, timeout_s: float, *, nccl: bool
    ) -> None:
        self.urls = list(urls)
        self.comm = comm
        self.store = store  # gloo: the rendezvous store the group's connections came from
        self.nccl = nccl
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="rlbatch-sync")

    @classmethod
    def join(cls, urls: list[str], cfg: RunConfig, timeout_s: float) -> BroadcastGroup:
        """Form the group: every server joins at its rank offset while rank 0 opens its end
        (both block until the whole group has met)."""
        import torch

        cuda = torch.cuda.is_available()
        want = expected_backend(cuda)
        sizes = []
        for url in urls:
            backend, workers = server_transfer(url, timeout_s)
            if backend != want:
                raise ServerError(
                    f"rollout server {url} runs the {backend!r} weight-transfer backend, but a"
                    f" broadcast from this {'GPU' if cuda else 'CPU'} trainer needs {want!r}:"
                    " start the servers with rlbatch-serve and the run's config"
                    " (rollout.servers.transfer=broadcast), or set rollout.servers.transfer=file"
                )
            sizes.append(workers)
        host = transfer_host(cfg, urls)
        port = free_port("")  # every interface: the servers may be on other machines
        world = 1 + sum(sizes)
        opened: Future = Future()

        def open_end() -> None:  # a thread of its own: it blocks until every server joined
            try:
                opened.set_result(_open(host, port, world, timeout_s, cuda))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                opened.set_exception(err)

        threading.Thread(target=open_end, name="rlbatch-sync-rendezvous", daemon=True).start()
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        ex = ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="rlbatch-sync-join")
        try:
            joins = {
                url: ex.submit(
                    call,
                    url,
                    "/init_weight_transfer_engine",
                    {
                        "init_info": {
                            "master_address": host,
                            "master_port": port,
                            "rank_offset": offset,
                            "world_size": world,
                            **({} if cuda else {"timeout_s": timeout_s}),
                        }
                    },
                    # the server gives up on the rendezvous after timeout_s and says why
                    timeout_s=2 * timeout_s,
                )  # fmt: skip
                for url, offset in zip(urls, offsets, strict=True)
            }
            # a server that refuses is reported at once, not after the others' timeout
            wait(joins.values(), return_when=FIRST_EXCEPTION)
            for url, joined in joins.items():
                err = joined.exception() if joined.done() else None
                if err is not None:
                    raise ServerError(
                        f"rollout server {url} did not join the weight broadcast group at"
                        f" {host}:{port}: {err}; can it reach {host}"
                        " (rollout.servers.transfer_host: an address of this machine that every"
                        " server can reach)?"
                    ) from err
        finally:
            ex.shutdown(wait=False)
        try:
            comm, store = opened.result(timeout=timeout_s)
        except Exception as err:
            raise ServerError(
                f"the weight broadcast group at {host}:{port} did not form within"
                f" {timeout_s:g} s (rollout.servers.timeout_s): {err}; can the servers"
                f" {', '.join(urls)} reach {host} (rollout.servers.transfer_host)?"
            ) from err
        return cls(urls, comm, store, timeout_s, nccl=cuda)

    def send(self, tensors: dict[str, Any], sent_one: Callable[[], None] = lambda: None) -> None:
        """Every server receives ``tensors`` (its update_weights request) while rank 0
        broadcasts them, one by one, in the order the request lists them (``sent_one`` is
        called once the first one went out)."""
        update = {
            "names": list(tensors),
            "dtype_names": [str(v.dtype).removeprefix("torch.") for v in tensors.values()],
            "shapes": [list(v.shape) for v in tensors.values()],
        }
        receives = {
            url: self.pool.submit(
                call, url, "/update_weights", {"update_info": update}, timeout_s=self.timeout_s
            )
            for url in self.urls
        }
        start = time.monotonic()
        try:
            for i, tensor in enumerate(tensors.values()):
                self._fail_fast(receives)
                self._broadcast(tensor)
                if i == 0:
                    sent_one()
            if self.nccl:
                import torch

                torch.cuda.current_stream().synchronize()
        except ServerError:
            raise
        except Exception as err:
            self._fail_fast(receives)
            raise ServerError(
                f"broadcasting the weights failed after {time.monotonic() - start:.1f} s: {err}"
            ) from err
        for url, received in receives.items():
            try:
                received.result()
            except ServerError:
                raise
            except Exception as err:  # noqa: BLE001 - named with the server
                raise ServerError(f"rollout server {url}: update_weights failed: {err}") from err

    @staticmethod
    def _fail_fast(receives: dict[str, Future]) -> None:
        """A server whose update_weights failed already: its error, rather than a broadcast
        that waits for it until the timeout."""
        for received in receives.values():
            if received.done() and received.exception() is not None:
                received.result()

    def _broadcast(self, tensor: Any) -> None:
        if self.nccl:
            import torch

            send = tensor if tensor.is_contiguous() else tensor.contiguous()
            self.comm.broadcast(send, src=0, stream=torch.cuda.current_stream())
            return
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.comm.broadcast([tensor.contiguous()], opts).wait()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        destroy = getattr(self.comm, "destroy", None)
        if self.nccl and destroy is not None:
            destroy()
        self.comm = self.store = None


def _open(host: str, port: int, world: int, timeout_s: float, cuda: bool) -> tuple[Any, Any]:
    """Rank 0's end of the group: (communicator, store); the store is None for NCCL (vLLM's
    stateless group holds its own)."""
    if cuda:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        info = {"master_address": host, "master_port": port, "world_size": world}
        return trainer_init(info, rank=0), None
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world, is_master=True, timeout=timeout, wait_for_workers=False
    )
    return dist.ProcessGroupGloo(store, 0, world, timeout), store
