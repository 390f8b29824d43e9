"""Rewards served over HTTP: ``data.reward=http`` (a scorer that answers ``{"reward": x}``) and
the request machinery ``judge`` shares (a deadline, a size limit, retries with backoff and
jitter, a concurrency cap).

One request (connect, send, the answer's headers and body) must finish within
``data.served.timeout_s``: a timer closes the connection at that deadline, so a server that
trickles its answer a byte at a time or stops after the headers cannot hold the run (a timeout
on each socket read alone would not: every byte restarts it). An answer over
``data.served.max_response_bytes`` is refused as soon as it is known to be (its
Content-Length, or the bytes read so far). A 5xx status or a refused / reset connection is
retried ``data.served.retries`` times, waiting ``backoff_s`` then twice as long each time, each
wait drawn between half and all of that (jitter: clients that failed together do not all come
back together). A request that ran out of time is retried only with
``data.served.retry_timeouts=true``: a judge that is slow because it is overloaded gets slower
when every client asks twice. A 4xx status, another status than 200 (a redirect is not followed), an answer that
is not the expected JSON or is too large is not retried (the server will say the same again).

Two kinds of failure, handled apart:

- the request failed (reason ``served_error``: no answer, an error status, not the expected
  JSON): ``data.served.on_error`` decides, stop the run naming the URL and the sample
  (raise_error) or score the sample 0 and count it in ``reward_fail/served_error``;
- the answer was read but its content is unusable (``no_score``: a judge reply without one
  readable score, as when the judge quotes a score the completion wrote beside its own;
  ``out_of_range``: a reward not finite or too large): the sample scores 0 and is counted under
  that reason whatever on_error says. What the completion made the judge write must not stop a
  run, and a reward computed from a completion can overflow for that completion alone.

Either way the failed samples of a step are bounded: more than
``data.served.max_error_fraction`` of them (:func:`check_error_fraction`, over every DP rank)
stops the run before the step trains.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from rlbatch.config.enums import ServedOnError
from rlbatch.config.rewards import ServedConfig
from rlbatch.rewards.base import Failure, Scored, run_bounded
from rlbatch.runtime import progress


class ServedError(RuntimeError):
    """A request that failed for good (after its retries), naming the URL and what came back;
    ``reason`` is the failure reason its samples are counted under (rlbatch.rewards.base)."""

    def __init__(self, message: str, reason: str = "served_error") -> None:
        super().__init__(message)
        self.reason = reason


class _Retryable(Exception):
    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Deadline:
    """Closes ``conn``'s socket when ``seconds`` have passed (whatever it is blocked in)."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn, self.expired = conn, False
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def _expire(self) -> None:
        self.expired = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def check(self) -> None:
        if self.expired:
            raise TimeoutError("the request's deadline passed")


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return kind(parts.hostname or "", parts.port, timeout=timeout_s), target


