"""What this worker is doing now, for the watchdog (rlbatch.train.health.Watchdog).

The training loop's heartbeat sets the phase of each step; code that calls into user
functions (reward functions) marks the call with :func:`user_call`, giving it its own time
bound (``data.reward_timeout_s``) and a name the hang report shows. Pure (no torch): importable
from every layer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Activity:
    """The current phase of this process: set by the heartbeat, read by the watchdog."""

    step: int = 0
    phase: str = "start"
    detail: str | None = None
    """A user call in progress ('reward function my.py:fn'), else None."""
    limit_s: float | None = None
    """Its own time bound (None: trainer.timeout_s)."""
    since: float = 0.0
    """time.monotonic() when the phase (or the user call) began."""


current = Activity(since=time.monotonic())
_lock = threading.Lock()
_listeners: list[Callable[[Activity], None]] = []
"""Called after each change (the heartbeat file writer)."""


def set_phase(step: int, phase: str, detail: str | None = None, limit_s: float | None = None):
    with _lock:
        current.step, current.phase, current.detail = step, phase, detail
        current.limit_s, current.since = limit_s, time.monotonic()
    for listener in _listeners:
        listener(current)


def listen(fn: Callable[[Activity], None]) -> None:
    """Make ``fn`` the one listener (the latest heartbeat of this process)."""
    _listeners[:] = [fn]


@contextmanager
def user_call(what: str, limit_s: float | None) -> Iterator[None]:
    """Mark a call into user code: the watchdog bounds it by ``limit_s`` and names it."""
    step, phase, detail, limit = current.step, current.phase, current.detail, current.limit_s
    set_phase(step, phase, what, limit_s)
    try:
        yield
    finally:
        set_phase(step, phase, detail, limit)
