"""The pool of vLLM servers a process samples from (:class:`ServerPool`): which server a
request goes to (an episode keeps its server, new work goes to the least loaded), servers that
drop out and come back (``rollout.servers.on_failure``), rows sent again; and the URLs of the
servers the run uses (:func:`server_urls`). rlbatch.rollout.servers.backend drives it."""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from rlbatch.config.schema import RunConfig
from rlbatch.rollout.servers.client import ServerDownError, ServerError, ServerRestartedError

URLS_ENV = "RLBATCH_ROLLOUT_SERVER_URLS"
"""The URLs of the servers the launcher started (rollout.servers.count), comma-separated."""
LOGS_ENV = "RLBATCH_ROLLOUT_SERVER_LOGS"
"""Their log files, in the same order."""


log = logging.getLogger("rlbatch.rollout")


def server_urls(cfg: RunConfig) -> list[str]:
    """rollout.servers.urls, or the servers the launcher started for this run."""
    urls = [str(u).rstrip("/") for u in cfg.rollout.servers.urls]
    if urls:
        return urls
    started = os.environ.get(URLS_ENV, "")
    if not started:
        raise RuntimeError(
            f"rollout.servers.count={cfg.rollout.servers.count} but no server was started for"
            " this process (rlbatch-train and rlbatch-eval start them before the workers)"
        )
    return started.split(",")


