"""rollout.servers.on_failure=restart, the parts that need no vLLM: the launcher's restarter
starts a server whose process group was SIGKILLed again, at the same URL with the same command
line, at most rollout.servers.max_restarts times; the worker's pool keeps a server that is down
(or answers with its start-up weights) out until it is taken back, waits for one when none is
left, and stops naming the server and its log once it fails after its last restart. The whole
path with a real vLLM server killed under rlbatch-train runs in tests/e2e/test_vllm_servers.py."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from rlbatch.rollout.servers.client import ServerDownError, ServerError, ServerRestartedError
from rlbatch.rollout.servers.pool import ServerPool
from rlbatch.rollout.servers.process import Restarter, ServerProcess, ServerSpec, free_port, healthy

HEALTH_SERVER = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        sick = os.path.exists(sys.argv[2])  # an engine dead behind a live HTTP server
        self.send_response(500 if sick else 200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _server_pgid(server: ServerProcess) -> int:
    """The process group of the server the watcher runs (its guard leads it)."""
    children = open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()
    return os.getpgid(int(children[0]))


def test_a_killed_server_is_started_again_at_its_url_at_most_max_restarts_times(tmp_path):
    port = free_port()
    spec = ServerSpec(
        tmp_path,
        "127.0.0.1",
        port,
        (sys.executable, "-c", HEALTH_SERVER, str(port), str(tmp_path / "sick")),
        (),
    )
    log_path = tmp_path / "server0.log"
    servers = [ServerProcess(spec, log_path)]
    restarter = Restarter(servers, max_restarts=1, start_timeout_s=30.0)
    try:
        _wait(lambda: healthy(servers[0].url))
        first = servers[0]
        pgid = _wait_pgid(first)
        os.killpg(pgid, signal.SIGKILL)  # the server's whole process group
        _wait(lambda: servers[0] is not first and healthy(servers[0].url))
        assert servers[0].url == first.url and servers[0].spec == spec
        assert servers[0].log_path == log_path and restarter.restarts == [1]
        assert not _group_alive(pgid)
        second = servers[0]
        os.killpg(_wait_pgid(second), signal.SIGKILL)  # past max_restarts: left down
        _wait(lambda: second.proc.poll() is not None)
        time.sleep(2.5)
        assert servers[0] is second and restarter.restarts == [1]
        assert not healthy(second.url)
    finally:
        restarter.close()
        for server in servers:
            server.stop()


def test_a_server_whose_health_fails_behind_a_live_process_is_stopped_and_started_again(
    tmp_path, monkeypatch
):
    """/health answering 500 (vLLM's engine core died, its HTTP server lives on) three checks in
    a row: the server's group is stopped and a new one started at the same URL."""
    monkeypatch.setattr(Restarter, "HEALTH_EVERY_S", 0.5)
    port, sick = free_port(), tmp_path / "sick"
    argv = (sys.executable, "-c", HEALTH_SERVER, str(port), str(sick))
    servers = [ServerProcess(ServerSpec(tmp_path, "127.0.0.1", port, argv, ()), None)]
    restarter = Restarter(servers, max_restarts=1, start_timeout_s=30.0)
    try:
        _wait(lambda: healthy(servers[0].url))
        first = servers[0]
        sick.touch()
        _wait(lambda: first.proc.poll() is not None)  # stopped
        sick.unlink()
        _wait(lambda: servers[0] is not first and healthy(servers[0].url))
        assert restarter.restarts == [1] and servers[0].url == first.url
    finally:
        restarter.close()
        for server in servers:
            server.stop()


def _wait_pgid(server: ServerProcess) -> int:
    found: list[int] = []

    def ready() -> bool:
        try:
            found[:] = [_server_pgid(server)]
        except (OSError, IndexError):
            return False
        return True

    _wait(ready)
    return found[0]


A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _pool(max_restarts=1) -> ServerPool:
    return ServerPool(
        [A, B], timeout_s=1.0, concurrency=1, nonce="n", keep_going=False,
        max_restarts=max_restarts, logs={A: "/runs/x/servers/server0.log"},
    )  # fmt: skip


def test_a_server_that_is_down_or_restarted_waits_out_of_the_pool_until_taken_back():
    pool = _pool()
    pool.drop(A, ServerDownError(f"rollout server {A}: connection refused"))
    pool.drop(B, ServerRestartedError(f"rollout server {B} sampled with its start-up weights"))
    assert pool.urls == [] and set(pool.down) == {A, B}
    back: list[str] = []

    def rejoin() -> None:  # what the backend does once a server holds the run's weights
        back.append(B)
        pool.readmit(B)

    pool.rejoin = rejoin
    assert pool.least_loaded() == B and back == [B]  # waited for one to come back
    assert pool.urls == [B] and set(pool.down) == {A}
    assert pool.take_rejoined() == 1 and pool.take_rejoined() == 0
    pool.readmit(A)
    assert pool.urls == [B, A] and pool.restarted == {A: 1, B: 1}


def test_when_no_server_comes_back_every_waiting_row_fails_with_the_first_wait():
    pool = _pool()
    pool.drop(A, ServerDownError("refused"))
    pool.drop(B, ServerDownError("refused"))
    waits: list[int] = []

    def rejoin() -> None:
        waits.append(1)
        raise ServerError("no rollout server is left and none came back")

    pool.rejoin = rejoin
    for _ in range(3):
        with pytest.raises(ServerError, match="none came back"):
            pool.least_loaded()
    assert waits == [1]


def test_a_server_failing_after_its_last_restart_stops_the_run_naming_it_and_its_log():
    pool = _pool(max_restarts=1)
    pool.drop(A, ServerDownError("refused"))
    pool.readmit(A)
    with pytest.raises(ServerError, match=r"failed again after 1 restart\(s\)") as err:
        pool.drop(A, ServerDownError("refused"))
    assert "rollout.servers.max_restarts=1" in str(err.value)
    assert "/runs/x/servers/server0.log" in str(err.value)


def test_a_wrong_answer_stops_the_run_under_restart_and_a_restarted_server_under_stop():
    pool = _pool()
    with pytest.raises(ServerError, match="other weights"):
        pool.drop(A, ServerError(f"rollout server {A} holds other weights"))
    stop = ServerPool([A], timeout_s=1.0, concurrency=1, nonce="n", keep_going=False)
    with pytest.raises(ServerRestartedError):
        stop.drop(A, ServerRestartedError("start-up weights"))
