"""Real local servers for the served-reward tests (stdlib http.server in a thread, on
127.0.0.1), and a tiny sequence-classification reward model saved by transformers.

- :class:`Scorer`: ``POST /`` -> ``{"reward": rule(completion)}``, or a list for
  ``{"samples": [...]}``; it can fail its first ``fail_first`` requests with HTTP 500, hang, or
  answer garbage; it records every reward it answered.
- :class:`Judge`: an OpenAI-compatible ``POST /v1/chat/completions`` that answers
  ``"Score: N/10"`` with N = a rule of the message (or what ``reply(message)`` says); it records
  every N.
- :class:`Misbehaving`: a raw TCP server speaking just enough HTTP to misbehave on purpose:
  trickling its answer a byte a second, hanging after the headers, sending a huge body (with
  or without a Content-Length), or answering slowly the first time and at once after.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def scorer_rule(completion: str) -> float:
    """The scorer's reward: (len % 5) / 4, in [0, 1]."""
    return (len(completion) % 5) / 4


def judge_rule(message: str) -> int:
    """The judge's score out of 10."""
    return len(message) % 11


class _Server:
    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, text = owner.answer(self.path, body)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): expected with hang_s

        self.lock = threading.Lock()
        self.requests = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, path: str, body: bytes) -> tuple[int, str]:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Scorer(_Server):
    def __init__(
        self,
        fail_first: int = 0,
        hang_s: float = 0.0,
        garbage: bool = False,
        reward: float | None = None,
    ) -> None:
        super().__init__()
        self.fail_first, self.hang_s, self.garbage = fail_first, hang_s, garbage
        self.reward = reward  # answered for every sample instead of the rule
        self.failures_sent = 0
        self.answered: list[float] = []
        self.payloads: list[dict[str, Any]] = []

    def answer(self, path: str, body: bytes) -> tuple[int, str]:
        with self.lock:
            self.requests += 1
            if self.failures_sent < self.fail_first:
                self.failures_sent += 1
                return 500, '{"error": "warming up"}'
        if self.hang_s:
            time.sleep(self.hang_s)
        if self.garbage:
            return 200, "<html>surprise</html>"
        payload = json.loads(body)
        if self.reward is not None:
            return 200, json.dumps({"reward": self.reward})
        with self.lock:
            if "samples" in payload:
                rewards = [scorer_rule(s["completion"]) for s in payload["samples"]]
                self.payloads += payload["samples"]
                self.answered += rewards
                return 200, json.dumps({"rewards": rewards})
            self.payloads.append(payload)
            self.answered.append(scorer_rule(payload["completion"]))
            return 200, json.dumps({"reward": self.answered[-1]})


class Judge(_Server):
    def __init__(self, reply: Callable[[str], str] | None = None, fail_first: int = 0) -> None:
        super().__init__()
        self.scores: list[int] = []
        self.messages: list[str] = []
        self.reply = reply
        self.fail_first = fail_first

    def answer(self, path: str, body: bytes) -> tuple[int, str]:
        if path != "/v1/chat/completions":
            return 404, '{"error": "not found"}'
        request = json.loads(body)
        message = request["messages"][-1]["content"]
        score = judge_rule(message)
        with self.lock:
            self.requests += 1
            if self.requests <= self.fail_first:
                return 503, '{"error": "loading the model"}'
            self.scores.append(score)
            self.messages.append(message)
        reply = {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "model": request.get("model", "judge"),
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": self.reply(message) if self.reply else f"Score: {score}/10",
                    },
                    "finish_reason": "stop",
                }
            ],
        }
        return 200, json.dumps(reply)


class Misbehaving:
    """A raw HTTP/1.1 server on 127.0.0.1 that reads one request per connection and then
    misbehaves by ``mode``: ``trickle`` (the whole answer, status line first, one byte a
    second), ``hang_after_headers`` (headers of a 100-byte body, then nothing), ``huge`` (a
    50 MB body with its Content-Length), ``huge_undeclared`` (the same without one: the body
    runs until the connection closes), ``slow_then_fast`` (the first answer after ``slow_s``,
    the next ones at once). Good answers are ``{"reward": 0.5}``."""

    GOOD = b'{"reward": 0.5}'

    def __init__(self, mode: str, slow_s: float = 5.0) -> None:
        self.mode, self.slow_s = mode, slow_s
        self.requests = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    owner._serve(self.request)
                except OSError:
                    pass  # the client gave up: what the tests expect

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/score"

    @staticmethod
    def _answer(body: bytes, length: int | None = None) -> bytes:
        size = len(body) if length is None else length
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + (
            f"Content-Length: {size}\r\nConnection: close\r\n\r\n".encode() + body
        )

    def _read_request(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        while len(body) < length:
            body += conn.recv(65536)

    def _serve(self, conn: socket.socket) -> None:
        self._read_request(conn)
        with self.lock:
            self.requests += 1
            first = self.requests == 1
        if self.mode == "trickle":
            for byte in self._answer(self.GOOD):
                conn.sendall(bytes([byte]))
                if self.stop.wait(1.0):
                    return
        elif self.mode == "hang_after_headers":
            conn.sendall(self._answer(b"", length=100))
            self.stop.wait(600)
        elif self.mode in ("huge", "huge_undeclared"):
            head = self._answer(b"", length=50_000_000)
            if self.mode == "huge_undeclared":
                head = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"
            conn.sendall(head)
            block = b"9" * 65536
            for _ in range(50_000_000 // len(block)):
                conn.sendall(block)
        elif self.mode == "slow_then_fast":
            if first and self.stop.wait(self.slow_s):
                return
            conn.sendall(self._answer(self.GOOD))
        else:
            raise ValueError(self.mode)

    def __enter__(self) -> Misbehaving:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def save_tiny_reward_model(path: Path, seed: int = 0, chat_template: str | None = None) -> Any:
    """A random one-label Qwen2ForSequenceClassification with a character-level tokenizer
    (printable ASCII and newline; with ``chat_template`` when given), saved by transformers to
    ``path``; returns the model."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        **({"chat_template": chat_template} if chat_template else {}),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = transformers.Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        num_labels=1, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForSequenceClassification(cfg).float().eval()
    model.save_pretrained(path)
    return model
