"""When a weight sync drops the rollout servers' prefix cache (rollout.servers.on_update).

vLLM keys its prefix cache by token ids alone: a cached block keeps the KV of the weights that
computed it across any number of weight updates, and every request that starts with those
tokens (the chat template's header is in every prompt) decodes on it. ``abort`` drops the cache
at every sync, so each token is sampled by its own version's weights alone. ``keep`` leaves it,
and then the cache's KV is bounded in age by ``grpo.max_staleness``: a sync drops it when the
oldest version it may hold is that many versions older than the new one, and at the first sync
of a process (the cache may hold KV of weights another run pushed). A token sampled with
``keep`` may then rest on KV of any version from the cache's last drop on; its recorded version
(``Sample.token_versions``) is still the one that sampled it.

Why not a cache salt per version (vLLM's ``cache_salt`` keeps requests of different salts apart
in the cache): blocks of an older version would never be reused by a newer one, so every request
after a sync recomputes its whole prefix under the new weights, which is ``abort`` exactly, with
the old blocks left to age out instead of being dropped.
"""

from __future__ import annotations

from typing import Optional


def drops_cache(keep: bool, cache_version: Optional[int], version: int, max_staleness: int) -> bool:
    """Whether the sync to policy ``version`` drops the servers' prefix cache; ``keep``:
    rollout.servers.on_update=keep, ``cache_version``: the version at the last drop (None:
    this process has not synced yet)."""
    if not keep or cache_version is None:
        return True
    return version - cache_version >= max(max_staleness, 1)
