"""One HTTP request to a rollout server, and the errors that name the server.

A request's failure says what happened, so the fix is clear: the server refused the connection
(not running, or the wrong port), closed it mid-request (killed or stopped), answered with an
HTTP error, or did not answer within ``rollout.servers.timeout_s`` (hung). While a request is in
flight its server's ``GET /health`` is read every :data:`HEALTH_POLL_S` seconds (once per
server, whatever the number of requests waiting on it): a vLLM server whose engine died keeps
its HTTP socket open, and a request to it would otherwise wait out the whole timeout.
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from rlbatch.rollout.protocol import RolloutUnavailableError

HEALTH_POLL_S = 2.0
"""How often a server with a request in flight is asked GET /health."""
HEALTH_TIMEOUT_S = 5.0
"""How long that GET /health may take before the server counts as down."""


class ServerError(RolloutUnavailableError):
    """A rollout server refused a request, did not answer in time, or answered wrongly."""


class ServerDownError(ServerError):
    """A rollout server refused a request (no connection, HTTP 5xx) or did not answer in time:
    the failures rollout.servers.on_failure=continue drops a server for."""


class ServerRestartedError(ServerError):
    """A rollout server answered with its start-up weights after the run pushed its own: it
    was restarted at its URL (rollout.servers.on_failure=restart takes it back once synced;
    the other modes stop the run)."""


def call(url: str, path: str, body: Any = None, *, timeout_s: float, get: bool = False) -> Any:
    """One request to a server, its JSON answer; ServerError naming the server otherwise."""
    data = None if get else json.dumps({} if body is None else body).encode()
    status, raw = _exchange(url, path, data, timeout_s)
    if status >= 400:
        detail = raw.decode(errors="replace")[:800]
        kind = ServerDownError if status >= 500 else ServerError
        raise kind(f"rollout server {url}: {path} failed ({status}): {detail}")
    return json.loads(raw) if raw else None


def health(
    url: str, timeout_s: float = HEALTH_TIMEOUT_S, *, slow_ok: bool = False
) -> Optional[str]:
    """None when GET {url}/health answers 200 (or, ``slow_ok``, does not answer within
    ``timeout_s``: a busy server, not proof of a dead one); else what went wrong, in words."""
    try:
        status, raw = _exchange(url, "/health", None, timeout_s, watch=False)
    except ServerError as err:
        if slow_ok and isinstance(err.__cause__, TimeoutError):
            return None
        return str(err)
    if status == 200:
        return None
    detail = raw.decode(errors="replace").strip()[:200]
    return f"GET /health answered {status}" + (f": {detail}" if detail else "")


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(
            f"rollout server {url!r} is not an http:// or https:// URL: write it as"
            " http://HOST:PORT"
        )
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=timeout_s), parts.path.rstrip("/")


def _exchange(
    url: str, path: str, data: Optional[bytes], timeout_s: float, *, watch: bool = True
) -> tuple[int, bytes]:
    """(status, body) of one request; ServerDownError when no answer came (each way it can
    fail in words of its own)."""
    conn, prefix = _connection(url, timeout_s)
    try:
        conn.request(
            "GET" if data is None else "POST", prefix + path, body=data,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        if watch:
            _await_answer(conn, url, path, time.monotonic() + timeout_s)
        answer = conn.getresponse()
        return answer.status, answer.read()
    except ServerError:
        raise
    except ConnectionRefusedError as err:
        raise ServerDownError(
            f"rollout server {url} refused the connection ({path}): it is not running, or"
            " listens on another address"
        ) from err
    except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as err:
        raise ServerDownError(
            f"rollout server {url} closed the connection during {path}: it was stopped or"
            f" killed ({err})"
        ) from err
    except TimeoutError as err:
        raise ServerDownError(
            f"rollout server {url} did not answer {path} within {timeout_s:g} s"
            " (rollout.servers.timeout_s): is it hung?"
        ) from err
    except (OSError, http.client.HTTPException) as err:
        raise ServerDownError(f"rollout server {url}: {path} failed: {err}") from err
    finally:
        conn.close()


def _await_answer(conn: http.client.HTTPConnection, url: str, path: str, deadline: float) -> None:
    """Return once the server starts answering; ServerDownError when its /health fails first
    (its engine died: vLLM's HTTP server may outlive it, holding the request), TimeoutError
    at ``deadline``."""
    poller = select.poll()  # select.select refuses descriptors past 1023; a trainer may hold more
    poller.register(conn.sock, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if poller.poll(min(HEALTH_POLL_S, left) * 1000):
            return
        why = _WATCH.down(url)
        if why is not None:
            raise ServerDownError(
                f"rollout server {url} failed while {path} was in flight: {why} (its engine"
                " died, or it is shutting down)"
            )


class _HealthWatch:
    """The last /health answer of each server, read at most every HEALTH_POLL_S seconds however
    many requests wait on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checks: dict[str, tuple[float, Optional[str]]] = {}
        self.busy: set[str] = set()

    def down(self, url: str) -> Optional[str]:
        """None while ``url`` is healthy (as far as is known), else why not."""
        with self.lock:
            at, why = self.checks.get(url, (float("-inf"), None))
            if time.monotonic() - at < HEALTH_POLL_S or url in self.busy:
                return why
            self.busy.add(url)
        try:
            why = health(url, slow_ok=True)
        finally:
            with self.lock:
                self.checks[url] = (time.monotonic(), why)
                self.busy.discard(url)
        return why


_WATCH = _HealthWatch()
