"""When a weight sync drops the rollout servers' prefix cache (rollout.servers.on_update; the
end-to-end runs are in tests/e2e/test_vllm_servers.py)."""

from __future__ import annotations

from rlbatch.rollout.servers.cache import drops_cache


def _drops(versions, keep, max_staleness):
    """The versions at which syncs to ``versions`` in turn drop the cache."""
    cached, dropped = None, []
    for version in versions:
        if drops_cache(keep, cached, version, max_staleness):
            cached = version
            dropped.append(version)
    return dropped


def test_abort_drops_the_cache_at_every_sync():
    assert _drops(range(5), keep=False, max_staleness=3) == [0, 1, 2, 3, 4]


def test_keep_drops_it_at_the_first_sync_then_at_least_every_max_staleness_versions():
    """The process's first sync (the cache may hold another run's KV), then whenever the
    cache would be max_staleness versions old."""
    assert _drops(range(8), keep=True, max_staleness=3) == [0, 3, 6]
    assert _drops([5, 7, 9, 11, 13], keep=True, max_staleness=3) == [5, 9, 13]
    assert _drops(range(3), keep=True, max_staleness=1) == [0, 1, 2]
