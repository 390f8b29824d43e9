"""The event loop agent harnesses run on (rlbatch.rollout.agent.engine), and its watchdog.

Harnesses of a rank share one asyncio loop in a daemon thread. A heartbeat callback on it tells
how long the loop has gone without running its callbacks (:meth:`HarnessLoop.lag`): a harness
that holds it without awaiting (``time.sleep``, a blocking tool) stalls every episode beside
it. :meth:`HarnessLoop.holder` reads the loop thread's stack from outside to name the episode
whose harness holds it (its frame of :func:`run_harness`, or the episode whose task started
the running task: verifiers scores a trace in tasks of its own) and the line it is at.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Optional


async def run_harness(key: str, harness: Any, client: Any, model: str, row: Any) -> Any:
    """The harness's run, awaited in a frame :meth:`HarnessLoop.holder` recognises (``key``: the
    episode whose harness holds the loop when its code is on the loop thread's stack)."""
    return await harness(client, model, row)


class HarnessLoop:
    """One event loop in a daemon thread: where harnesses run. A heartbeat callback every
    ``BEAT_S`` tells how long the loop has gone without running its callbacks (:meth:`lag`):
    code that holds it without awaiting, which :meth:`holder` names."""

    BEAT_S = 0.1

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.beat = time.monotonic()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="rlbatch-harness", daemon=True
        )
        self.owners: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()
        """The episode each task on the loop belongs to: a run_harness task's own key, and a
        task started from an episode's task (asyncio.gather, create_task) its parent's."""
        self.loop.set_task_factory(self._task)
        self.thread.start()
        self.loop.call_soon_threadsafe(self._beat)

    def _task(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        """The loop's task factory: an ordinary Task, recorded in :attr:`owners` under the
        episode it belongs to."""
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, **kwargs)
        parent = asyncio.current_task(loop)
        owner = self.owners.get(parent) if parent is not None else None
        if owner is None and getattr(coro, "cr_code", None) is run_harness.__code__:
            owner = coro.cr_frame.f_locals.get("key")
        if owner is not None:
            self.owners[task] = owner
        return task

    def _beat(self) -> None:
        self.beat = time.monotonic()
        self.loop.call_later(self.BEAT_S, self._beat)

    def submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def lag(self) -> float:
        """Seconds since the loop last ran its heartbeat."""
        return time.monotonic() - self.beat

    def holder(self, source: str) -> tuple[Optional[str], str]:
        """(the key of the episode whose harness runs on the loop now, or of the episode whose
        task started the running task; None when the code running is no episode's;
        ``file:line in function`` where it runs: the innermost frame in ``source``, the
        harness's file, else the innermost)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        frames, key = [], None
        while frame is not None and key is None:
            if frame.f_code is run_harness.__code__:
                key = frame.f_locals.get("key")
            else:
                frames.append(frame)
            frame = frame.f_back
        if key is None:  # a task the episode started (verifiers' scoring, a harness's own)
            running = asyncio.current_task(self.loop)
            key = self.owners.get(running) if running is not None else None
        at = next((f for f in frames if f.f_code.co_filename == source), None)
        at = at or (frames[0] if frames else None)
        if at is None:
            return key, "an unknown place"
        return key, f"{at.f_code.co_filename}:{at.f_lineno} in {at.f_code.co_name}"