def _read_body(
    response: http.client.HTTPResponse, limit: int, deadline: _Deadline, url: str
) -> bytes:
    """The answer's body, chunk by chunk (each read returns what arrived), refused past
    ``limit`` bytes."""
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServedError(
            f"{url} answered a body of {int(declared)} bytes, over data.served."
            f"max_response_bytes={limit}"
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        deadline.check()
        chunk = response.read1(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise ServedError(
                f"{url} answered more than data.served.max_response_bytes={limit} bytes"
            )
        chunks.append(chunk)


def _post_once(url: str, payload: Any, cfg: ServedConfig) -> Any:
    body = json.dumps(payload).encode()
    conn, target = _connection(url, cfg.timeout_s)
    deadline = _Deadline(conn, cfg.timeout_s)
    deadline.timer.start()
    try:
        conn.connect()
        deadline.check()
        conn.request("POST", target, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status >= 400:
            text = _read_body(response, 200, deadline, url)[:200].decode("utf-8", "replace")
            if response.status >= 500:
                raise _Retryable(f"HTTP {response.status} {text!r}")
            raise ServedError(f"{url} answered HTTP {response.status} {text!r}")
        if response.status != 200:  # a redirect (not followed) or an answer without a body
            where = response.getheader("Location") or ""
            raise ServedError(
                f"{url} answered HTTP {response.status} {response.reason} {where}".rstrip()
                + ": not a reward; set data.reward_url (or data.judge.url) to the URL that"
                " answers 200"
            )
        raw = _read_body(response, cfg.max_response_bytes, deadline, url)
    except ServedError as err:
        if deadline.expired:  # the deadline cut a small error body
            raise _Retryable("timed out", timed_out=True) from err
        raise
    except TimeoutError as err:
        raise _Retryable("timed out", timed_out=True) from err
    except (OSError, http.client.HTTPException) as err:  # refused, reset, closed mid-answer
        if deadline.expired:
            raise _Retryable("timed out", timed_out=True) from err
        raise _Retryable(f"{type(err).__name__}: {err}") from err
    finally:
        deadline.timer.cancel()
        conn.close()
    try:
        return json.loads(raw)
    except ValueError as err:
        raise ServedError(f"{url} answered with something that is not JSON: {raw[:200]!r}") from err


def post_json(url: str, payload: Any, cfg: ServedConfig) -> Any:
    """The JSON answer of ``url`` to ``payload``, retried per ``cfg``; ServedError otherwise."""
    wait = cfg.backoff_s
    for attempt in range(cfg.retries + 1):
        try:
            return _post_once(url, payload, cfg)
        except _Retryable as err:
            within = f"within data.served.timeout_s={cfg.timeout_s:g} (the whole request)"
            if err.timed_out and not cfg.retry_timeouts:
                raise ServedError(
                    f"{url} timed out: no full answer {within}; not retried (a slow server only gets"
                    " slower when asked twice: data.served.retry_timeouts=true retries it)"
                ) from err
            if attempt == cfg.retries:
                raise ServedError(
                    f"{url} failed {attempt + 1} time(s) (last: {err}) {within} each"
                ) from err
            time.sleep(wait * random.uniform(0.5, 1.0))
            wait *= 2
    raise AssertionError("unreachable")


def as_reward(value: Any, url: str, abs_max: float, key: str = "reward") -> float:
    """A finite number (not a bool or a string) of magnitude <= ``abs_max``, else ServedError
    naming what came back (reason ``out_of_range`` for a number out of bounds)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ServedError(f"{url} answered {key}={value!r}: expected a finite number")
    if not math.isfinite(value) or abs(value) > abs_max:
        raise ServedError(
            f"{url} answered {key}={value!r}: rewards must be finite and at most {abs_max:g} in"
            " size (data.reward_abs_max)",
            "out_of_range",
        )
    return float(value)


def score_requests(
    requests: Sequence[Callable[[], list[float]]],
    labels: Sequence[str],
    sizes: Sequence[int],
    url: str,
    cfg: ServedConfig,
) -> list[Scored]:
    """Run every request (each scores ``sizes[i]`` samples) with at most max_concurrency at
    once; a failed request (``served_error``) stops the run (raise_error) or scores its samples
    0 (zero_reward); an unusable answer (``no_score``, ``out_of_range``) scores them 0."""

    def run(i: int) -> list[Scored]:
        try:
            return [Scored(v) for v in requests[i]()]
        except ServedError as err:
            stop = ServedOnError(cfg.on_error) == ServedOnError.raise_error
            if stop and err.reason == "served_error":
                raise ServedError(
                    f"reward request for {labels[i]} failed: {err} (data.served.on_error="
                    "zero_reward scores such samples 0 instead)",
                    err.reason,
                ) from err
            return [Scored(0.0, (Failure(err.reason, str(err)[:300]),))] * sizes[i]

    waves = -(-len(requests) // max(1, cfg.max_concurrency))
    wait = cfg.backoff_s * (2**cfg.retries - 1)  # every backoff of one request
    bound = waves * ((cfg.retries + 1) * cfg.timeout_s + wait) + 60.0
    with progress.user_call(f"{len(requests)} reward requests to {url}", bound):
        chunks = run_bounded(run, list(range(len(requests))), cfg.max_concurrency)
    return [s for chunk in chunks for s in chunk]


def check_error_fraction(
    failed: float, total: float, cfg: ServedConfig, step: int, example: str
) -> None:
    """ServedError when more than ``cfg.max_error_fraction`` of a step's ``total`` samples
    (over every DP rank) had a served failure (``failed``); ``example``: one of them."""
    if total <= 0 or failed / total <= cfg.max_error_fraction:
        return
    raise ServedError(
        f"step {step}: {failed:.0f} of the {total:.0f} samples had a served reward failure"
        f" ({failed / total:.2f}, over data.served.max_error_fraction={cfg.max_error_fraction:g});"
        f" the step was not trained{', e.g. ' + example if example else ''}. Fix the reward"
        " server or judge (a judge template whose replies it cannot read: data.judge.template,"
        " data.judge.score_pattern), or raise data.served.max_error_fraction to train on such"
        " samples scored 0"
    )


def sample_payload(prompt: str, completion: str, answer: str, fields: Any) -> dict[str, Any]:
    """What the scorer receives of one sample: the row's fields, then prompt, completion and
    answer (these three win over row fields of the same name)."""
    return {**dict(fields), "prompt": prompt, "completion": completion, "answer": answer}


class HttpReward:
    """data.reward=http: posts each sample (or batches of data.served.batch_size)."""

    def __init__(self, url: str, cfg: ServedConfig, abs_max: float = math.inf) -> None:
        self.url = url
        self.cfg = cfg
        self.abs_max = abs_max

    def _one(self, payload: dict[str, Any]) -> Callable[[], list[float]]:
        def call() -> list[float]:
            answer = post_json(self.url, payload, self.cfg)
            if not isinstance(answer, dict) or "reward" not in answer:
                raise ServedError(
                    f"{self.url} answered {str(answer)[:200]!r}: expected {{'reward': x}}"
                )
            return [as_reward(answer["reward"], self.url, self.abs_max)]

        return call

    def _many(self, payloads: list[dict[str, Any]]) -> Callable[[], list[float]]:
        def call() -> list[float]:
            answer = post_json(self.url, {"samples": payloads}, self.cfg)
            rewards = answer.get("rewards") if isinstance(answer, dict) else None
            if not isinstance(rewards, list) or len(rewards) != len(payloads):
                raise ServedError(
                    f"{self.url} answered {str(answer)[:200]!r}: expected"
                    f" {{'rewards': [...]}} with {len(payloads)} numbers"
                )
            return [as_reward(r, self.url, self.abs_max, "rewards[]") for r in rewards]

        return call

    def score(self, payloads: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[Scored]:
        size = max(1, self.cfg.batch_size)
        if size == 1:
            calls = [self._one(p) for p in payloads]
            return score_requests(calls, labels, [1] * len(payloads), self.url, self.cfg)
        starts = range(0, len(payloads), size)
        calls = [self._many(list(payloads[s : s + size])) for s in starts]
        names = [f"{labels[s]} .. {labels[min(s + size, len(labels)) - 1]}" for s in starts]
        sizes = [min(size, len(payloads) - s) for s in starts]
        return score_requests(calls, names, sizes, self.url, self.cfg)

    def check(self, payload: dict[str, Any]) -> str:
        """ "" when the scorer answers one sample with a reward (with the run's timeout and
        retries: a server still warming up may answer 5xx first), else what came back."""
        call = self._one(payload) if self.cfg.batch_size <= 1 else self._many([payload])
        try:
            call()
        except ServedError as err:
            return str(err)
        return ""
