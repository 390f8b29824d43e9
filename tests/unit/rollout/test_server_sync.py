"""rollout.servers.transfer=broadcast: which failure of a sync is one server's and which stops
the run, whatever on_failure says. A server that fails before the first tensor is sent
(pause, start_weight_update) or after the last one arrived (finish_weight_update) leaves the
pool under on_failure=continue, and the group is formed again without it; forming the group
or the broadcast itself failing stops the run. The servers here answer from a script (a
failure at a chosen step of the lifecycle cannot be timed with a real server's kill); the
lifecycle with real servers, a dp 2 trainer and a server killed while decoding runs in
tests/e2e/test_vllm_servers.py."""

from __future__ import annotations

import pytest

from rlbatch.config.schema import RunConfig, ServerTransfer
from rlbatch.rollout.servers import sync as server_sync
from rlbatch.rollout.servers.backend import ServerDownError, ServerError
from rlbatch.rollout.servers.pool import ServerPool

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


class _Group:
    """The trainer's end of a group: the servers it was formed with and what it sent."""

    formed: list[list[str]] = []

    def __init__(self, urls: list[str], fail_send: bool) -> None:
        self.urls, self.fail_send, self.sent, self.closed = list(urls), fail_send, [], False

    def send(self, tensors: dict, sent_one=lambda: None) -> None:
        if self.fail_send:
            raise ServerDownError(f"rollout server {B}: update_weights failed: reset by peer")
        self.sent.append(list(tensors))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def servers(monkeypatch):
    """Two servers under on_failure=continue; ``fail`` maps (url, endpoint) to the error its
    call raises; ``calls`` records every call made."""
    pool = ServerPool([A, B], timeout_s=1.0, concurrency=1, nonce="n", keep_going=True)
    pool.fail, pool.calls, pool.fail_send = {}, [], False
    _Group.formed = []

    def call(url, path, body=None, *, timeout_s, get=False):
        pool.calls.append((url, path.split("?")[0]))
        if (url, path.split("?")[0]) in pool.fail:
            raise pool.fail[(url, path.split("?")[0])]

    def join(urls, cfg, timeout_s):
        _Group.formed.append(list(urls))
        return _Group(urls, pool.fail_send)

    monkeypatch.setattr(server_sync, "call", call)
    monkeypatch.setattr(server_sync.BroadcastGroup, "join", staticmethod(join))
    return pool


def _push(servers) -> None:
    cfg = RunConfig()
    cfg.rollout.servers.transfer = ServerTransfer.broadcast
    server_sync.push(servers, cfg, {"w": object()}, "n-1", drop=True)


def _down(url: str) -> ServerDownError:
    return ServerDownError(f"rollout server {url} did not answer")


def test_a_sync_forms_the_group_once_and_every_server_takes_the_label(servers):
    _push(servers)
    _push(servers)
    assert _Group.formed == [[A, B]]  # the second sync reuses the group
    assert servers.group.sent == [["w"], ["w"]]
    for url in (A, B):
        steps = [p for u, p in servers.calls if u == url]
        assert steps == 2 * [
            "/weight_info", "/pause", "/update_weight_version", "/start_weight_update",
            "/finish_weight_update", "/reset_prefix_cache", "/resume",
        ]  # fmt: skip


def test_a_server_down_at_finish_leaves_the_pool_and_the_next_sync_forms_the_group_without_it(
    servers,
):
    servers.fail[(B, "/finish_weight_update")] = _down(B)
    _push(servers)
    assert servers.urls == [A] and B in servers.dropped
    assert (A, "/finish_weight_update") in servers.calls and (B, "/resume") in servers.calls
    servers.fail.clear()
    _push(servers)
    assert _Group.formed == [[A, B], [A]]


def test_a_server_down_at_start_leaves_the_pool_before_any_tensor_is_sent(servers):
    """The group is formed again without it; the server that started already is not started
    a second time."""
    servers.fail[(B, "/start_weight_update")] = _down(B)
    _push(servers)
    assert _Group.formed == [[A, B], [A]]
    assert servers.group.urls == [A] and servers.group.sent == [["w"]]
    assert servers.calls.count((A, "/start_weight_update")) == 1


def test_a_failed_broadcast_stops_the_run_even_with_on_failure_continue(servers):
    servers.fail_send = True
    with pytest.raises(ServerError) as err:
        _push(servers)
    assert not isinstance(err.value, ServerDownError)  # on_failure=continue does not drop it
    assert "rollout.servers.transfer=broadcast" in str(err.value) and B in str(err.value)
    assert servers.group is None  # closed: the next run forms a new one
    assert {u for u, p in servers.calls if p == "/resume"} == {A, B}


def test_a_wrong_answer_at_finish_stops_the_run_in_either_mode(servers):
    servers.fail[(B, "/finish_weight_update")] = ServerError(f"rollout server {B}: 400")
    with pytest.raises(ServerError):
        _push(servers)


def test_a_transfer_host_this_machine_cannot_resolve_is_refused_before_launch():
    from rlbatch.config.errors import ConfigError
    from rlbatch.rollout.servers.backend import check_servers

    cfg = RunConfig()
    cfg.rollout.servers.transfer = ServerTransfer.broadcast
    errors: list[ConfigError] = []
    cfg.rollout.servers.transfer_host = "localhost"
    check_servers(cfg, errors)
    assert errors == []
    cfg.rollout.servers.transfer_host = "no-such-host.invalid"
    check_servers(cfg, errors)
    (error,) = errors
    assert error.key == "rollout.servers.transfer_host" and error.value == "no-such-host.invalid"
    assert "does not resolve" in error.message and "null" in error.message


def test_the_file_transfer_pushes_to_every_server_at_once(servers, tmp_path):
    """Each server's pause ... resume runs beside the others' (one sync takes the slowest
    server's time, not the sum): both servers are in their pause at the same moment."""
    import threading

    import torch

    both = threading.Barrier(2, timeout=10)
    inner = server_sync.call

    def call(url, path, body=None, *, timeout_s, get=False):
        if path.startswith("/pause"):
            both.wait()  # one server after the other never gets past this
        return inner(url, path, body, timeout_s=timeout_s, get=get)

    server_sync.call = call  # restored by the fixture's monkeypatch
    cfg = RunConfig()
    cfg.rollout.servers.transfer_dir = str(tmp_path)
    server_sync.push(servers, cfg, {"w": torch.zeros(2)}, "n-1", drop=True)
    for url in (A, B):
        assert [p for u, p in servers.calls if u == url] == [
            "/weight_info", "/pause", "/update_weight_version", "/init_weight_transfer_engine",
            "/start_weight_update", "/update_weights", "/finish_weight_update",
            "/reset_prefix_cache", "/resume",
        ]  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # the file is removed once both have read it


def test_weight_files_of_dead_trainers_of_this_machine_are_swept(tmp_path):
    """A trainer killed mid-sync leaves its whole-model file (in /dev/shm by default): the next
    sync on the machine removes the files of processes that no longer run, and only those."""
    import os
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    dead = tmp_path / f"rlbatch-weights-{gone.pid}-abc123-{host}.safetensors"
    alive = tmp_path / f"rlbatch-weights-{os.getpid()}-abc123-{host}.safetensors"
    elsewhere = tmp_path / f"rlbatch-weights-{gone.pid}-abc123-not-{host}.safetensors"
    other = tmp_path / "model.safetensors"
    for path in (dead, alive, elsewhere, other):
        path.write_bytes(b"x")
    assert server_sync.sweep_weight_files(tmp_path) == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([alive, elsewhere, other])
