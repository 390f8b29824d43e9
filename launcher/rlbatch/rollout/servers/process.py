"""A vLLM server process for a run's config: its model directory, its command line, starting it
(own process group, bound to the process that started it), waiting for ``/health``, stopping
it. Used by rlbatch-serve (one server) and by a run with ``rollout.servers.count=N`` (N servers
beside training, on free ports of 127.0.0.1, stopped with the run).

The server is vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``;
the ``vllm`` console script of the CPU build does not start) with: token ids in and out
(``--skip-tokenizer-init --tokens-only``), the sampled token's log-probability at the sampling
temperature (``--logprobs-mode processed_logprobs``, the trainer's convention), the RL endpoints
(``VLLM_SERVER_DEV_MODE=1``: pause / resume / weight updates) and rlbatch's weight-transfer
backend (rlbatch.rollout.servers.transfer; vLLM's own NCCL one for GPU servers with
rollout.servers.transfer=broadcast). Its model directory holds the config.json rlbatch's
model config describes (architecture, dtype, EOS / BOS ids) and, when ``model.hf_path`` is a
local checkpoint, links to its safetensors files; otherwise the server starts from dummy
weights, which the trainer replaces before the first generation.

No orphans: vLLM runs in a process group of its own (its engine core is a child process), and
the process that started it, a small watcher (:func:`main`), kills that whole group when it is
asked to stop, when the server exits, or when the watcher's own parent (the trainer's launcher,
or rlbatch-serve) dies, even by SIGKILL (rlbatch.runtime.lifeline binds the watcher to it). The
watcher itself can die by SIGKILL too (a terminal or a job scheduler kills rlbatch-serve's
whole process group): the first process of the server's group, a guard (:func:`guard`), then
SIGKILLs the group, API server and engine core alike.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.schema import RunConfig

log = logging.getLogger("rlbatch.rollout")

TRANSFER_BACKEND = "rlbatch"
"""rlbatch.rollout.servers.transfer.BACKEND (not imported here: that module imports vLLM)."""
NCCL_BACKEND = "nccl"
"""vLLM's own transfer backend: GPU servers with rollout.servers.transfer=broadcast."""


def transfer_backend(cfg: RunConfig, *, cpu: bool) -> str:
    """The transfer backend a server of ``cfg`` runs: vLLM's NCCL broadcast on GPUs with
    rollout.servers.transfer=broadcast, rlbatch's plugin otherwise (a file, or a gloo
    broadcast on the CPU build)."""
    from rlbatch.config.schema import ServerTransfer

    broadcast = ServerTransfer(cfg.rollout.servers.transfer) == ServerTransfer.broadcast
    return NCCL_BACKEND if broadcast and not cpu else TRANSFER_BACKEND


WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class ServerSpec:
    """What one server is started with."""

    model_dir: Path
    host: str
    port: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def write_server_model_dir(cfg: RunConfig, path: Path) -> bool:
    """config.json / generation_config.json for the run's model in ``path`` (and links to the
    checkpoint's safetensors files when model.hf_path is a local directory that has them);
    True when the server loads real weights from it, False: dummy weights until a sync."""
    from rlbatch.config.vllm_rules import engine_dtype
    from rlbatch.engine.hf_config import GENERATION_CONFIG, HF_CONFIG, hf_config_dict, special_ids
    from rlbatch.engine.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    path.mkdir(parents=True, exist_ok=True)
    ids = special_ids(tokenizer.eos_ids, tokenizer.bos_id)
    config = hf_config_dict(cfg.model, engine_dtype(cfg)) | ids
    (path / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (path / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
    source = Path(cfg.model.hf_path) if cfg.model.hf_path else None
    files = sorted(source.glob("*.safetensors*")) if source and source.is_dir() else []
    for f in files:
        link = path / f.name
        link.unlink(missing_ok=True)
        link.symlink_to(f.resolve())
    _write_tokenizer(tokenizer, path)
    return any(f.suffix == ".safetensors" for f in files)


def _write_tokenizer(tokenizer: Any, path: Path) -> None:
    """The model's tokenizer beside its config (the server itself skips it): links to the
    tokenizer files it was loaded from, or the byte tokenizer's marker, so that a trainer
    reading the served directory (a served distillation teacher) can compare tokenizers."""
    from rlbatch.engine.tokenizer import BYTES_MARKER, ByteTokenizer, tokenizer_files

    if isinstance(tokenizer, ByteTokenizer):
        (path / BYTES_MARKER).write_text(json.dumps({"tokenizer": "bytes"}) + "\n")
        return
    folder = getattr(tokenizer, "path", None)
    if not folder or not Path(folder).is_dir():
        return
    for name in tokenizer_files(folder):
        link = path / name
        link.unlink(missing_ok=True)
        link.symlink_to((Path(folder) / name).resolve())


def server_spec(
    cfg: RunConfig, model_dir: Path, host: str, port: int, device: Optional[str] = None
) -> ServerSpec:
    """The command line and environment of a server for ``cfg`` (model_dir written by
    :func:`write_server_model_dir`)."""
    from rlbatch.config.vllm_rules import cpu_build_installed
    from rlbatch.rollout.engines.vllm_engine import plan_engine

    cpu = cpu_build_installed()
    settings = plan_engine(cfg, cpu=cpu)
    real = any(model_dir.glob("*.safetensors"))
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", host, "--port", str(port),
        "--skip-tokenizer-init", "--tokens-only", "--logprobs-mode", "processed_logprobs",
        "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
        "--max-num-seqs", str(settings.max_num_seqs), "--seed", "0",
        "--load-format", "auto" if real else "dummy",
        "--tensor-parallel-size", str(cfg.rollout.vllm.tensor_parallel_size),
        "--weight-transfer-config", json.dumps({"backend": transfer_backend(cfg, cpu=cpu)}),
        "--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching",
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    if settings.block_size is not None:
        argv += ["--block-size", str(settings.block_size)]
    if settings.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]
    if settings.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if cpu:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return ServerSpec(model_dir, host, port, tuple(argv), tuple(sorted(env.items())))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET {url}/health answers 200."""
    from rlbatch.rollout.servers.client import health

    return health(url, timeout_s) is None


class ServerProcess:
    """A started server: the watcher process (:func:`main`) that owns vLLM's process group."""

    def __init__(self, spec: ServerSpec, log_path: Optional[Path] = None) -> None:
        from rlbatch.runtime.lifeline import child_env

        self.spec = spec
        self.url = spec.url
        self.log_path = log_path
        env = child_env({**os.environ, **dict(spec.env)})
        self.log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed in stop
        # vLLM's output goes to the log file, or to stderr: stdout carries rlbatch-serve's URL
        out = self.log if self.log is not None else sys.stderr
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlbatch.rollout.servers.process", json.dumps(spec.argv)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once /health answers; RuntimeError when the server exits or is not up in
        ``timeout_s`` (it is stopped then)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server for {self.url} exited with code {self.proc.returncode}"
                    " while starting (its output is above, or in its log file)"
                )
            if healthy(self.url):
                return
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"the vLLM server for {self.url} did not answer /health within {timeout_s:g} s"
            " (rollout.servers.start_timeout_s)"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server and every process of its group (the watcher does it on SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s + 10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            self.log = None


def start_servers(cfg: RunConfig, root: Path, count: int) -> list[ServerProcess]:
    """``count`` servers for ``cfg`` on free ports of 127.0.0.1, healthy when this returns
    (their model directory and logs under ``root``); all stopped if one fails to start."""
    model_dir = root / "model"
    write_server_model_dir(cfg, model_dir)
    devices = cfg.rollout.servers.devices
    servers: list[ServerProcess] = []
    try:
        for i in range(count):
            device = devices[i] if devices else None
            spec = server_spec(cfg, model_dir, "127.0.0.1", free_port(), device)
            servers.append(ServerProcess(spec, root / f"server{i}.log"))
        for server in servers:
            server.wait_healthy(cfg.rollout.servers.start_timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


class Restarter:
    """rollout.servers.on_failure=restart, in the process that started the servers: a thread
    that starts a server again, with the same command line at the same URL (its log goes on
    in the same file), when its process exited (vLLM's process group killed, or the server
    crashed) or its /health has failed (answered, but not 200: an engine dead behind a live
    HTTP server) for ``HEALTH_FAILS`` checks in a row; at most ``max_restarts`` times per
    server. ``servers`` is updated in place, so stopping them stops the new processes. The run's
    workers take a restarted server back once it holds their weights
    (rlbatch.rollout.servers.backend)."""

    HEALTH_EVERY_S = 5.0
    HEALTH_FAILS = 3

    def __init__(
        self, servers: list[ServerProcess], max_restarts: int, start_timeout_s: float
    ) -> None:
        self.servers = servers
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.restarts = [0] * len(servers)
        self.fails = [0] * len(servers)
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name="rlbatch-server-restarts", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        """Stop restarting. The servers it started stop with this thread too (their watcher's
        parent-death signal follows the thread that started it): call it only to stop them."""
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        from rlbatch.rollout.servers.client import health

        last_check = time.monotonic()
        while not self.stopping.wait(1.0):
            check = time.monotonic() - last_check >= self.HEALTH_EVERY_S
            if check:
                last_check = time.monotonic()
            for i, server in enumerate(self.servers):
                if server.proc.poll() is None and check:
                    # a busy server may be slow to answer: only a refusal or an error counts
                    bad = health(server.url, self.HEALTH_EVERY_S, slow_ok=True) is not None
                    self.fails[i] = self.fails[i] + 1 if bad else 0
                    if self.fails[i] >= self.HEALTH_FAILS:
                        log.warning("rollout server %s fails /health: stopping it", server.url)
                        server.stop()
                if server.proc.poll() is not None:
                    self._restart(i, server)

    def _restart(self, i: int, server: ServerProcess) -> None:
        if self.restarts[i] >= self.max_restarts:
            return  # the workers stop the run when they find it down once more
        self.restarts[i] += 1
        self.fails[i] = 0
        log.warning(
            "rollout server %s exited (code %s): starting it again, restart %d of"
            " rollout.servers.max_restarts=%d (log: %s)", server.url, server.proc.returncode,
            self.restarts[i], self.max_restarts, server.log_path,
        )  # fmt: skip
        server.stop()  # closes its log
        new = ServerProcess(server.spec, server.log_path)
        self.servers[i] = new
        deadline = time.monotonic() + self.start_timeout_s
        while not self.stopping.is_set() and time.monotonic() < deadline:
            if new.proc.poll() is not None or healthy(new.url):
                break
            time.sleep(1.0)
        if new.proc.poll() is None and healthy(new.url):
            log.warning("rollout server %s is up again", new.url)


def stop_servers(servers: list[ServerProcess]) -> None:
    for server in servers:  # all asked at once, then each waited for
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
    for server in servers:
        server.stop()


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# The watcher: python -m rlbatch.rollout.servers.process '<argv as JSON>'
# ------------------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's group, SIGKILL to what is left after ``grace_s``; returns when
    no process of the group is left (the leader reaped here, the others by their new
    parent)."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # a zombie leader still counts as a member of its group
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                proc.wait()
                return
            time.sleep(0.2)
    proc.wait()


def watch(argv: list[str]) -> int:
    """Run ``argv`` (vLLM's server) in a process group of its own, under a guard
    (:func:`guard`), and kill the group when this process is asked to stop (SIGTERM / SIGINT,
    or its parent died: rlbatch.runtime.lifeline sends SIGTERM) or when the server exits; the
    server's exit code."""
    from rlbatch.runtime.lifeline import _arm_parent_death_signal

    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def child_setup() -> None:
        os.setsid()
        _arm_parent_death_signal(signal.SIGTERM)  # the watcher killed: the guard kills all

    proc = subprocess.Popen(  # noqa: PLW1509 - no threads yet
        [sys.executable, "-m", "rlbatch.rollout.servers.process", GUARD, str(os.getpid()),
         json.dumps(argv)],
        preexec_fn=child_setup,
    )  # fmt: skip
    try:
        while proc.poll() is None and not stopping:
            time.sleep(0.2)
    finally:
        _kill_group(proc)
    return 0 if stopping else proc.returncode


GUARD = "--guard"


def guard(watcher: int, argv: list[str]) -> int:
    """The first process of the server's group: runs ``argv`` (vLLM's API server, which starts
    its engine core in the same group) and outlives it only to report its exit code. A SIGTERM
    while the watcher lives is the watcher stopping the group (vLLM shuts down on its own
    SIGTERM; the watcher kills what is left after a grace period). Once the watcher is gone,
    whatever killed it (SIGKILL of rlbatch-serve's process group, as a terminal or a job
    scheduler sends), the guard SIGKILLs the whole group at once: the API server and the
    engine core, with nobody left to wait for a graceful stop (which, with requests in flight,
    can keep vLLM's HTTP server open on a dead engine)."""
    from rlbatch.runtime.lifeline import _arm_parent_death_signal

    for sig in (signal.SIGTERM, signal.SIGINT):  # wake the loop below (not inherited by vLLM)
        signal.signal(sig, lambda signum, frame: None)
    _arm_parent_death_signal(signal.SIGTERM)
    proc = subprocess.Popen(argv)
    while proc.poll() is None:
        if os.getppid() != watcher:
            os.killpg(0, signal.SIGKILL)
        time.sleep(0.2)
    return proc.returncode


def main() -> None:
    if sys.argv[1] == GUARD:
        sys.exit(guard(int(sys.argv[2]), json.loads(sys.argv[3])))
    from rlbatch.runtime.lifeline import die_with_parent

    if os.environ.get("RLBATCH_PARENT_PID"):
        die_with_parent(signal.SIGTERM)
    sys.exit(watch(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
