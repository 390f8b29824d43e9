"""One HTTP request to a rollout server, and the errors that name the server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from rlbatch.rollout.protocol import RolloutUnavailableError


class ServerError(RolloutUnavailableError):
    """A rollout server refused a request, did not answer in time, or answered wrongly."""


class ServerDownError(ServerError):
    """A rollout server refused a request (no connection, HTTP 5xx) or did not answer in time:
    the failures rollout.servers.on_failure=continue drops a server for."""


def call(url: str, path: str, body: Any = None, *, timeout_s: float, get: bool = False) -> Any:
    """One request to a server, its JSON answer; ServerError naming the server otherwise."""
    data = None if get else json.dumps({} if body is None else body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"},
        method="GET" if get else "POST",
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:800]
        kind = ServerDownError if err.code >= 500 else ServerError
        raise kind(f"rollout server {url}: {path} failed ({err.code}): {detail}") from err
    except (urllib.error.URLError, OSError) as err:
        raise ServerDownError(
            f"rollout server {url} did not answer {path} within {timeout_s:g} s"
            f" (rollout.servers.timeout_s): {getattr(err, 'reason', err)}; is it still running?"
        ) from err
    return json.loads(raw) if raw else None
