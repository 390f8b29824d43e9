"""Rewards served over HTTP: ``data.reward=http`` (a scorer that answers ``{"reward": x}``) and
the request machinery ``judge`` shares (timeout, retries with backoff, concurrency cap).

A request that fails with a 5xx status, a connection error or a timeout is retried
``data.served.retries`` times, waiting ``backoff_s``, then twice as long each time. A 4xx status
or an answer that is not the expected JSON is not retried (the server will say the same again).
What a failure after that does is ``data.served.on_error``: stop the run naming the URL and the
sample (raise_error), or score the sample 0 and count it in ``reward_fail/served_error``.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from rlbatch.config.enums import EnvOnError
from rlbatch.config.rewards import ServedConfig
from rlbatch.rewards.base import Failure, Scored, run_bounded
from rlbatch.runtime import progress


class ServedError(RuntimeError):
    """A request that failed for good (after its retries), naming the URL and what came back."""


class _Retryable(Exception):
    pass


def _post_once(url: str, payload: Any, timeout_s: float) -> Any:
    body = json.dumps(payload).encode()
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        text = err.read()[:200].decode("utf-8", errors="replace")
        if err.code >= 500:
            raise _Retryable(f"HTTP {err.code} {text!r}") from err
        raise ServedError(f"{url} answered HTTP {err.code} {text!r}") from err
    except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
        raise _Retryable(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from err
    try:
        return json.loads(raw)
    except ValueError as err:
        raise ServedError(f"{url} answered with something that is not JSON: {raw[:200]!r}") from err


def post_json(url: str, payload: Any, cfg: ServedConfig) -> Any:
    """The JSON answer of ``url`` to ``payload``, retried per ``cfg``; ServedError otherwise."""
    wait = cfg.backoff_s
    for attempt in range(cfg.retries + 1):
        try:
            return _post_once(url, payload, cfg.timeout_s)
        except _Retryable as err:
            if attempt == cfg.retries:
                raise ServedError(
                    f"{url} failed {attempt + 1} time(s) (last: {err}) within"
                    f" data.served.timeout_s={cfg.timeout_s:g} each"
                ) from err
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def as_reward(value: Any, url: str, key: str = "reward") -> float:
    """A finite number (not a bool or a string), else ServedError naming what came back."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ServedError(f"{url} answered {key}={value!r}: expected a finite number")


def score_requests(
    requests: Sequence[Callable[[], list[float]]],
    labels: Sequence[str],
    sizes: Sequence[int],
    url: str,
    cfg: ServedConfig,
) -> list[Scored]:
    """Run every request (each scores ``sizes[i]`` samples) with at most max_concurrency at
    once; a ServedError stops the run (raise_error) or scores its samples 0 (zero_reward)."""

    def run(i: int) -> list[Scored]:
        try:
            return [Scored(v) for v in requests[i]()]
        except ServedError as err:
            if EnvOnError(cfg.on_error) == EnvOnError.raise_error:
                raise ServedError(
                    f"reward request for {labels[i]} failed: {err} (data.served.on_error="
                    "zero_reward scores such samples 0 instead)"
                ) from err
            return [Scored(0.0, (Failure("served_error", str(err)[:300]),))] * sizes[i]

    waves = -(-len(requests) // max(1, cfg.max_concurrency))
    wait = cfg.backoff_s * (2**cfg.retries - 1)  # every backoff of one request
    bound = waves * ((cfg.retries + 1) * cfg.timeout_s + wait) + 60.0
    with progress.user_call(f"{len(requests)} reward requests to {url}", bound):
        chunks = run_bounded(run, list(range(len(requests))), cfg.max_concurrency)
    return [s for chunk in chunks for s in chunk]


def sample_payload(prompt: str, completion: str, answer: str, fields: Any) -> dict[str, Any]:
    """What the scorer receives of one sample: the row's fields, then prompt, completion and
    answer (these three win over row fields of the same name)."""
    return {**dict(fields), "prompt": prompt, "completion": completion, "answer": answer}


class HttpReward:
    """data.reward=http: posts each sample (or batches of data.served.batch_size)."""

    def __init__(self, url: str, cfg: ServedConfig) -> None:
        self.url = url
        self.cfg = cfg

    def _one(self, payload: dict[str, Any]) -> Callable[[], list[float]]:
        def call() -> list[float]:
            answer = post_json(self.url, payload, self.cfg)
            if not isinstance(answer, dict) or "reward" not in answer:
                raise ServedError(
                    f"{self.url} answered {str(answer)[:200]!r}: expected {{'reward': x}}"
                )
            return [as_reward(answer["reward"], self.url)]

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
            return [as_reward(r, self.url, "rewards[]") for r in rewards]

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
