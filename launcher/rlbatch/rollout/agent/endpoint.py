"""The OpenAI-compatible HTTP endpoint a harness calls while a run generates.

``POST /e/<episode>/v1/chat/completions`` and ``/e/<episode>/v1/completions`` (streamed as
server-sent events when ``stream`` is true), ``GET /e/<episode>/v1/models``. Each episode has
its own address (the harness's client is pointed at it), so calls group into episodes without
the harness's help. With env.agent.auth_token set, a call without ``Authorization: Bearer
<token>`` is refused (401). The server runs in daemon threads (one per connection); the work of
a call is :class:`rlbatch.rollout.agent.session.AgentSession`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Protocol

log = logging.getLogger(__name__)


class CallError(Exception):
    """A call the endpoint refuses: its HTTP status and OpenAI-style error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Served(Protocol):
    """What the endpoint serves (AgentSession)."""

    def answer(self, episode: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """The reply of one call: {"text", "ids", "logps", "tokens", "finish_reason",
        "tool_calls", "content", "prompt_tokens"}; CallError when refused."""
        ...


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    """Connections waiting to be accepted (socketserver's 5 refused a round's concurrent
    episodes: the clients saw connection errors)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer (its episode ended, the run is stopping) is no error of the
        run's: no traceback on its stderr."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            log.debug("agent endpoint: a call from %s failed", client_address, exc_info=True)


class Endpoint:
    """The HTTP server of one rank (started once, serving every round's episodes)."""

    def __init__(
        self, host: str, port: int, token: Optional[str], advertise: Optional[str] = None
    ) -> None:
        self.token = token
        self.advertise = advertise
        """The host base_urls name (env.agent.advertise_host); None: the bound one."""
        self.session: Optional[Served] = None
        endpoint = self

        class Handler(_Handler):
            owner = endpoint

        self.server = _Server((host, port), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="rlbatch-agent-endpoint", daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        host = str(host, "ascii") if isinstance(host, bytes) else str(host)
        host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        host = self.advertise or host
        return f"http://{host}:{port}"

    def base_url(self, episode: str) -> str:
        """The ``base_url`` of an episode's client."""
        return f"{self.address}/e/{episode}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    owner: Endpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # no access log on the run's stderr

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "code": status}})

    def _route(self) -> Optional[tuple[str, str]]:
        """(episode, what) of the path, or None (404 sent); 401 sent on a bad token."""
        token = self.owner.token
        if token and self.headers.get("Authorization", "") != f"Bearer {token}":
            self._error(401, "missing or wrong bearer token (env.agent.auth_token)")
            return None
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "e" or parts[2] != "v1":
            self._error(404, f"no such endpoint: {self.path}")
            return None
        return parts[1], "/".join(parts[3:])

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        route = self._route()
        if route is None:
            return
        if route[1] != "models":
            self._error(404, f"no such endpoint: {self.path}")
            return
        model = {"id": "policy", "object": "model", "created": 0, "owned_by": "rlbatch"}
        self._send(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        route = self._route()
        if route is None:
            return
        episode, what = route
        kinds = {"chat/completions": "chat", "completions": "completion"}
        if what not in kinds:
            self._error(404, f"no such endpoint: {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as err:
            self._error(400, f"bad request body: {err}")
            return
        session = self.owner.session
        try:
            if session is None:
                raise CallError(404, f"episode {episode} is not running")
            reply = session.answer(episode, kinds[what], body)
        except CallError as err:
            self._error(err.status, str(err))
            return
        except Exception as err:  # noqa: BLE001 - reported to the client, and by the session
            self._error(500, f"{type(err).__name__}: {err}")
            return
        if body.get("stream"):
            self._stream(kinds[what], body, reply)
        else:
            self._send(200, response(kinds[what], body, reply))

    def _stream(self, kind: str, body: dict[str, Any], reply: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in stream_chunks(kind, body, reply):
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def _usage(reply: dict[str, Any]) -> dict[str, int]:
    n, p = len(reply["ids"]), reply["prompt_tokens"]
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _chat_logprobs(reply: dict[str, Any]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(reply["tokens"], reply["logps"], strict=True)
        ]
    }


def _completion_logprobs(reply: dict[str, Any]) -> dict[str, Any]:
    offsets, at = [], 0
    for t in reply["tokens"]:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": reply["tokens"],
        "token_logprobs": reply["logps"],
        "top_logprobs": [{} for _ in reply["tokens"]],
        "text_offset": offsets,
    }


def _message(reply: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"]}
    if reply["tool_calls"]:
        message["tool_calls"] = reply["tool_calls"]
    return message


def response(kind: str, body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed OpenAI response of a call."""
    base = {
        "id": f"rlbatch-{uuid.uuid4().hex[:16]}",
        "created": int(time.time()),
        "model": str(body.get("model", "policy")),
        "usage": _usage(reply),
    }
    wants_logprobs = bool(body.get("logprobs"))
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": _message(reply),
            "finish_reason": reply["finish_reason"],
            "logprobs": _chat_logprobs(reply) if wants_logprobs else None,
        }
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice = {
        "index": 0,
        "text": reply["text"],
        "finish_reason": reply["finish_reason"],
        "logprobs": _completion_logprobs(reply) if body.get("logprobs") is not None else None,
    }
    return {**base, "object": "text_completion", "choices": [choice]}


def stream_chunks(kind: str, body: dict[str, Any], reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The server-sent events of a streamed call: one per token, then the finish (and the
    usage when ``stream_options.include_usage``)."""
    base = {
        "id": f"rlbatch-{uuid.uuid4().hex[:16]}",
        "created": int(time.time()),
        "model": str(body.get("model", "policy")),
    }
    chunks: list[dict[str, Any]] = []
    wants_logprobs = bool(body.get("logprobs"))
    if kind == "chat":
        obj = {**base, "object": "chat.completion.chunk"}
        chunks.append({**obj, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        if reply["tool_calls"]:  # the content (if any) and the calls whole, as parsed
            delta: dict[str, Any] = {"content": reply["content"]}
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(reply["tool_calls"])]
            lp = _chat_logprobs(reply) if wants_logprobs else None
            chunks.append({**obj, "choices": [{"index": 0, "delta": delta, "logprobs": lp}]})
        else:
            shown = reply["content"] or ""
            pieces = _pieces(reply["tokens"], shown)
            for i, piece in enumerate(pieces):
                lp = None
                if wants_logprobs and i < len(reply["tokens"]):
                    one = {**reply, "tokens": [reply["tokens"][i]], "logps": [reply["logps"][i]]}
                    lp = _chat_logprobs(one)
                choice = {"index": 0, "delta": {"content": piece}, "logprobs": lp}
                chunks.append({**obj, "choices": [choice]})
        end = {"index": 0, "delta": {}, "finish_reason": reply["finish_reason"]}
        chunks.append({**obj, "choices": [end]})
    else:
        obj = {**base, "object": "text_completion"}
        for piece in _pieces(reply["tokens"], reply["text"]):
            chunks.append({**obj, "choices": [{"index": 0, "text": piece, "finish_reason": None}]})
        chunks.append({**obj, "choices": [{"index": 0, "text": "", "finish_reason": reply["finish_reason"]}]})  # fmt: skip
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**chunks[-1], "choices": [], "usage": _usage(reply)})
    return chunks


def _pieces(tokens: list[str], text: str) -> list[str]:
    """``text`` in one piece per token where the tokens' texts make it up (the shown text may
    stop before a stop string's tokens), else whole."""
    pieces, at = [], 0
    for t in tokens:
        if not text.startswith(t, at) or not t:
            break
        pieces.append(t)
        at += len(t)
    if at < len(text):
        pieces.append(text[at:])
    return pieces or [text]