class ServerPool:
    """The process's connection to the run's servers: shared by every backend of the process
    (training rollouts and evaluation), like the weights the servers hold."""

    def __init__(
        self,
        urls: list[str],
        timeout_s: float,
        concurrency: int,
        nonce: str,
        keep_going: bool,
        *,
        pushes: bool = True,
        max_restarts: Optional[int] = None,
        logs: Optional[dict[str, str]] = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.urls = list(urls)
        """The pool: the servers this process still sends to."""
        self.dropped: dict[str, str] = {}
        """Servers left out of the pool (rollout.servers.on_failure=continue) and why."""
        self.keep_going = keep_going
        self.max_restarts = max_restarts
        """rollout.servers.on_failure=restart: how many times a server may come back; None:
        another mode."""
        self.logs = logs or {}
        self.start_timeout_s = start_timeout_s
        self.down: dict[str, str] = {}
        """on_failure=restart: servers out of the pool until they are back and synced, and
        why they left it."""
        self.restarted: Counter[str] = Counter()
        """on_failure=restart: how many times each server came back."""
        self.rejoined = 0
        """Servers taken back since the last round's figures."""
        self.rejoin: Any = None
        """on_failure=restart: the backend's way to bring one server back when none is left
        (a callable returning once one is in the pool, or raising)."""
        self.rejoin_lock = threading.Lock()
        self.rejoin_error: Optional[BaseException] = None
        """What :attr:`rejoin` raised: the other rows waiting for it raise it too (rather than
        each waiting ``start_timeout_s`` again)."""
        self.kept: Optional[tuple[dict[str, Any], bool]] = None
        """on_failure=restart, the pushing process: the tensors of the last sync (and whether
        it dropped the cache), for a server that comes back while no other is left."""
        self.timeout_s = timeout_s
        self.nonce = nonce
        self.pushes = pushes  # False: another process of the run pushes (a generation worker)
        self.syncs = 0
        self.model_id: Optional[int] = None
        self.version: Optional[int] = None
        self.outstanding = dict.fromkeys(urls, 0)
        self.pinned: dict[str, str] = {}
        """Agent episode -> the server its calls go to (its prefix cache holds the episode's
        conversation), from the episode's first call until the agent engine releases it."""
        self.cache_version: Optional[int] = None
        """The policy version at which a sync last dropped the servers' prefix cache."""
        self.synced_version: Optional[int] = None
        """The policy version of the last sync."""
        self.group: Any = None
        """rollout.servers.transfer=broadcast: the weight group (rlbatch.rollout.servers.sync)."""
        self.probe_logps: Optional[list[float]] = None
        """The trainer's log-probabilities of the probe's fixed tokens at the last sync."""
        self.pushed: Optional[dict[str, Any]] = None
        """debug.fail_sync=stale: the weights of the previous sync."""
        self.resubmits = 0
        """Rows sent again because a server aborted them, since the last round's figures."""
        self.ties = random.Random()
        """Breaks ties between equally loaded servers for requests of no episode."""
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="rlbatch-rollout")

    def label(self) -> str:
        return f"{self.nonce}-{self.syncs}"

    def least_loaded(self, episode: Optional[str] = None) -> str:
        """The server for one request, counted outstanding until :meth:`done`. A request of an
        agent episode goes to the episode's server while that server is in the pool; an
        episode's first call (or one whose server left the pool) goes to the server with the
        fewest episodes pinned, then the fewest requests outstanding (ties: the pool's order),
        and is pinned there; a request of no episode to the one with the fewest requests
        outstanding, a tie broken at random: with the pool's order, a round's calls sent in the
        same order every turn (an agent engine's decode batches are sorted) would land on the
        same servers every turn, pinning each episode by accident, and routing=least_loaded
        would measure affine routing. The choice of server never changes a row's tokens (its
        own seed, the same weights everywhere). With no server left but some restarting
        (on_failure=restart): waits for the first one back (:attr:`rejoin`)."""
        while True:
            with self.lock:
                if self.urls:
                    break
                if not (self.down and self.rejoin is not None):
                    raise self.none_left()
            with self.rejoin_lock:  # one thread brings a server back, the others wait
                if self.rejoin_error is not None:
                    raise self.rejoin_error
                with self.lock:
                    empty = not self.urls
                if empty:
                    try:
                        self.rejoin()
                    except BaseException as err:
                        self.rejoin_error = err
                        raise
        with self.lock:
            if not self.urls:
                raise self.none_left()
            url = self.pinned.get(episode) if episode is not None else None
            if url not in self.urls:
                if episode is None:
                    fewest = min(self.outstanding[u] for u in self.urls)
                    url = self.ties.choice([u for u in self.urls if self.outstanding[u] == fewest])
                else:
                    held = Counter(self.pinned.values())
                    url = min(self.urls, key=lambda u: (held[u], self.outstanding[u]))
                    self.pinned[episode] = url
            assert url is not None
            self.outstanding[url] += 1
        return url

    def unpin(self, episodes: Sequence[str]) -> None:
        """Forget the servers of ``episodes`` (they ended)."""
        with self.lock:
            for key in episodes:
                self.pinned.pop(key, None)

    def drop(self, url: str, error: ServerError) -> None:
        """Leave ``url`` out from now on (on_failure=continue and a server that is down), or
        raise ``error`` (on_failure=stop, or an answer that is wrong rather than missing);
        on_failure=restart: out of the pool until it is back (:meth:`readmit`)."""
        if self.max_restarts is not None and isinstance(
            error, (ServerDownError, ServerRestartedError)
        ):
            self._restarting(url, error)
            return
        if not (self.keep_going and isinstance(error, ServerDownError)):
            raise error
        with self.lock:
            if url not in self.urls:
                return
            self.urls.remove(url)
            self.dropped[url] = str(error)
            left = len(self.urls)
        log.warning(
            "rollout server %s left the pool (rollout.servers.on_failure=continue), %d left: %s",
            url, left, error,
        )  # fmt: skip
        if not left:
            raise self.none_left() from error

    def _restarting(self, url: str, error: ServerError) -> None:
        with self.lock:
            if url not in self.urls:
                return
            n, most = self.restarted[url], self.max_restarts
            if most is not None and n >= most:
                raise ServerError(
                    f"rollout server {url} failed again after {n} restart(s)"
                    f" (rollout.servers.max_restarts={most}): {error}; its log: {self.log_of(url)}"
                ) from error
            self.urls.remove(url)
            self.down[url] = str(error)
            left = len(self.urls)
        log.warning(
            "rollout server %s is down: out of the pool until it is restarted and holds the"
            " run's weights (rollout.servers.on_failure=restart), %d left: %s", url, left, error,
        )  # fmt: skip

    def readmit(self, url: str) -> None:
        """``url`` is back (restarted and synced): in the pool again."""
        with self.lock:
            if self.down.pop(url, None) is None:
                return
            self.urls.append(url)
            self.restarted[url] += 1
            self.rejoined += 1
            n = self.restarted[url]
        log.warning("rollout server %s is back in the pool (restart %d)", url, n)

    def log_of(self, url: str) -> str:
        return self.logs.get(url, "(no log: started outside this run)")

    def take_rejoined(self) -> int:
        with self.lock:
            taken, self.rejoined = self.rejoined, 0
        return taken

    def none_left(self) -> ServerError:
        gone = {**self.dropped, **self.down}
        names = "; ".join(f"{url} ({why}; log: {self.log_of(url)})" for url, why in gone.items())
        return ServerError(f"no rollout server is left: every one failed: {names}")

    def done(self, url: str) -> None:
        with self.lock:
            self.outstanding[url] -= 1

    def count_resubmit(self) -> None:
        with self.lock:
            self.resubmits += 1

    def take_resubmits(self) -> int:
        """Rows sent again since the last call (a server aborted them)."""
        with self.lock:
            taken, self.resubmits = self.resubmits, 0
        return taken
