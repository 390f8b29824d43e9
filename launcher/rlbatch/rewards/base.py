"""What a brought reward returns per sample: a value and the reason of every failure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

FAILURE_REASONS = (
    "wrong_answer",
    "timeout",
    "memory",
    "output_limit",
    "crash",
    "syntax",
    "served_error",
    "no_score",
    "out_of_range",
    "truncated",
)
"""Every failure reason (metrics ``reward_fail/<reason>``: failures of the step's samples)."""


@dataclass(frozen=True)
class Failure:
    """Why one test (or one request) of a sample failed."""

    reason: str
    """One of FAILURE_REASONS."""
    detail: str
    """What happened, for the logged sample (expected vs got, the error's last line, the URL)."""

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True)
class Scored:
    """One sample's reward and its failures (none when everything passed)."""

    value: float
    failures: tuple[Failure, ...] = ()


T = TypeVar("T")
R = TypeVar("R")


def run_bounded(fn: Callable[[T], R], items: Sequence[T], max_workers: int) -> list[R]:
    """``fn`` over ``items`` with at most ``max_workers`` running at once, results in order
    (the first exception is raised after the others finished)."""
    if not items:
        return []
    if max_workers <= 1 or len(items) == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        return list(pool.map(fn, items))
