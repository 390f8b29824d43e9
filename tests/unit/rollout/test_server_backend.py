"""When rollout.backend=vllm_server's syncs drop the servers' prefix cache (the end-to-end runs
are in tests/e2e/test_vllm_servers.py)."""

from __future__ import annotations

import pytest

from rlbatch.rollout.server_backend import ServerBackend, _Servers

URL = "http://127.0.0.1:9"


def _backend(syncs: int) -> ServerBackend:
    backend = ServerBackend.__new__(ServerBackend)  # no model: only the labels matter here
    backend.servers = _Servers([URL], timeout_s=1.0, concurrency=1, nonce="abc", keep_going=False)
    backend.servers.syncs = syncs
    return backend


@pytest.mark.parametrize("keeps", [False, True])
def test_a_process_first_sync_drops_the_servers_cache_even_when_keeping_it(keeps):
    """rollout.servers.on_update=keep keeps the prefix cache across the run's own updates only:
    the first sync of a process (a new run, a resumed one) drops what the servers cached
    under weights another process pushed; abort drops it at every sync."""
    drops = []
    for syncs in (1, 2, 3):
        backend = _backend(syncs)
        backend.drops_cache = not keeps
        drops.append(backend._drops_cache())
    assert drops == ([True, False, False] if keeps else [True, True, True])
